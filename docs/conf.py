"""Sphinx configuration of attnx's documentation site.

Build (CI runs exactly this; warnings are errors, no network):

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

The notebooks are shown from docs/notebooks/, run copies of examples/*.ipynb
written by tools/execute_notebooks.py: nothing is executed at build time.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# The attnx of this tree (its extension built in place, or the installed one).
sys.path.insert(0, ROOT)

import attnx  # noqa: E402

project = "attnx"
author = "attnx contributors"
copyright = "attnx contributors"
release = version = attnx.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",                      # Markdown pages (myst-parser) and notebooks
    "sphinx_design",                # the cards of the front page
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]

# -- notebooks: shown with their stored outputs, never executed here ----------------
nb_execution_mode = "off"
nb_merge_streams = True

# -- MyST -------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# -- API reference from the docstrings --------------------------------------------
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"           # the signatures carry long overloads; the docstrings say the types
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False
# parameter and attribute types as text: they are prose ("array_like, (B, H, L, E)"), not classes
napoleon_use_param = False
napoleon_use_keyword = False
napoleon_use_ivar = True
# attnx.dask.scaled_dot_product_attention has a section of its own
napoleon_custom_sections = ["How the work is split"]
# Names in docstrings that are prose, not objects of this site (nitpicky mode, -n).
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|torch|dask|da|transformers|ml_dtypes|matplotlib)\..*"),
    # MultiHeadAttention's Attributes section: "W_q : ndarray, float32, (d_model, H*d_head)"
    (r"py:class", r"ndarray|float32|d_model|kdim|vdim|b_[qkv]|H ?\* ?d_head"),
]

# -- no network: no intersphinx, nothing fetched -----------------------------------
intersphinx_mapping: dict[str, object] = {}

# -- HTML -------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"attnx {release}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "footer_start": ["copyright"],
    "footer_end": [],
    # the guide's and the API's pages need the width for code and tables
    "secondary_sidebar_items": {"index": [], "guide/*": [], "api/*": [], "notebooks/*": [],
                                "getting-started": ["page-toc"], "performance": ["page-toc"],
                                "examples": [], "development": [], "DESIGN": ["page-toc"],
                                "layout": [], "testing": ["page-toc"]},
}
html_css_files = ["custom.css"]
html_sidebars = {"index": [], "getting-started": [], "performance": []}
