"""The notebooks in examples/ run top to bottom, headless, and are committed without outputs."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import under_asan

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["tour.ipynb", "compare.ipynb", "train.ipynb", "dask.ipynb"]
CELL_TIMEOUT = 180          # seconds per cell; the whole compare notebook takes ~20 s


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    """Outputs are cleared in the repository (the notebooks are run by this test, not stored run)."""
    nb = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{name} has no code cells"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
            f"{name}: code cell {i} has outputs; clear them before committing"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    if name == "dask.ipynb" and under_asan():
        # Its point is a 400 MiB limit per worker, and under ASan (tools/sanitize.sh) each
        # worker holds ~350 MiB before any task: the quarantine keeps freed memory resident,
        # so the nanny kills the workers (KilledWorker). attnx.dask's chunks make the calls
        # that the sanitized run tests directly (tools/tests_integrations.txt).
        pytest.skip("dask.ipynb under AddressSanitizer: its workers' 400 MiB limit (see conftest.under_asan)")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3",
        # run in a scratch directory: a notebook that writes files leaves nothing behind
        resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"{name}: a cell failed:\n{exc}", pytrace=False)

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name}: not every cell ran"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: {errors}"
    images = sum(1 for c in code for o in c.outputs if "image/png" in o.get("data", {}))
    assert images >= {"tour.ipynb": 4, "compare.ipynb": 1, "train.ipynb": 3, "dask.ipynb": 1}[name], f"{name}: only {images} figures shown"
    # No figure is shown twice, and no cell ends by printing a matplotlib object's repr:
    # plot_attention returns a pyplot figure, which a notebook shows at the end of the cell
    # anyway, so the notebooks assign the result (or end the line with ";").
    for i, c in enumerate(code):
        shown = [o for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(shown) <= 1, f"{name}: code cell {i} shows {len(shown)} images:\n{c.source}"
        reprs = [o for o in c.outputs if o.output_type == "execute_result"
                 and "matplotlib" in o.get("data", {}).get("text/plain", "")]
        assert not reprs, f"{name}: code cell {i} ends with a matplotlib object:\n{c.source}"


def test_readme_figure_script(tmp_path):
    """examples/make_readme_figure.py runs and draws what docs/attention.png shows."""
    pytest.importorskip("matplotlib")
    import subprocess
    import sys

    from matplotlib.image import imread

    out = tmp_path / "attention.png"
    r = subprocess.run([sys.executable, str(EXAMPLES / "make_readme_figure.py"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    committed = EXAMPLES.parent / "docs" / "attention.png"
    assert imread(out).shape == imread(committed).shape, "regenerate docs/attention.png"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("make_*_notebook.py")))
def test_generated_notebook_is_committed(script, tmp_path):
    """A notebook written by a generator script is the generator's output: the
    review reads the script, so the committed .ipynb must not drift from it."""
    pytest.importorskip("nbformat")
    import subprocess
    import sys

    name = script[len("make_"):-len("_notebook.py")] + ".ipynb"
    assert name in NOTEBOOKS, f"{name} (from {script}) is not run by test_notebook_runs"
    out = tmp_path / name
    r = subprocess.run([sys.executable, str(EXAMPLES / script), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == (EXAMPLES / name).read_bytes(), \
        f"examples/{name} differs from what {script} writes: run python examples/{script}"
