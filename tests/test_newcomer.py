"""Importing attnx from a source tree that holds no built extension.

Run from the root of a fresh clone, ``pip install . && python -m attnx``
imports the clone's ``attnx/`` (no ``_attnx*.so`` in it), not the installed
package: the current directory comes first on sys.path. Python's own message
would then be "cannot import name '_attnx' from partially initialized module
'attnx' (most likely due to a circular import)"; the import must instead say
what happened and what to run.

Each case copies the package's ``.py`` files (not the extension) into a temporary
directory and imports attnx from there in a subprocess whose ``sys.path[0]`` is
that directory (``python -c`` / ``python -m``). ``-S`` leaves site-packages out:
the editable install of a development checkout puts an import hook on
``sys.meta_path`` that would hand the copy the checkout's ``attnx._attnx``,
whereas in the README's case (a regular install) only the copy's own directory
is searched for the extension. Nothing past ``import attnx``'s first line runs,
so numpy is not needed.

README's own commands, in a fresh clone and a fresh venv, run in ``.ci/run``
(stage "newcomer").
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnx

PKG = Path(attnx.__file__).resolve().parent


def _source_copy(tmp_path: Path) -> Path:
    """A directory holding attnx/ with the package's .py files only."""
    dst = tmp_path / "attnx"
    dst.mkdir()
    for f in PKG.glob("*.py"):
        shutil.copy2(f, dst / f.name)
    return tmp_path


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONSTARTUP"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["-c", "import attnx"], ["-m", "attnx"]],
                         ids=["import", "python -m attnx"])
def test_import_from_unbuilt_source_tree_says_what_to_do(tmp_path: Path, args: list[str]) -> None:
    root = _source_copy(tmp_path)
    r = _run(root, *args)
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr
    assert "circular import" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), err
    assert "C extension attnx._attnx is not built" in last, err
    assert str(root / "attnx") in last, err          # where it was imported from
    assert "pip install -e ." in last, err           # what to run
    assert "pip install ." in last and "another directory" in last, err


def test_extension_that_fails_to_load_keeps_its_own_error(tmp_path: Path) -> None:
    # An extension file is there but broken (here: not a shared object at all):
    # its loader's error is the informative one, not "not built".
    root = _source_copy(tmp_path)
    (root / "attnx" / ("_attnx" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    r = _run(root, "-c", "import attnx")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ImportError" in r.stderr, r.stderr
    assert "not built" not in r.stderr, r.stderr
