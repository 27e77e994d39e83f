#!/usr/bin/env bash
# Build the core with no Python and run its plain C tests:
#   tests/c/run.sh [cc] [cases] [runner]
# test_kernels: each instruction set's kernels against the scalar ones;
# test_forward: attnx_forward on [cases] random problems (default 300)
# against a naive attention. The core's sources come from csrc/sources.txt,
# built with ATTNX_TEST_HOOKS (scratch.c: a buffer made unavailable), once
# for both tests, a source a core at a time; CFLAGS and LDFLAGS are added
# (tools/emulate.sh: the AVX-512 kernels on SIMDe). With ATTNX_C_OBJECTS=DIR
# the core's objects are DIR/csrc/<source>.o, an extension build's (built
# with ATTNX_TEST_HOOKS and the same flags), and only the tests are compiled.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cc=${1:-cc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c11 -O2 -Wall -Wextra -Wno-unused-parameter -DATTNX_TEST_HOOKS ${CFLAGS:-} -I"$here/csrc")
export cc out here
export flags_line="${flags[*]}"
if [[ -n ${ATTNX_C_OBJECTS:-} ]]; then
    # the core's objects as a build of the extension left them (setup.py's
    # build/temp.*/csrc/, compiled with -DATTNX_TEST_HOOKS in ATTNX_EXTRA_CFLAGS:
    # tools/sanitize.sh and tools/emulate.sh), not compiled a second time
    grep -v '^#' "$here/csrc/sources.txt" | while read -r src; do
        o=$ATTNX_C_OBJECTS/csrc/${src%.c}.o
        [[ -f $o ]] || { echo "tests/c/run.sh: no $o (ATTNX_C_OBJECTS)" >&2; exit 1; }
        cp "$o" "$out/$(echo "$src" | tr / _).o"
    done
else
    grep -v '^#' "$here/csrc/sources.txt" | xargs -P "$(nproc)" -I{} sh -c \
        'o="$out/$(echo "{}" | tr / _).o"; $cc $flags_line -c "$here/csrc/{}" -o "$o"'
fi
for t in test_kernels test_forward; do
    $cc "${flags[@]}" "$out"/*.o "$here/tests/c/$t.c" -o "$out/$t" -lm -lpthread ${LDFLAGS:-}
done
${3:-} "$out/test_kernels"
${3:-} "$out/test_forward" "${2:-300}"
