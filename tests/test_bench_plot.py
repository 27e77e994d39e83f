"""``python -m attnx bench``'s output without timing anything (the ``attnx.bench``
subpackage): every kind of row printed under its own table (no ``nan`` and no
cell that does not apply), the declarative list of cases, the subpackage's
imports (no circle, no module importing one listed after it; no circle in
the whole package either), and ``--plot DIR --from-json FILE`` drawing the
figures from a small saved ``--json`` output (matplotlib, the ``plot`` extra;
its absence is one ``error:`` line naming the extra)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import attnx.bench

from attnx import _cli
from attnx.bench import cases, report, runner

# One row of each kind, with the keys the bench's methods give them (values made up).
ROWS = [
    {"case": "B=1 H=8 L=1024 D=64, 2 threads", "threads": 2, "attnx_s": 0.01,
     "attnx_gflops": 200.0, "torch_s": 0.012, "torch_gflops": 160.0, "vs_torch": 1.2,
     "numpy_s": 0.1, "numpy_gflops": 20.0, "vs_numpy": 10.0, "kind": "case"},
    {"case": "decode float32 H=32 Lk=8192 D=128", "threads": 2, "attnx_s": 0.0015,
     "attnx_gflops": 11.0, "attnx_GBps": 22.0, "roofline_GBps": 28.0, "of_roofline": 0.79,
     "torch_gflops": 8.0, "vs_torch": 1.4, "note": "reads K+V at 22.0 GB/s", "kind": "decode"},
    {"case": "decode float16 H=32 Lk=8192 D=128", "threads": 2, "attnx_s": 0.0008,
     "attnx_gflops": 26.0, "attnx_GBps": 26.0, "roofline_GBps": 21.0, "of_roofline": 1.24,
     "vs_float32_cache": 2.4, "note": "reads K+V at 26.0 GB/s", "kind": "decode"},
    {"case": "decode float32 GQA 32/8 Lk=32768 D=128", "threads": 2, "attnx_s": 0.006,
     "attnx_gflops": 34.0, "attnx_GBps": 17.0, "roofline_GBps": 23.0, "of_roofline": 0.74,
     "note": "reads K+V at 17.0 GB/s", "kind": "decode"},
    {"case": "long L=16384 H=8 D=64", "threads": 2, "attnx_s": 2.0, "attnx_gflops": 190.0,
     "peak_rss_growth_MiB": 0.0, "note": "RSS grew 0 MiB", "kind": "memory"},
    {"case": "backward, float mask (1, 1, 1, 1024) vs bool, L=1024 H=8 D=64", "threads": 2,
     "attnx_s": 0.03, "attnx_gflops": 207.0, "float_vs_bool_time": 1.05,
     "rss_growth_float_MiB": 6.0, "rss_growth_bool_MiB": 6.0, "note": "1.05x",
     "kind": "mask_backward"},
    {"case": "Llama-style decoder float32 prefill, L=256", "threads": 2, "attnx_s": 0.144,
     "sdpa_s": 0.16, "eager_s": 0.163, "vs_torch": 1.12, "note": "attnx 144.0 ms",
     "kind": "transformers_decoder"},
    {"case": "dask 2 workers, causal L=8192 H=8 D=64", "threads": 2, "attnx_s": 0.64,
     "attnx_gflops": 107.0, "one_process_s": 0.22, "one_process_gflops": 312.0,
     "note": "0.64 s vs one process 0.22 s", "kind": "dask_cluster"},
    {"case": "sinks L=1024 H=8 D=64", "threads": 2, "attnx_s": 0.0105, "base_s": 0.0093,
     "vs_base": 0.89, "note": "1.13x the time without it", "kind": "variant"},
    {"case": "window (256, 0) vs causal, L=4096 H=8 D=64", "threads": 2, "attnx_s": 0.0157,
     "base_s": 0.0767, "vs_base": 4.9, "note": "0.20x the time without it", "kind": "variant"},
    {"case": "sweep L=16 D=64", "threads": 2, "attnx_s": 1e-5, "attnx_gflops": 35.0,
     "torch_gflops": 20.0, "vs_torch": 1.7, "kind": "case"},
    {"case": "sweep L=128 D=64", "threads": 2, "attnx_s": 1e-4, "attnx_gflops": 95.0,
     "torch_gflops": 70.0, "vs_torch": 1.35, "kind": "case"},
    {"case": "sweep L=1024 D=64", "threads": 2, "attnx_s": 1e-2, "attnx_gflops": 148.0,
     "torch_gflops": 94.0, "vs_torch": 1.58, "kind": "case"},
    {"case": "sweep L=256 D=64 GQA Hq=8 Hk=2", "threads": 2, "attnx_s": 1e-3,
     "attnx_gflops": 150.0, "kind": "case"},
]


def no_bench(args):
    raise AssertionError("the bench ran (the tests time nothing)")


@pytest.fixture
def bench_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def printed(rows, capsys):
    b = report.Printer(json_lines=False)      # the printer alone: nothing imported or timed
    for row in rows:
        b.emit(dict(row))
    return capsys.readouterr().out


def test_every_kind_of_row_has_a_table():
    assert set(report.KIND_TABLE.values()) == set(report.TABLES)
    assert set(runner.KINDS) == set(report.KIND_TABLE)
    for kind, measure in runner.KINDS.items():
        assert measure.__name__ == kind                 # a row's kind names its measurement
    kinds = {kind for kind, _ in cases.cases(False, 2, True)}
    assert kinds <= set(runner.KINDS)


def test_ratio_rows_print_no_nan(capsys):
    out = printed(ROWS, capsys)
    assert "nan" not in out.lower()
    lines = out.splitlines()
    for row in ROWS:
        (line,) = [x for x in lines if x.startswith(row["case"] + " ")]
        table = report.TABLES[report.KIND_TABLE[row["kind"]]]
        # every column of the row's table applies to it, but for peers not measured
        assert len(row["case"]) < table.case_width, line     # the columns stay aligned
        cells = line[table.case_width:].split()[:len(table.columns)]
        assert len(cells) == len(table.columns), line
        if row["kind"] in ("variant", "transformers_decoder", "mask_backward", "dask_cluster"):
            assert "-" not in cells, line
    # a new table (title and columns) when the kind changes, not before each row
    assert sum(x.startswith("case ") for x in lines) == 8
    assert any(x.startswith("Variants:") for x in lines)


def test_table_values(capsys):
    lines = printed(ROWS[8:9] + ROWS[6:7] + ROWS[1:2], capsys).splitlines()
    var = next(x for x in lines if x.startswith("sinks"))
    assert var.split()[-3:] == ["10.5", "9.3", "1.13x"]        # ms, without ms, time ratio
    model = next(x for x in lines if x.startswith("Llama"))
    assert model.split()[-4:] == ["144.0", "160.0", "163.0", "1.12x"]
    dec = next(x for x in lines if x.startswith("decode"))
    # no bfloat16 ratio, and no unrotated int8 ratio (a float32 cache's row)
    assert dec.split()[-7:] == ["22.0", "28.0", "79%", "1.40x", "-", "-", "-"]
    int8 = dict(ROWS[1], case="decode int8 KVCache H=32 Lk=8192 D=128", vs_unrotated_int8=1.02)
    dec8 = next(x for x in printed([int8], capsys).splitlines() if x.startswith("decode"))
    assert dec8.split()[-1] == "1.02x"


def test_json_rows_keep_their_keys(capsys):
    b = report.Printer(json_lines=True)
    b.emit(dict(ROWS[0]))
    assert json.loads(capsys.readouterr().out) == ROWS[0]


def test_cases_are_declarative():
    quick = cases.cases(True, 2, False)
    full = cases.cases(False, 2, True)
    assert len(quick) < len(full)
    names = [p["name"] for kind, p in full if kind == "case"]
    assert "sweep L=4096 D=128" in names and "B=1 H=8 L=1024 D=64, 1 thread" in names
    assert "B=1 H=8 L=1024 D=64, 1 thread" not in [p.get("name") for _, p in cases.cases(
        False, 1, True)]
    assert not any(k == "transformers_decoder" for k, _ in quick)       # needs torch
    assert not any(k in ("memory", "backward_memory") for k, _ in quick)


BENCH = Path(attnx.bench.__file__).parent


def sibling_imports(path: Path) -> set:
    """The modules of attnx/bench/ that ``path`` imports (``from . import x``, ``from .x import``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {a.name for a in node.names}
    return names


def test_bench_modules_import_no_circle():
    graph = {p.stem: sibling_imports(p) for p in BENCH.glob("*.py")}
    assert graph["__init__"] == set() and {"rows", "cases", "runner", "plot"} <= set(graph)
    assert graph["rows"] == set() and graph["cases"] == set()     # the data imports nothing
    assert "runner" not in graph["plot"] and "plot" not in graph["runner"]
    done: set = set()
    while len(done) < len(graph):                 # peel off the modules whose imports are done
        ready = {m for m, deps in graph.items() if m not in done and deps <= done}
        assert ready, f"an import circle among {sorted(set(graph) - done)}"
        done |= ready


PACKAGE = BENCH.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST):
    """The import statements of a module, at its top, inside its functions (a
    lazy import hides a circle from Python, not from a reader) and under ``if
    TYPE_CHECKING:`` (a circle of annotations is one for a reader too)."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def package_imports() -> dict:
    """Each module of attnx/ (subpackages included, a package as its
    __init__.py) and the modules of attnx/ it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            folder = Path(PACKAGE.parent, *base.split("."))
            for alias in node.names:     # a module of base (the extension too), or a name of it
                sub = f"{base}.{alias.name}"
                deps.add(sub if any(folder.glob(alias.name + ".*")) else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def test_package_modules_import_no_circle():
    """Issue 56, 6: no module of attnx/ imports, through others or itself, one
    that imports it (integrations/_divergence.py imported transformers.py,
    which imports it; _torch_interop.py imported _mha_weights.py's
    LayerWeights under ``if TYPE_CHECKING:``, for annotations, and
    _mha_weights.py imports it)."""
    graph = package_imports()
    assert {"attnx", "attnx._args", "attnx.integrations.transformers",
            "attnx.bench.plot"} <= set(graph)
    assert "attnx.integrations._cache" in graph["attnx.integrations.transformers"]
    assert "attnx._args" in graph["attnx._int8"]
    done: set = set()
    while len(done) < len(graph):                 # peel off the modules whose imports are done
        ready = {m for m, deps in graph.items() if m not in done and deps <= done}
        if not ready:                             # name the circle: drop what only imports it
            left = set(graph) - done
            while tops := {m for m in left if not any(m in graph[o] for o in left)}:
                left -= tops
            pytest.fail(f"an import circle: {({m: sorted(graph[m] & left) for m in sorted(left)})}")
        done |= ready


def test_package_modules_are_small():
    """No module of attnx/ (the bench's and the integrations' included) over 500
    lines, no class in it over 250 (issue 33: rooms a contributor can read)."""
    for path in BENCH.parent.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert text.count("\n") <= 500, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 250, f"{path.name}: {node.name}"


# ------------------------------------------------------------------ --plot

def test_plot_from_json_writes_the_figures(bench_json, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs"
    assert _cli.main(["bench", "--plot", str(out), "--from-json", str(bench_json)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["decode.png", "sweep.png", "variants.png"]
    for p in out.iterdir():
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p
    err = capsys.readouterr().err
    assert err.count("wrote ") == 3


def test_sweep_figure_contents():
    pytest.importorskip("matplotlib")
    from attnx.bench import plot as _bench_plot

    ax = _bench_plot.sweep_figure(ROWS).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"attnx, D=64", "torch SDPA, D=64"}   # the GQA sweep row is not on it
    assert list(lines["attnx, D=64"].get_xdata()) == [16, 128, 1024]
    assert list(lines["torch SDPA, D=64"].get_ydata()) == [20.0, 70.0, 94.0]
    dec = _bench_plot.decode_figure(ROWS).axes[0]
    assert len(dec.patches) == 2 * 3                           # attnx and roofline, 3 rows
    var = _bench_plot.variants_figure(ROWS).axes[0]
    # bars from 1 (as fast as without the variant) to the row's speed
    assert sorted((p.get_x(), round(p.get_x() + p.get_width(), 2)) for p in var.patches) == [
        (1, 0.89), (1, 4.9)]


def test_peak_line_only_when_measured():
    pytest.importorskip("matplotlib")
    from attnx.bench import plot as _bench_plot

    def labels(rows):
        return [ln.get_label() for ln in _bench_plot.sweep_figure(rows).axes[0].get_lines()]
    assert not any("peak" in x for x in labels(ROWS))          # never an assumed peak
    header = {"peak_gflops": 232.0}                            # a header object carries it
    (peak,) = [x for x in labels([header] + ROWS) if "peak" in x]
    assert "232 GFLOP/s" in peak


def test_plot_without_rows_to_draw(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.json"
    path.write_text(json.dumps(ROWS[4]) + "\n")
    assert _cli.main(["bench", "--plot", str(tmp_path / "f"), "--from-json", str(path)]) == 2
    assert "no sweep, decode or variant rows" in capsys.readouterr().err


def test_from_json_not_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.json"
    path.write_text(json.dumps(ROWS[0]) + "\nattnx 0.1.0, ISA avx512\n")
    assert _cli.main(["bench", "--plot", str(tmp_path), "--from-json", str(path)]) == 2
    assert f"{path}:2: not a JSON object" in capsys.readouterr().err


def test_from_json_needs_plot(bench_json, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_rows", no_bench)
    with pytest.raises(SystemExit) as e:
        _cli.main(["bench", "--from-json", str(bench_json)])
    assert e.value.code == 2
    assert "--from-json: only with --plot" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(monkeypatch, bench_json, tmp_path, capsys):
    # None in sys.modules makes `import matplotlib` raise ImportError, as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(runner, "run_rows", no_bench)
    for extra in ([], ["--from-json", str(bench_json)]):
        assert _cli.main(["bench", "--plot", str(tmp_path / "f"), *extra]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and 'pip install "attnx[plot]"' in line
    assert not (tmp_path / "f").exists()
