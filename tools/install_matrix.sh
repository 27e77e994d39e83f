#!/usr/bin/env bash
# tools/install_matrix.sh: attnx installs where users are.
#
#   1. `python -m build` makes an sdist and a wheel (the wheel built from the sdist,
#      so a file missing from the sdist breaks the build here, not on a user's machine);
#   2. the wheel goes into a fresh venv (not editable) with the test dependencies,
#      its [transformers] extra (torch==2.13.0), NumPy 1.26 at run time (built
#      against NumPy 2) and the oldest transformers release the extra admits
#      (pyproject.toml), and the whole pytest suite runs against the installed
#      package, from a copy of tests/ outside the source tree, after asserting
#      that `import attnx` resolves to that venv's site-packages. The newest
#      transformers is .ci/run's newcomer's: README's test install takes the
#      [test] extra, whose transformers range is checked here to be the
#      [transformers] extra's, and runs the whole suite with the newest release
#      in that range;
#   3. the oldest and the newest Python among 3.9-3.13 found on this machine: a
#      wheel built from the sdist by that Python, installed and tested the same way
#      (without torch: torch==2.13.0 is not there for them, and an unpinned torch
#      from PyPI is a CUDA build of several GB; the torch tests skip).
#
# Usage: tools/install_matrix.sh [--quick | --pythons-only]
#        (--quick: skip step 3; --pythons-only: step 1 builds only the sdist, and
#        step 2 is skipped: CI runs step 3's two Pythons in its two lanes)
# Env:   PYTHON (the build Python, default python3), ATTNX_MATRIX_DIR (work dir,
#        default a fresh mktemp -d; removed on success unless ATTNX_MATRIX_KEEP=1),
#        ATTNX_MATRIX_PYTHONS (step 3's Pythons: versions, "3.9 3.13", or "oldest"
#        and/or "newest" of those found; default "oldest newest").
# Prints a summary and exits non-zero when any step fails.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
QUICK=0
PYTHONS_ONLY=0
[ "${1:-}" = "--quick" ] && QUICK=1
[ "${1:-}" = "--pythons-only" ] && PYTHONS_ONLY=1
WORK="${ATTNX_MATRIX_DIR:-$(mktemp -d /tmp/attnx-matrix.XXXXXX)}"
mkdir -p "$WORK"
LOG="$WORK/logs"; mkdir -p "$LOG"
export PIP_DISABLE_PIP_VERSION_CHECK=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
TEST_DEPS=("pytest>=7" "pytest-timeout>=2" "hypothesis>=6")
SUMMARY=()
FAILED=0
T0=$SECONDS

note() { printf '\n== %s\n' "$*"; }
record() {   # record NAME STATUS SECONDS [DETAIL]
    SUMMARY+=("$(printf '%-34s %-5s %4ss  %s' "$1" "$2" "$3" "${4:-}")")
    [ "$2" = PASS ] || FAILED=1
}
# step NAME LOGFILE CMD...: run CMD with its output in LOGFILE (tail shown on failure)
step() {
    local name=$1 log=$2; shift 2
    local t=$SECONDS
    if "$@" >"$log" 2>&1; then
        echo "   ok: $name ($((SECONDS - t)) s)"
        return 0
    fi
    echo "   FAILED: $name ($((SECONDS - t)) s); last lines of $log:"
    tail -n 30 "$log" | sed 's/^/     | /'
    return 1
}

# ------------------------------------------------------------------ 1. build
what="sdist + wheel"; only=()
[ "$PYTHONS_ONLY" = 1 ] && { what="sdist"; only=(--sdist); }
note "1. python -m build ($what) with $($PY -V 2>&1)"
t=$SECONDS
DIST="$WORK/dist"
# The build frontend runs from $WORK: a build/ folder in the source tree (setuptools'
# output) would shadow the `build` package for `python -m build` run from $ROOT.
if step "venv for the build frontend" "$LOG/tools-venv.log" \
        bash -c "'$PY' -m venv '$WORK/venv-tools' && '$WORK/venv-tools/bin/pip' install -q build" &&
   step "python -m build" "$LOG/build.log" \
        bash -c "cd '$WORK' && '$WORK/venv-tools/bin/python' -m build ${only[*]:-} --outdir '$DIST' '$ROOT'"; then
    SDIST=$(ls "$DIST"/attnx-*.tar.gz 2>/dev/null | head -n1)
    WHEEL=$(ls "$DIST"/attnx-*.whl 2>/dev/null | head -n1)
    [ "$PYTHONS_ONLY" = 1 ] && WHEEL="(none: --pythons-only)"
    if [ -n "$SDIST" ] && [ -n "$WHEEL" ]; then
        record "build sdist + wheel" PASS $((SECONDS - t)) "$(basename "$SDIST") $(basename "$WHEEL")"
    else
        record "build sdist + wheel" FAIL $((SECONDS - t)) "no sdist or no wheel in $DIST"
    fi
