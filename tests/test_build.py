"""The build: setup.py's extension follows every header of csrc/ (issue 33: a
header edit left `setup.py build_ext --inplace` on a stale extension)."""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extension():
    import setuptools  # noqa: F401  (its distutils, with run_setup)
    from distutils.core import run_setup
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        dist = run_setup("setup.py", stop_after="init")
    finally:
        os.chdir(here)
    (ext,) = dist.ext_modules
    return ext


def test_extension_depends_on_every_header():
    if not os.path.exists(os.path.join(ROOT, "setup.py")):
        pytest.skip("not a source tree")
    ext = _extension()
    headers = sorted(os.path.relpath(p, ROOT)
                     for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True))
    assert headers, "csrc/ holds no header?"
    assert sorted(os.path.normpath(d) for d in ext.depends) == headers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds with the system's cc")
def test_header_edit_rebuilds(tmp_path):
    """In a copy of the tree, build in place, touch a header, build again:
    the second build compiles (it was 'skipping ... (up-to-date)')."""
    if not os.path.exists(os.path.join(ROOT, "setup.py")):
        pytest.skip("not a source tree")
    import shutil
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "csrc"), tree / "csrc")
    shutil.copy(os.path.join(ROOT, "setup.py"), tree)
    os.makedirs(tree / "attnx")
    def cmd(verbosity):
        return [sys.executable, "setup.py", verbosity, "build_ext", "--inplace", "--build-temp", "bt"]
    env = dict(os.environ, ATTNX_EXTRA_CFLAGS="-O0")   # a quick build: only its trigger matters
    first = subprocess.run(cmd("-q"), cwd=tree, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(cmd("-v"), cwd=tree, capture_output=True, text=True, env=env, timeout=600)
    assert "skipping" in again.stdout + again.stderr, "nothing changed, yet it rebuilt"
    header = tree / "csrc" / "kernels" / "kernels_simd.h"
    later = os.stat(next(tree.glob("attnx/_attnx*"))).st_mtime + 10
    os.utime(header, (later, later))
    third = subprocess.run(cmd("-v"), cwd=tree, capture_output=True, text=True, env=env, timeout=600)
    assert third.returncode == 0, third.stderr
    assert "skipping" not in third.stdout + third.stderr, third.stdout[-2000:]
