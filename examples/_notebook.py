"""What the notebook generators (make_*_notebook.py) share: writing the cells
as a notebook without outputs, with stable cell ids, so that regenerating an
unchanged notebook gives the same file (tests/test_notebooks.py checks it)."""

from __future__ import annotations

import pathlib
import sys


def write(cells, default_out, argv=None):
    """Write ``cells`` (nbformat v4 cells) to argv[0], or ``default_out``; returns 0."""
    import nbformat

    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else pathlib.Path(default_out)
    nb = nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    for i, c in enumerate(nb.cells):
        c["id"] = f"cell-{i:02d}"
    nbformat.validate(nb)
    nbformat.write(nb, out)
    print(f"wrote {out}")
    return 0