else
    record "build sdist + wheel" FAIL $((SECONDS - t)) "see $LOG/build.log"
    SDIST=""; WHEEL=""
fi

# A copy of the tests outside the source tree: nothing there can be imported as attnx.
SUITE="$WORK/suite"
rm -rf "$SUITE"; mkdir -p "$SUITE"
cp -r "$ROOT/tests" "$SUITE/tests"
# data the tests read beside tests/ (the notebooks of examples/), never the package
[ -d "$ROOT/examples" ] && cp -r "$ROOT/examples" "$SUITE/examples"
find "$SUITE" -name __pycache__ -prune -exec rm -rf {} +
[ -e "$SUITE/attnx" ] && { echo "internal error: $SUITE/attnx exists"; exit 2; }

# run_suite NAME VENV: assert attnx comes from VENV's site-packages, run the main
# job and the pytest suite from $SUITE (the same process imports attnx first, so
# the suite runs on exactly the module that was checked).
run_suite() {
    local name=$1 venv=$2
    local py="$venv/bin/python"
    (cd "$SUITE" && "$py" - "$ROOT" "$venv" <<'PYEOF'
import os, sys
root, venv = (os.path.realpath(p) for p in sys.argv[1:3])
import numpy, attnx, attnx._attnx as ext
for mod in (attnx, ext):
    f = os.path.realpath(mod.__file__)
    assert f.startswith(venv + os.sep) and "site-packages" in f, f"{mod.__name__} from {f}, not {venv}"
    assert not f.startswith(root + os.sep), f"{mod.__name__} imported from the source tree: {f}"
print(f"attnx {attnx.__version__} from {os.path.dirname(attnx.__file__)}; "
      f"Python {sys.version.split()[0]}, NumPy {numpy.__version__}, ISA {attnx.isa()}")
PYEOF
    ) || return 1
    (cd "$SUITE" && "$py" -m attnx >/dev/null) || { echo "python -m attnx failed"; return 1; }
    (cd "$SUITE" && "$py" - <<'PYEOF'
import os, sys
import attnx          # checked above: the installed package
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", os.getcwd(),
                      "-o", "timeout=300", "-ra", "tests"]))
PYEOF
    )
}

# env_test NAME PYTHON INSTALLABLE [EXTRA PIP ARGS...]: fresh venv, install, test
env_test() {
    local name=$1 python=$2 pkg=$3; shift 3
    local venv="$WORK/venv-$name" t=$SECONDS
    note "$name: $($python -V 2>&1), installing $(basename "$pkg") $*"
    rm -rf "$venv"
    if ! step "venv + install" "$LOG/$name-install.log" \
            bash -c "'$python' -m venv '$venv' && '$venv/bin/python' -m pip install -q --no-compile \"\$@\"" _ \
            "$pkg" "${TEST_DEPS[@]}" "$@"; then
        record "$name" FAIL $((SECONDS - t)) "install failed: $LOG/$name-install.log"
        return
    fi
    local np; np=$("$venv/bin/python" -c "import numpy; print(numpy.__version__)" 2>/dev/null)
    local torchv; torchv=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo none)
    if step "tests against the installed package" "$LOG/$name-tests.log" run_suite "$name" "$venv"; then
        record "$name" PASS $((SECONDS - t)) "numpy $np, torch $torchv: $(grep -E '[0-9]+ passed' "$LOG/$name-tests.log" | tail -n1)"
    else
        record "$name" FAIL $((SECONDS - t)) "numpy $np, torch $torchv: see $LOG/$name-tests.log"
    fi
}

