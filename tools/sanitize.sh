#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of attnx.
#
#   tools/sanitize.sh            build a sanitized copy, run the C core tests and
#                                the whole pytest suite once per instruction set
#   tools/sanitize.sh --build    only build; prints the directory of the copy
#                                (tools/fuzz.sh uses this)
#
# The source tree is never touched: the working tree (uncommitted changes
# included) is copied to a temporary directory, the extension is built there
# in place with ATTNX_EXTRA_CFLAGS/LDFLAGS, and pytest runs from that copy, so
# `import attnx` finds the sanitized _attnx*.so and not the one in the tree.
#
# Environment:
#   ATTNX_SANITIZE_DIR   where to put the copy (default: a new mktemp -d; kept
#                        when given, removed otherwise)
#   ATTNX_SANITIZE_REUSE  "1": with ATTNX_SANITIZE_DIR, a copy already built
#                        there (by an earlier run of this script on the same
#                        tree, as CI's sanitizer stage before its fuzzing) is
#                        used as it is, not copied and built again
#   ATTNX_SANITIZE_ISAS  instruction sets to run (default: scalar avx2 avx512,
#                        those the CPU has)
#   ATTNX_SANITIZE_FULL  "all": the whole suite on every ISA; default: the whole
#                        suite (but the files of tools/tests_without_c.txt, which
#                        reach no C code of their own, and of tools/tests_integrations.txt,
#                        which reach it through the entry points the others test)
#                        on the best ISA (the last one run) and, on the
#                        others, the files whose code paths depend on the ISA
#                        (ATTNX_SANITIZE_SUBSET; the suite under ASan takes
#                        ~4 min an ISA here, mostly the hypothesis tests)
#   ATTNX_SANITIZE_SUBSET  pytest paths for those other ISAs (default:
#                        tools/tests_isa_paths.txt)
#   ATTNX_SANITIZE_C_CASES  cases of tests/c/test_forward.c (tests/c/run.sh, which
#                        also runs tests/c/test_kernels.c; default 60; 0 skips both)
#   PYTEST_ADDOPTS       passed on to pytest as usual
#
# Exits non-zero when a test fails or any sanitizer reports anything (in the
# pytest process or in a child it started: every report is also written to a
# log file and the logs are checked at the end).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-run}

CC=${CC:-gcc}
SAN_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
SAN_LDFLAGS="-fsanitize=address,undefined"

if [[ -n "${ATTNX_SANITIZE_DIR:-}" ]]; then
    work=$ATTNX_SANITIZE_DIR
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/attnx-sanitize.XXXXXX")
    [[ $mode == --build ]] || trap 'rm -rf "$work"' EXIT
fi
tree=$work/tree
logs=$work/logs

# ---- 1. a copy of the working tree, built with the sanitizers --------------
if [[ ${ATTNX_SANITIZE_REUSE:-} == 1 && -n ${ATTNX_SANITIZE_DIR:-} ]] \
        && compgen -G "$tree/attnx/_attnx*.so" >/dev/null; then
    echo "== reusing the sanitized extension built in $tree"
    rm -rf "$logs"
    mkdir -p "$logs"
    t0=$SECONDS
else
rm -rf "$tree" "$logs"
mkdir -p "$tree" "$logs"
(cd "$src" && tar cf - --exclude=.git --exclude=build --exclude='*.so' --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis .) | (cd "$tree" && tar xf -)

echo "== building the sanitized extension in $tree"
t0=$SECONDS
# (with the C tests' hooks, inert in the extension: the C tests below link
# these objects instead of compiling the core again)
(cd "$tree" && CC=$CC ATTNX_EXTRA_CFLAGS="$SAN_CFLAGS -DATTNX_TEST_HOOKS" ATTNX_EXTRA_LDFLAGS="$SAN_LDFLAGS" \
    python setup.py -q build_ext --inplace >"$work/build.log" 2>&1) \
    || { cat "$work/build.log"; echo "sanitize: build failed" >&2; exit 1; }
fi
so=$(ls "$tree"/attnx/_attnx*.so)
# (the symbols are read whole first: `nm | grep -q` under pipefail fails at
# random when grep exits early and nm dies of SIGPIPE)
syms=$(nm -D "$so")
grep -q __asan_report <<<"$syms" || { echo "sanitize: $so has no ASan instrumentation" >&2; exit 1; }
grep -q __ubsan_handle <<<"$syms" || { echo "sanitize: $so has no UBSan instrumentation" >&2; exit 1; }
echo "   built in $((SECONDS - t0)) s: $so"

# The interpreter itself is not instrumented, so the ASan runtime must be the
# first library loaded: LD_PRELOAD it (the UBSan runtime comes in as a
# dependency of the .so).
libasan=$($CC -print-file-name=libasan.so)
[[ -f $libasan ]] || { echo "sanitize: no libasan.so for $CC" >&2; exit 1; }
# libstdc++ right after it: ASan intercepts __cxa_throw and needs the real one
# loaded when it starts, or the first C++ exception (torch, atheris) aborts
# with "CHECK failed: ... real___cxa_throw".
libstdcxx=$($CC -print-file-name=libstdc++.so.6)
preload=$libasan
[[ -f $libstdcxx ]] && preload="$libasan:$libstdcxx"
# the interpreter itself, not a shell shim (pyenv) that would run under ASan
PY=$(python -c 'import sys; print(sys.executable)')

