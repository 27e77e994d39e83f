"""The docs stay true to the tree: docs/layout.md ("Layout of the code", moved
there from README.md) names every C source file and describes the thread pool
as what it is; the design notes name only paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"


def layout_block() -> str:
    if not LAYOUT.is_file() or not (ROOT / "csrc").is_dir():
        pytest.skip("not run from a source tree")
    text = LAYOUT.read_text()
    start = text.index("# Layout of the code")
    return text[start:text.index("```", text.index("```", start) + 3)]


def test_layout_names_every_c_source():
    block = layout_block()
    missing = [p.name for p in sorted((ROOT / "csrc").rglob("*.c")) if p.name not in block]
    assert not missing, f"docs/layout.md does not mention {missing}"


def test_layout_describes_the_persistent_thread_pool():
    block = layout_block()
    assert "persistent" in block and "per-call" not in block


def test_design_notes_name_only_paths_that_exist():
    """docs/DESIGN.md follows the tree: every path it names in backquotes
    under attnx/, csrc/, tests/, tools/, docs/ or examples/ exists."""
    design = ROOT / "docs" / "DESIGN.md"
    if not design.is_file() or not (ROOT / "csrc").is_dir():
        pytest.skip("not run from a source tree")
    names = set(re.findall(r"`((?:attnx|csrc|tests|tools|docs|examples)/[\w./-]*)`",
                           design.read_text()))
    assert len(names) > 20, names
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"docs/DESIGN.md names paths that do not exist: {missing}"
