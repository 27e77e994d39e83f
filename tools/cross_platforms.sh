#!/usr/bin/env bash
# The C core on the platforms this Linux machine cannot run natively
# (issue 57), with zig's clang (PyPI's ziglang) as the cross compiler,
# warnings as errors:
#   - macOS arm64 and x86_64: every core file and the extension's glue
#     compiled, and the extension linked (a Mach-O bundle); the glue against
#     NumPy's own macOS headers (its macOS wheel, downloaded) and this
#     Python's headers (a Linux pyconfig.h: compiled, not run);
#   - Windows x86_64 (MinGW-w64, winpthreads): the core and its C tests
#     built, then run under wine (Debian's wine64, installed if missing).
# aarch64 Linux is .ci/run's qemu stage. Usage: tools/cross_platforms.sh [cases]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cases=${1:-40}
work=$(mktemp -d /tmp/attnx-cross.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$here"

python -m venv "$work/zig"
"$work/zig/bin/python" -m pip install -q "ziglang==0.17.1"
zig_cc() { "$work/zig/bin/python" -m ziglang cc -target "$@"; }
# compile_all TARGET OUT FLAGS... -- SOURCES...: each csrc/SOURCE into OUT, a core at a time
compile_all() {
    local target=$1 out=$2
    shift 2
    local args=()
    while [[ $1 != -- ]]; do args+=("$1"); shift; done
    shift
    printf '%s\n' "$@" | xargs -P "$(nproc)" -I{} sh -c \
        'o="$0/$(echo "{}" | tr / _).o" py=$1 t=$2; shift 2; exec "$py" -m ziglang cc -target "$t" "$@" -c "csrc/{}" -o "$o"' \
        "$out" "$work/zig/bin/python" "$target" "${args[@]}"
}
mapfile -t core < <(sed '/^#/d' csrc/sources.txt)
mapfile -t glue < <(cd csrc && ls python/*.c)
flags=(-std=c11 -O2 -Wall -Wextra -Werror -Wno-unused-parameter -Icsrc)

# ---- macOS: the core and the extension, compiled and linked
py_include=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
numpy_version=$(python -c "import numpy; print(numpy.__version__)")
for arch in aarch64 x86_64; do
    platform=$([[ $arch == aarch64 ]] && echo macosx_14_0_arm64 || echo macosx_14_0_x86_64)
    python -m pip download -q --no-deps --only-binary=:all: --platform "$platform" \
        --python-version 3.11 "numpy==$numpy_version" -d "$work/numpy-$arch"
    python -m zipfile -e "$work/numpy-$arch"/numpy-*.whl "$work/numpy-$arch/x"
    out="$work/macos-$arch"
    mkdir -p "$out"
    compile_all "$arch-macos" "$out" "${flags[@]}" -fPIC -DNPY_NO_DEPRECATED_API=NPY_1_23_API_VERSION \
        -I"$py_include" -I"$work/numpy-$arch/x/numpy/_core/include" -- "${core[@]}" "${glue[@]}"
    zig_cc "$arch-macos" -shared -Wl,-undefined,dynamic_lookup "$out"/*.o -o "$out/_attnx.so"
    file "$out/_attnx.so" | grep -q "Mach-O 64-bit" || { file "$out/_attnx.so"; exit 1; }
    echo "macOS $arch: ${#core[@]} core files and ${#glue[@]} glue files compiled (-Werror), the extension linked"
done

# ---- Windows: the core and its C tests, run under wine
out="$work/windows"
mkdir -p "$out"
compile_all x86_64-windows-gnu "$out" "${flags[@]}" -DATTNX_TEST_HOOKS -- "${core[@]}"
for t in test_kernels test_forward; do
    zig_cc x86_64-windows-gnu "${flags[@]}" -DATTNX_TEST_HOOKS "$out"/*.o "tests/c/$t.c" \
        -o "$out/$t.exe" -lpthread
done
wine=/usr/lib/wine/wine64
if [[ ! -x $wine ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wine64 >/dev/null
fi
export WINEDEBUG=-all WINEPREFIX="$work/wineprefix"
echo "Windows x86_64 under wine:"
"$wine" "$out/test_kernels.exe"
"$wine" "$out/test_forward.exe" "$cases"
/usr/lib/wine/wineserver64 -w    # its files are written before the trap removes them
