"""Type hints: ``mypy --strict`` passes on a small realistic usage file.

``tests/typing/usage.py`` uses the public API the way a user would and gives
every result an explicit type, so a return type that regressed to ``Any`` or
to a union fails the check. A second snippet holds deliberate mistakes that
mypy must flag (so the annotations are really seen, not silently ``Any``).
The modules whose annotations this project maintains are checked strictly
too; other modules are followed silently, as for an installed package.

Skipped when mypy is not installed (CI installs it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import attnx

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (pip install mypy)")

TESTS = Path(__file__).resolve().parent
USAGE = TESTS / "typing" / "usage.py"
PKG = Path(attnx.__file__).resolve().parent
# the modules whose own code must pass --strict (the others are followed silently)
STRICT_MODULES = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))

def _config() -> str:
    """The project's mypy settings (pyproject.toml) as a mypy.ini for a scratch
    directory: imports followed silently, as for an installed package, and the
    large optional libraries that pyproject.toml skips skipped here too (one
    list, in pyproject.toml)."""
    import tomllib                  # Python >= 3.11; mypy runs only in CI's Python

    conf = tomllib.loads((TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))
    skipped = [m for o in conf["tool"]["mypy"].get("overrides", [])
               if o.get("follow_imports") == "skip" for m in o["module"]]
    assert skipped, "pyproject.toml: no [[tool.mypy.overrides]] with follow_imports = skip"
    return "[mypy]\nfollow_imports = silent\nwarn_unused_configs = True\n" + "".join(
        f"[mypy-{m}]\nfollow_imports = skip\n" for m in skipped)

BAD = '''\
import numpy as np
from numpy.typing import NDArray
import attnx

q = np.zeros((1, 2, 3, 4), dtype=np.float32)
attnx.scaled_dot_product_attention(q, q, q, layout="lbhd")             # line 6: not a layout
attnx.scaled_dot_product_attention(q, q, q, is_causal="causal")        # line 7: not a mode
w: NDArray[np.float64] = attnx.scaled_dot_product_attention(q, q, q)   # line 8: float32 result
out: NDArray[np.float32] = attnx.reference(q, q, q)                    # line 9: float64 result
o, ww = attnx.scaled_dot_product_attention(q, q, q, need_weights=True)
ww.no_such_method()                                                    # line 11: an ndarray
attnx.causal_mask("3")                                                 # line 12: not an int
attnx.set_num_threads("2")                                             # line 13: not an int
mha = attnx.MultiHeadAttention(16, 2)
n: str = mha.d_head                                                    # line 15: an int
attnx._attnx.forward(q, q, q)                                          # line 16: too few arguments
ol: NDArray[np.float32] = attnx.scaled_dot_product_attention(q, q, q, return_lse=True)  # 17: a pair
attnx.scaled_dot_product_attention(q, q, q, window=4)                  # line 18: not a pair
attnx.scaled_dot_product_attention(q, q, q, alignment="center")        # line 19: not an alignment
g = attnx.scaled_dot_product_attention_vjp(q, q, q)[1](q)
g.dq                                                                   # line 21: no such field
m: NDArray[np.float32] = attnx.merge_attention([q], [q])               # line 22: (out, lse)
p: dict[str, int] = mha.parameters()                                   # line 23: arrays
cache = attnx.KVCache(1, 2, 8, 4)
kv: tuple[NDArray[np.float32], NDArray[np.float32]] = cache.attend(q)  # line 25: an ndarray
cache.append(q)                                                        # line 26: k_new and v_new
mha(q[0], layout="blhd")                                               # line 27: not the layer's
attnx.varlen_attention(q[0], q[0], q[0], [0, 3], [0, 3], key_lengths=[3])  # 28: not varlen's
attnx.scaled_dot_product_attention_backward(q, q, q, q, q, q, softcap="1")  # 29: not a float
'''
BAD_LINES = {6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 18, 19, 21, 22, 23, 25, 26, 27, 28, 29}


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    """Run mypy with the project's settings; returns run(files) -> (returncode, output)."""
    tmp = tmp_path_factory.mktemp("mypy")
    config = tmp / "mypy.ini"
    config.write_text(_config())
    env = dict(os.environ)
    # An editable install is an import hook mypy cannot follow: point it at the sources.
    site_dirs = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    if os.path.realpath(PKG.parent) not in site_dirs:
        env["MYPYPATH"] = str(PKG.parent)

    def run(*files):
        cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(config),
               "--cache-dir", str(tmp / "cache"), "--no-color-output", "--no-error-summary",
               "--show-error-codes", *map(str, files)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=240)
        return res.returncode, res.stdout + res.stderr

    return run