# ---------- 2. the wheel with the oldest NumPy and transformers it admits
# The wheel (built against NumPy 2) with NumPy 1.26 at run time and the oldest
# transformers release the [transformers] extra admits ("transformers>=LO,<HI"
# in pyproject.toml: LO pinned), with the extra (torch==2.13.0 with it): the
# whole suite, the transformers tests (models, AttnxCache, continuous batching
# against sdpa's tokens) among it. torch 2.13 imports and runs with NumPy 1.26
# (its NumPy bridge checked by the torch tests). NumPy 2 at run time: CI's and
# the newcomer's editable installs with torch, and the wheels of step 3
# without it. The newest transformers is .ci/run's newcomer's: README's test
# install takes the [test] extra, whose transformers range is checked here to
# be the [transformers] extra's, and runs the whole suite with the newest
# release in that range. (One venv for both oldest: CI under 40 minutes.)
TF_RANGE=$(sed -n 's/^transformers = .*"transformers\(>=[0-9.]*,<[0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")
TF_OLDEST=$(printf '%s' "$TF_RANGE" | sed -n 's/^>=\([0-9.]*\),.*/\1/p')
same=$("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
pick = lambda e: sorted(r.replace(" ", "") for r in extras[e] if re.match(r"transformers\b", r))
print("yes" if pick("test") == pick("transformers") and pick("test") else "no")
PYEOF
)
[ "$same" = yes ] || record "transformers range: [test] = [transformers]" FAIL 0 \
    "the [test] extra's transformers range differs from the [transformers] extra's"
if [ -n "$WHEEL" ] && [ "$PYTHONS_ONLY" = 0 ]; then
    if [ -z "$TF_OLDEST" ]; then
        record "transformers range in pyproject.toml" FAIL 0 "no 'transformers>=LO,<HI' in the [transformers] extra"
    else
        PYV=$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        name="py$PYV-wheel-numpy1.26-transformers$TF_OLDEST"
        env_test "$name" "$PY" "$WHEEL[transformers]" "numpy==1.26.*" "transformers==$TF_OLDEST"
        venv_py="$WORK/venv-$name/bin/python"
        v=$("$venv_py" -c "import numpy; print(numpy.__version__)" 2>/dev/null)
        case "$v" in 1.26.*) ;; *) record "numpy 1.26 really installed" FAIL 0 "got numpy '$v'";; esac
        # (as versions: the extra's "5.23" is the release "5.23.0")
        v=$("$venv_py" -c "import transformers; print(transformers.__version__)" 2>/dev/null)
        "$venv_py" -c "import sys; from packaging.version import Version as V; sys.exit(V(sys.argv[1]) != V(sys.argv[2]))" \
            "$v" "$TF_OLDEST" 2>/dev/null ||
            record "transformers $TF_OLDEST really installed" FAIL 0 "got '$v'"
    fi
fi

# ------------------------------------- 3. oldest and newest Python among 3.9-3.13
find_python() {   # the interpreter for version X.Y, or nothing
    local v=$1 c
    for c in "python$v" "/root/.pyenv/versions/$v"*/bin/python "/usr/bin/python$v" "/usr/local/bin/python$v"; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys, venv; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    return 1
}
if [ "$QUICK" = 0 ] && [ -n "$SDIST" ]; then
    FOUND=()
    for v in 3.9 3.10 3.11 3.12 3.13; do
        p=$(find_python $v) && FOUND+=("$v=$p")
    done
    echo; echo "Pythons 3.9-3.13 on this machine: ${FOUND[*]:-none}"
    WANT=()
    for w in ${ATTNX_MATRIX_PYTHONS:-oldest newest}; do
        case "$w" in
            oldest) [ ${#FOUND[@]} -ge 1 ] && WANT+=("${FOUND[0]%%=*}") ;;
            newest) [ ${#FOUND[@]} -ge 1 ] && WANT+=("${FOUND[-1]%%=*}") ;;
            *) WANT+=("$w") ;;
        esac
    done
    [ ${#FOUND[@]} -lt 2 ] && record "oldest+newest Python present" FAIL 0 "found only: ${FOUND[*]:-none}"
    done_v=""
    for v in "${WANT[@]}"; do
        case " $done_v " in *" $v "*) continue;; esac
        done_v="$done_v $v"
        p=$(find_python "$v") || { record "py$v-from-sdist" FAIL 0 "python$v not found"; continue; }
        t=$SECONDS
        note "py$v: wheel built from the sdist by $p"
        rm -rf "$WORK/dist-$v" "$WORK/venv-build-$v"
        if step "pip wheel (isolated build: numpy>=2 for this Python)" "$LOG/py$v-wheel.log" \
                bash -c "'$p' -m venv '$WORK/venv-build-$v' && '$WORK/venv-build-$v/bin/python' -m pip wheel -q --no-deps -w '$WORK/dist-$v' '$SDIST'"; then
            w=$(ls "$WORK/dist-$v"/attnx-*.whl | head -n1)
            env_test "py$v-from-sdist" "$p" "$w"
        else
            record "py$v-from-sdist" FAIL $((SECONDS - t)) "wheel build failed: $LOG/py$v-wheel.log"
        fi
    done
fi

# ---------------------------------------------------------------- summary
echo
echo "================ install matrix summary ($((SECONDS - T0)) s, work dir $WORK)"
printf '%s\n' "${SUMMARY[@]}"
if [ "$FAILED" != 0 ]; then
    echo "install matrix: FAILED (logs in $LOG)"
    exit 1
fi
echo "install matrix: all passed"
if [ "${ATTNX_MATRIX_KEEP:-0}" != 1 ] && [ -z "${ATTNX_MATRIX_DIR:-}" ]; then
    rm -rf "$WORK"
fi