# detect_leaks=0 for Python: CPython, NumPy and torch leave interned objects,
# module state and arenas allocated at exit on purpose, and LeakSanitizer
# reports thousands of such blocks that are not attnx's. attnx's own C code is
# leak-checked by the C core test below (leak detection on), and Python-level
# leaks by the reference-count and RSS tests of the suite.
# allocator_may_return_null=1: the tests ask for more memory than exists and
# expect MemoryError; ASan would otherwise abort on the huge malloc.
common="halt_on_error=1:print_stacktrace=1:log_path=$logs/report"
py_asan="detect_leaks=0:allocator_may_return_null=1:abort_on_error=0:$common"
ubsan="halt_on_error=1:print_stacktrace=1:log_path=$logs/report"

sanitized_env() {   # run a command with the sanitizer runtime and options
    env LD_PRELOAD="$preload" ASAN_OPTIONS="$py_asan" UBSAN_OPTIONS="$ubsan" \
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 "$@"
}

# Make sure it really is the sanitized build that Python imports.
(cd "$tree" && sanitized_env "$PY" -c "
import attnx, sys
f = attnx._attnx.__file__
assert f.startswith(sys.argv[1]), f'imported {f}, not the sanitized build'
" "$tree")

if [[ $mode == --build ]]; then
    # for tools/fuzz.sh: the tree, the runtime and the options, one per line
    printf '%s\n' "$tree" "$preload" "$py_asan" "$ubsan" "$logs" "$PY"
    exit 0
fi

check_logs() {   # any report file means a sanitizer spoke, even in a child
    if compgen -G "$logs/report*" >/dev/null; then
        echo "sanitize: sanitizer report(s) after $1:" >&2
        cat "$logs"/report* >&2
        exit 1
    fi
}

# ---- 2. the C core tests, leak detection on ----------------------------------
if [[ ${ATTNX_SANITIZE_C_CASES:-60} != 0 ]]; then
echo "== C core tests under ASan+UBSan (leak detection on)"
t0=$SECONDS
objects=$(ls -d "$tree"/build/temp.*)
ASAN_OPTIONS="detect_leaks=1:$common" UBSAN_OPTIONS="$ubsan" \
    CFLAGS="$SAN_CFLAGS" LDFLAGS="$SAN_LDFLAGS" ATTNX_C_OBJECTS=$objects \
    "$tree/tests/c/run.sh" "$CC" "${ATTNX_SANITIZE_C_CASES:-60}" || { check_logs "the C core tests"; exit 1; }
check_logs "the C core tests"
echo "   $((SECONDS - t0)) s"
fi

# ---- 3. the whole pytest suite, once per instruction set --------------------
available=$(cd "$tree" && sanitized_env "$PY" -c "import attnx; print(' '.join(attnx._attnx.available_isas()))")
isas=${ATTNX_SANITIZE_ISAS:-scalar avx2 avx512}
best=""
for isa in $isas; do [[ " $available " == *" $isa "* ]] && best=$isa; done
# the files whose code paths depend on the ISA (tools/tests_isa_paths.txt)
default_subset=$(sed '/^#/d' "$tree/tools/tests_isa_paths.txt")
# the files the whole-suite run leaves out (ATTNX_SANITIZE_FULL=all runs them too)
ignored=()
for f in $(sed '/^#/d' "$tree/tools/tests_without_c.txt" "$tree/tools/tests_integrations.txt"); do
    [[ -e $tree/$f ]] || { echo "sanitize: $f (tools/tests_without_c.txt or tests_integrations.txt) does not exist" >&2; exit 1; }
    ignored+=("--ignore=$f")
done
subset=()
for f in ${ATTNX_SANITIZE_SUBSET:-$default_subset}; do
    # a file that is not there is an error, not a silent skip: a renamed test
    # file would otherwise drop out of the sanitizer runs unnoticed
    [[ -e $tree/$f ]] || { echo "sanitize: $f (ATTNX_SANITIZE_SUBSET) does not exist" >&2; exit 1; }
    subset+=("$f")
done
for isa in $isas; do
    if [[ " $available " != *" $isa "* ]]; then
        echo "== ATTNX_ISA=$isa: not available on this CPU ($available), skipped"
        continue
    fi
    what=(tests "${ignored[@]}")
    [[ ${ATTNX_SANITIZE_FULL:-} == all ]] && what=(tests)
    [[ ${ATTNX_SANITIZE_FULL:-} == all || $isa == "$best" || ${#subset[@]} -eq 0 ]] || what=("${subset[@]}")
    echo "== pytest under ASan+UBSan, ATTNX_ISA=$isa: ${what[*]}"
    t0=$SECONDS
    rc=0
    (cd "$tree" && sanitized_env ATTNX_ISA=$isa "$PY" -m pytest -q -p no:cacheprovider "${what[@]}") || rc=$?
    check_logs "pytest with ATTNX_ISA=$isa"
    if [[ $rc -ne 0 ]]; then
        echo "sanitize: pytest failed with ATTNX_ISA=$isa (exit $rc)" >&2
        exit $rc
    fi
    echo "   $((SECONDS - t0)) s"
done
echo "sanitize: no sanitizer report, all tests passed"
