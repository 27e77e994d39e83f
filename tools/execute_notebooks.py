"""Write docs/notebooks/*.ipynb: the notebooks of examples/, run, with their outputs.

    python tools/execute_notebooks.py [name.ipynb ...]

examples/ holds the notebooks without outputs (tests/test_notebooks.py runs them
and checks that); the docs site shows them with their outputs, and does not run
them when it is built (minutes, and a dask cluster). So this script runs each one
(in a scratch directory, as the test does) and stores the result here; the site
shows these copies. tests/test_docs.py checks that each copy's cells are those
of its notebook in examples/, so a notebook changed there must be run again here.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ["tour.ipynb", "compare.ipynb", "train.ipynb", "dask.ipynb"]


def main(names: list[str]) -> None:
    for name in names or NAMES:
        nb = nbformat.read(ROOT / "examples" / name, as_version=4)
        with tempfile.TemporaryDirectory() as tmp:
            nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": tmp}}).execute()
        for cell in nb.cells:          # no volatile ids or timings in the diff
            cell.get("metadata", {}).pop("execution", None)
        out = ROOT / "docs" / "notebooks" / name
        nbformat.write(nb, out)
        print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main(sys.argv[1:])
