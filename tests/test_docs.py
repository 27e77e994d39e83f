"""The documentation site (docs/) against the package.

* Every public name (``attnx.__all__``, ``attnx.torch``, ``attnx.dask``,
  ``attnx.integrations.transformers``) has an entry in the API reference
  sources (an ``autofunction``/``autoclass``/``data`` directive under docs/api/)
  and a docstring; one that takes or returns arrays states their shapes.
* Every ```python block of the user's pages (docs/**/*.md, README.md) runs:
  each page's blocks in order, in one namespace, as a reader would paste them.
  A page needing torch, transformers, dask or matplotlib is skipped only when
  that library cannot be imported (CI installs them all).
* docs/notebooks/*.ipynb, the run copies the site shows, hold the cells of
  examples/*.ipynb, with outputs.

The site itself is built in CI with ``sphinx -W --keep-going -n`` (.ci/run).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

import attnx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

PUBLIC_MODULES = {
    "attnx": None,
    "attnx.torch": "torch",
    "attnx.dask": "dask",
    "attnx.integrations.transformers": "transformers",
}


def _docs_tree() -> None:
    if not (DOCS / "conf.py").is_file():
        pytest.skip("not run from a source tree")


# ---------------------------------------------------------------------------------
# The API reference
# ---------------------------------------------------------------------------------

# A shape written out: a parenthesised tuple of dimension names, "(B..., H, Lq, E)",
# "(H,)", "(B+1,)", "(total_q, Hq, Ev)", "(batch, heads, max_len, head_dim)".
_DIM = r"(?:[A-Z]\w*|total\w*|batch|heads|max_len|head_dim|value_dim)(?:\.\.\.|…)?(?:\s*[+−-]\s*\d+)?"
SHAPE = re.compile(rf"\(\s*{_DIM}\s*,(?:\s*{_DIM}\s*,)*\s*(?:{_DIM})?\s*\)|shaped like")
_ARRAY_TYPES = ("Array", "NDArray", "ndarray", "Tensor", "F32")
_ARRAY_PARAMS = {"query", "key", "value", "x", "weights", "packed", "lengths"}


def public_names(module: str) -> list[str]:
    dep = PUBLIC_MODULES[module]
    if dep is not None and importlib.util.find_spec(dep) is None:
        pytest.skip(f"{module} needs {dep}")
    return list(importlib.import_module(module).__all__)


_ENTRY = re.compile(r"^\.\. (?:py:)?(?:auto)?(?:function|class|data)::\s+([\w.]+)\s*$", re.M)


def api_entries() -> set[str]:
    """The full names documented by docs/api/*: autodoc directives name them in
    full; a ``data::`` directive names them under its page's ``.. module::``."""
    _docs_tree()
    names = set()
    for page in sorted((DOCS / "api").glob("*.*")):
        text = page.read_text(encoding="utf-8")
        module = re.search(r"^\.\. (?:py:)?module::\s+([\w.]+)", text, re.M)
        for name in _ENTRY.findall(text):
            if module and not name.startswith(module.group(1) + "."):
                name = f"{module.group(1)}.{name}"
            names.add(name)
    return names


def handles_arrays(obj: Any) -> bool:
    """True when obj (a function, or a class's constructor or public methods)
    takes or returns arrays, by its annotations or its parameters' names."""
    targets = [obj]
    if inspect.isclass(obj):
        targets = [obj] + [v for n, v in vars(obj).items()
                           if callable(v) and (not n.startswith("_") or n == "__call__")]
    for f in targets:
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            continue
        annotations = [str(p.annotation) for p in sig.parameters.values()] + [str(sig.return_annotation)]
        if any(t in a for a in annotations for t in _ARRAY_TYPES):
            return True
        if _ARRAY_PARAMS & set(sig.parameters):
            return True
    return False


def test_shape_rule_tells_shapes_from_prose() -> None:
    assert SHAPE.search("query (B..., Hq, Lq, E), key (B..., Hk, Lk, E)")
    assert SHAPE.search("sinks (H,) or (B, H)") and SHAPE.search("cu_seqlens (B+1,)")
    assert SHAPE.search("k (batch, heads, max_len, head_dim)")
    assert not SHAPE.search("Attention over (queries, keys and values), computed fast (really).")


@pytest.mark.parametrize("module", list(PUBLIC_MODULES))
def test_every_public_name_has_an_api_entry(module: str) -> None:
    entries = api_entries()
    missing = [name for name in public_names(module) if f"{module}.{name}" not in entries]
    assert not missing, f"docs/api/ has no entry for {module}.{missing}"


@pytest.mark.parametrize("module", list(PUBLIC_MODULES))
def test_every_public_name_has_a_docstring_with_shapes(module: str) -> None:
    try:
        mod = importlib.import_module(module) if module != "attnx" else attnx
    except ModuleNotFoundError as e:    # its optional dependency (torch, dask) not installed
        if e.name is None or e.name.split(".")[0] == "attnx":
            raise
        pytest.skip(f"{module} needs {e.name}, not installed")
    problems = []
    for name in public_names(module):
        obj = getattr(mod, name)
        if not callable(obj):          # data (__version__, NAME): described in the API page
            continue
        doc = obj.__doc__ or ""        # its own, not inherited
        if len(doc.strip()) < 40:
            problems.append(f"{name}: no docstring")
        elif handles_arrays(obj) and not SHAPE.search(doc):
            problems.append(f"{name}: takes or returns arrays, but its docstring states no shape "
                            "(such as (B, H, L, E), or 'shaped like ...')")
    assert not problems, f"{module}: " + "; ".join(problems)


# ---------------------------------------------------------------------------------
# The pages' code blocks
# ---------------------------------------------------------------------------------

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
# what a page's code imports or calls -> the library it needs
OPTIONAL = {
    r"\bimport torch\b|\battnx\.torch\b": "torch",
    r"\btransformers\b": "transformers",
    r"\bdask\b": "dask",
    r"\bdistributed\b": "distributed",
    r"plot_attention|matplotlib": "matplotlib",
    r"bfloat16": "ml_dtypes",
}


def pages() -> list[Path]:
    if not (DOCS / "conf.py").is_file():
        return []
    found = [p for p in sorted(DOCS.rglob("*.md")) if "_build" not in p.parts]
    return [p for p in [ROOT / "README.md"] + found if FENCE.search(p.read_text(encoding="utf-8"))]


def page_ids() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages()]


def test_the_guide_pages_hold_code() -> None:
    _docs_tree()
    with_code = [p.name for p in pages()]
    for name in ("README.md", "getting-started.md", "masks.md", "shapes.md", "gradients.md",
                 "variants.md", "varlen.md", "kvcache.md", "llm.md", "dask.md", "threads.md"):
        assert name in with_code, f"{name}: no ```python block found (is the fence spelled ```python?)"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", pages(), ids=page_ids())
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = FENCE.findall(page.read_text(encoding="utf-8"))
    code = "\n".join(blocks)
    for pattern, dep in OPTIONAL.items():
        if re.search(pattern, code) and importlib.util.find_spec(dep) is None:
            pytest.skip(f"needs {dep}")
    if re.search(OPTIONAL[r"plot_attention|matplotlib"], code):
        import matplotlib
        matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    try:
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"{page.name}, block {i + 1}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{page.relative_to(ROOT)}, ```python block {i + 1} raised "
                            f"{type(exc).__name__}: {exc}\n{block}", pytrace=False)
    finally:
        attnx.set_num_threads(0)
        if "matplotlib.pyplot" in importlib.sys.modules:
            importlib.import_module("matplotlib.pyplot").close("all")


# ---------------------------------------------------------------------------------
# The notebooks the site shows
# ---------------------------------------------------------------------------------

NOTEBOOKS = ["tour.ipynb", "compare.ipynb", "train.ipynb", "dask.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_site_notebook_is_a_run_of_the_example(name: str) -> None:
    _docs_tree()
    shown = json.loads((DOCS / "notebooks" / name).read_text(encoding="utf-8"))
    source = json.loads((ROOT / "examples" / name).read_text(encoding="utf-8"))
    def cells(nb: dict[str, Any]) -> list[tuple[str, str]]:
        return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    assert cells(shown) == cells(source), \
        f"docs/notebooks/{name} is not a run of examples/{name}: run python tools/execute_notebooks.py {name}"
    code = [c for c in shown["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), f"docs/notebooks/{name}: not every cell ran"
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]), \
        f"docs/notebooks/{name} shows no figure"
