#!/usr/bin/env bash
# The AVX-512 kernels, AVX512_BF16's and AMX's on a CPU that has none of
# them: a copy of the tree built with ATTNX_EMULATE_AVX512 (SIMDe's portable
# intrinsics for avx512.c, avx512_bf16.c and amx.c; the tile unit's model,
# csrc/kernels/tile_model.h, for the tiles), then
#   1. the C kernel and core tests (tests/c/run.sh), every ISA and every
#      bfloat16 dot product (avx512_bf16, amx_emulated) against the scalar ones;
#   2. the pytest files whose paths depend on the bfloat16 dot products
#      (ATTNX_EMULATE_TESTS), once per ATTNX_BF16_DOTS in ATTNX_EMULATE_DOTS,
#      on ATTNX_ISA=avx512.
# For correctness only: the emulated kernels are tens of times slower than
# real ones, and say nothing of speed. On a CPU with AVX512_BF16, CI runs the
# real kernels instead, and ATTNX_BF16_DOTS=amx_emulated needs no emulated
# build (amx_emulated.c is in every x86-64 build).
#
#   tools/emulate.sh           build the extension, run 1 on its objects, then 2
#   tools/emulate.sh --c-only  1 alone (the C tests compile the core themselves)
# (here, 2026-11-29, AVX2 EPYC: the build ~190 s, 1 ~55 s on its objects, each pytest run ~60 s)
# Environment:
#   ATTNX_EMULATE_SIMDE   SIMDe's include directory (default: the simde-py
#                         package's, from the [test] extra)
#   ATTNX_EMULATE_C_CASES cases of tests/c/test_forward.c (default 40; 0 skips 1)
#   ATTNX_EMULATE_DOTS    default "avx512_bf16 amx_emulated"
#   ATTNX_EMULATE_TESTS   default: default_tests below
set -euo pipefail
default_tests="tests/test_precision.py tests/test_bfloat16.py tests/test_peak.py tests/test_paged.py"
src=$(cd "$(dirname "$0")/.." && pwd)
simde=${ATTNX_EMULATE_SIMDE:-$(python -c 'import simde_py; print(simde_py.get_include())')}
[[ -f $simde/simde/x86/avx512.h ]] || { echo "emulate: no SIMDe headers in $simde" >&2; exit 1; }
# -O2 (the C tests' level; setup.py's -O3 takes 6 min and more for avx512.c
# on SIMDe). At -O1 the emulated AVX-512 ptx fails its test (2026-11-28, not
# yet understood): acc[0][0] comes out 1.0 above the scalar kernel's, the
# value of pv_block's rescale factor, which ptx's path never uses. It fails
# with -fno-strict-aliasing too, and passes at -O1 under ASan+UBSan (no
# report) and at -O2: a miscompile of SIMDe's code at -O1 is likelier than
# undefined behaviour in the kernel (2026-11-29, GCC 12).
flags="-DATTNX_EMULATE_AVX512 -I$simde -Wno-psabi -Werror=implicit-function-declaration -O2"

work=$(mktemp -d "${TMPDIR:-/tmp}/attnx-emulate.XXXXXX")
trap 'rm -rf "$work"' EXIT
tree=$work/tree
mkdir -p "$tree"
(cd "$src" && tar cf - --exclude=.git --exclude=build --exclude='*.so' --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis .) | (cd "$tree" && tar xf -)

c_tests() {   # c_tests [OBJECTS]: tests/c/run.sh on SIMDe, on those objects if given
    [[ ${ATTNX_EMULATE_C_CASES:-40} != 0 ]] || return 0
    echo "== C tests, AVX-512 on SIMDe and the tile model"
    local t0=$SECONDS
    CFLAGS="$flags" ATTNX_C_OBJECTS=${1:-} "$tree/tests/c/run.sh" cc "${ATTNX_EMULATE_C_CASES:-40}"
    echo "   $((SECONDS - t0)) s"
}
if [[ ${1:-} == --c-only ]]; then
    c_tests
    exit 0
fi

# the extension first, with the C tests' hooks (inert in it), so that the C
# tests link its objects instead of compiling the core a second time (on
# SIMDe, minutes)
echo "== building the emulated extension in $tree"
t0=$SECONDS
(cd "$tree" && ATTNX_EXTRA_CFLAGS="$flags -DATTNX_TEST_HOOKS" python setup.py -q build_ext --inplace \
    >"$work/build.log" 2>&1) || { cat "$work/build.log"; echo "emulate: build failed" >&2; exit 1; }
echo "   built in $((SECONDS - t0)) s"
c_tests "$(ls -d "$tree"/build/temp.*)"

run() {   # run DOTS COMMAND...: in the emulated tree, AVX-512 with those dot products
    local dots=$1
    shift
    (cd "$tree" && env ATTNX_ISA=avx512 ATTNX_BF16_DOTS="$dots" PYTHONPATH="$tree" \
        PYTHONDONTWRITEBYTECODE=1 "$@")
}
for dots in ${ATTNX_EMULATE_DOTS:-avx512_bf16 amx_emulated}; do
    echo "== pytest with ATTNX_ISA=avx512 ATTNX_BF16_DOTS=$dots (emulated)"
    t0=$SECONDS
    # the emulated build, with the kernels asked for, is what the tests import
    run "$dots" python -c "
import attnx, sys
assert attnx._attnx.__file__.startswith(sys.argv[1]), attnx._attnx.__file__
got = (attnx.isa(), attnx._attnx.bf16_dots())
assert got == ('avx512', sys.argv[2]), got
" "$tree" "$dots"
    # shellcheck disable=SC2086
    run "$dots" python -m pytest -q -p no:cacheprovider -x \
        ${ATTNX_EMULATE_TESTS:-$default_tests}
    echo "   $((SECONDS - t0)) s"
done