def test_usage_file_runs():
    res = subprocess.run([sys.executable, str(USAGE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_py_typed_and_stub_ship_with_the_package():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "_attnx.pyi").is_file()


def test_mypy_strict_passes_on_usage_and_the_typed_modules(mypy_run):
    files = [USAGE]
    if "MYPYPATH" in os.environ or os.path.realpath(PKG.parent) not in {
            os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}:
        files += [PKG / m for m in STRICT_MODULES]     # sources, not an installed wheel
    code, out = mypy_run(*files)
    assert code == 0, f"mypy --strict failed:\n{out}"


def test_mypy_sees_the_annotations(mypy_run, tmp_path):
    """Mistakes in a snippet are flagged, line by line (nothing is silently Any)."""
    bad = tmp_path / "bad_usage.py"
    bad.write_text(BAD)
    code, out = mypy_run(bad)
    assert code == 1, out
    flagged = {int(m.group(1)) for m in re.finditer(r"bad_usage\.py:(\d+): error", out)}
    assert flagged == BAD_LINES, out


# ------------------------------------------------------------------------ docs

# public names whose docstrings this project maintains here (plot_attention has its own tests)
DOCUMENTED = ["scaled_dot_product_attention", "MultiHeadAttention", "causal_mask",
              "padding_mask", "reference", "get_num_threads", "set_num_threads", "isa",
              "scaled_dot_product_attention_vjp", "scaled_dot_product_attention_backward",
              "merge_attention"]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_api_has_docstrings_with_examples(name):
    import inspect

    obj = getattr(attnx, name)
    doc = inspect.getdoc(obj) or ""
    assert name in attnx.__all__
    assert len(doc) > 80, f"{name}: docstring too short"
    assert ">>>" in doc, f"{name}: no example"
    if name in ("scaled_dot_product_attention", "MultiHeadAttention", "reference"):
        # shapes and the mask convention
        assert "(B" in doc and "Lq" in doc and "Lk" in doc, f"{name}: shapes missing"
        assert "True = may attend" in doc, f"{name}: mask convention missing"
    if name == "MultiHeadAttention":
        for method in ("__call__", "vjp", "load_torch", "from_torch"):
            assert ">>>" in (inspect.getdoc(getattr(obj, method)) or ""), f"{name}.{method}"
    # the signature is annotated (what help() and editors show)
    target = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(target)
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
    for p in sig.parameters.values():
        if p.name != "self":
            assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}): no annotation"


# every module whose docstrings hold examples, and what the optional ones need
DOCTEST_MODULES = sorted(
    "attnx" + ("" if p.stem == "__init__" else "." + ".".join(p.relative_to(PKG).with_suffix("").parts))
    for p in PKG.rglob("*.py") if ">>>" in p.read_text(encoding="utf-8"))
NEEDS = {"attnx.torch": "torch", "attnx.dask": "distributed", "attnx._plot": "matplotlib",
         "attnx.integrations._cache": "transformers"}


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    mod = importlib.import_module(module)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0, f"{res.failed} of {res.attempted} examples failed in {module}"
    assert res.attempted > 0
