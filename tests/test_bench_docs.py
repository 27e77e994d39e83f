"""The benchmark's figures in the docs are generated, never typed: every table
between ``<!-- bench: FILE TABLES -->`` and ``<!-- /bench -->`` in
docs/performance.md and README.md is what ``python -m attnx.bench.markdown``
writes from the committed ``--json`` output it names (docs/bench/*.json and
their ``.about.json`` sidecars), and every such file is shown on the page.
A failure means a table was edited by hand or a file changed without
regenerating: run ``python -m attnx.bench.markdown README.md docs/performance.md``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnx.bench import markdown

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "performance.md"]
BENCH = ROOT / "docs" / "bench"


def source_tree() -> None:
    if not BENCH.is_dir():
        pytest.skip("not run from a source tree")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_committed_tables_are_what_the_files_give(page):
    source_tree()
    text = page.read_text(encoding="utf-8")
    assert markdown.MARK.search(text), f"{page.name} has no generated bench table"
    assert markdown.render(text, page.parent) == text, (
        f"{page.name}'s bench tables differ from docs/bench/: run python -m "
        "attnx.bench.markdown README.md docs/performance.md")


def test_every_bench_file_is_shown_with_its_machine():
    source_tree()
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    shown = {(m[2], m[3]) for m in markdown.MARK.finditer(page)}
    files = sorted(p for p in BENCH.glob("*.json") if not p.name.endswith(".about.json"))
    assert files
    for f in files:
        blocks = {n for path, names in shown if path == f"bench/{f.name}" for n in names.split()}
        assert {"about", "speed"} <= blocks, f"docs/performance.md does not show {f.name}"
        about = json.loads(markdown.about_path(f).read_text(encoding="utf-8"))
        assert {"machine", "cpu", "isa", "date"} <= set(about), f.name
        for figure in ("sweep.png", "decode.png", "variants.png"):     # its --plot output
            assert (BENCH / f.stem / figure).is_file() and f"bench/{f.stem}/{figure}" in page


def test_regenerating_rewrites_only_the_blocks(tmp_path, capsys):
    rows = [{"case": "B=1 H=8 L=1024 D=64, 2 threads", "threads": 2, "attnx_s": 0.01,
             "attnx_gflops": 200.0, "peak_gflops": 250.0, "of_peak": 0.8, "torch_gflops": 100.0,
             "vs_torch": 2.0, "kind": "case"},
            {"case": "sweep L=16 D=64", "threads": 2, "attnx_gflops": 35.0, "of_peak": 0.14,
             "vs_torch": 1.5, "kind": "case"}]
    (tmp_path / "m.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    about = {"machine": "a test box", "cpu": "X", "isa": "avx2", "date": "2026-01-02"}
    (tmp_path / "m.about.json").write_text(json.dumps(about))
    page = tmp_path / "page.md"
    page.write_text("# T\n\nkept\n<!-- bench: m.json about speed sweep -->\nstale\n"
                    "<!-- /bench -->\nkept too\n")
    assert markdown.main(["--check", str(page)]) == 1
    assert "stale" in page.read_text()                       # --check changes nothing
    assert markdown.main([str(page)]) == 0
    text = page.read_text()
    assert "stale" not in text and text.startswith("# T\n\nkept\n") and text.endswith(
        "<!-- /bench -->\nkept too\n")
    assert "a test box" in text and "on 2026-01-02" in text and "250 GFLOP/s on 2 threads" in text
    assert "| B=1 H=8 L=1024 D=64, 2 threads | 200 | 80% | 100 | 2.00× |  |  |" in text
    assert "| L=16 | 35.0 (14%), 1.50× |" in text
    assert markdown.main(["--check", str(page)]) == 0        # regenerating is idempotent
    page.write_text("<!-- bench: m.json nonsense -->\n<!-- /bench -->\n")
    with pytest.raises(ValueError, match="unknown bench block 'nonsense'"):
        markdown.main([str(page)])
    capsys.readouterr()


def test_about_describes_this_machine(capsys):
    assert markdown.main(["--about", "this box"]) == 0
    about = json.loads(capsys.readouterr().out)
    assert about["machine"] == "this box" and about["isa"] and about["date"][:2] == "20"
    assert about["attnx"] and about["numpy"]
