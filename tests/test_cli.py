"""The command line, each command in a subprocess: ``python -m attnx [info|demo|bench]``.

Mistakes print one ``error:`` line and exit 2, never a traceback; ignored
environment settings are reported as a ``warning:`` line. The benchmark's
machinery is run in-process on one tiny row (``attnx.bench.runner.smoke``): the real
runs take minutes and belong to ``python -m attnx bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import attnx
from attnx.bench import runner
from attnx._cli import SENTENCE, demo_inputs


def run(*args, env=None, timeout=120):
    e = dict(os.environ)
    e.update(env or {})
    e = {k: v for k, v in e.items() if v is not None}
    res = subprocess.run([sys.executable, "-m", "attnx", *args], capture_output=True, text=True,
                         env=e, timeout=timeout)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def one_error_line(res, *fragments):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "error:" in lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def test_default_runs_info_then_demo():
    res = run()
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith(f"attnx {attnx.__version__} (numpy ")
    assert re.search(r"^instruction set: \w+ \(available here: ", out, re.M)
    assert re.search(r"^threads: \d+ ", out, re.M)
    assert f'self-attention over "{SENTENCE}"' in out
    assert out.rstrip().endswith("-> OK")


def test_info_reports_the_build():
    res = run("info", env={"ATTNX_ISA": "scalar", "ATTNX_NUM_THREADS": "3"})
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"attnx {attnx.__version__} ")
    assert lines[1].startswith("extension: ") and "_attnx" in lines[1]
    available = ", ".join(attnx._attnx.available_isas())
    assert f"instruction set: scalar (available here: {available};" in res.stdout
    assert "threads: 3 (from ATTNX_NUM_THREADS" in res.stdout
    assert re.search(r"^optional: torch .*; matplotlib ", res.stdout, re.M)
    assert "self-attention" not in res.stdout          # info alone, no demo


@pytest.mark.parametrize("value, why", [
    ("avx1024", "is not an instruction set"),
    ("AVX2", "is not an instruction set"),               # names are lower-case in the C core
    ("neon" if attnx._attnx.available_isas()[-1] != "neon" else "avx2", "is not available on this CPU"),
])
def test_ignored_isa_request_is_a_warning(value, why):
    res = run("info", env={"ATTNX_ISA": value})
    assert res.returncode == 0
    (line,) = res.stderr.strip().splitlines()
    best = attnx._attnx.available_isas()[-1]
    assert line.startswith(f"warning: ATTNX_ISA={value!r} {why}")
    assert f"; using {best} (available here: " in line      # the C core's fallback: the best ISA
    assert f"instruction set: {best} " in res.stdout


@pytest.mark.parametrize("value", ["-3", "two", "100000"])
def test_ignored_thread_count_is_a_warning(value):
    res = run("info", env={"ATTNX_NUM_THREADS": value, "OMP_NUM_THREADS": None})
    assert res.returncode == 0
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"warning: ATTNX_NUM_THREADS={value!r} is ignored")
    assert "one per CPU" in res.stdout


def test_demo_prints_the_weights_table_and_checks_them():
    res = run("demo")
    assert res.returncode == 0, res.stderr
    tokens, x = demo_inputs()
    _, w = attnx.scaled_dot_product_attention(x, x, x, need_weights=True)
    rows = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == len(tokens) + 1 and parts[0] in tokens:
            rows[parts[0]] = [float(p) for p in parts[1:]]
    assert list(rows) == list(dict.fromkeys(tokens))    # one row per token ("the" twice: once)
    for i, t in enumerate(tokens):
        if tokens.index(t) == i:
            np.testing.assert_allclose(rows[t], w[i], atol=0.006)
    header = [line for line in res.stdout.splitlines() if line.split()[:2] == ["The", "anima"]]
    assert len(header) == 1
    assert re.search(r"max \|attnx - float64 reference\| = \S+ -> OK", res.stdout)


@pytest.mark.parametrize("args", [["--help"], ["info", "--help"], ["demo", "--help"],
                                  ["bench", "--help"]])
def test_help(args):
    res = run(*args)
    assert res.returncode == 0 and res.stderr == ""
    prog = " ".join(["python -m attnx"] + args[:-1])
    assert res.stdout.startswith(f"usage: {prog} ")
    if args[0] == "bench":
        for opt in ("--quick", "--json", "--threads", "--repeats", "--plot", "--from-json"):
            assert opt in res.stdout
    if args == ["--help"]:
        assert all(c in res.stdout for c in ("info", "demo", "bench", "ATTNX_ISA"))


def test_version():
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"attnx {attnx.__version__}"


@pytest.mark.parametrize("args, fragments", [
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["demo", "extra"], ["unrecognized arguments: extra"]),
    (["bench", "--threads", "-3"], ["--threads", "got -3"]),
    (["bench", "--threads", "100000"], ["--threads", "got 100000"]),
    (["bench", "--threads", "abc"], ["--threads", "invalid int value: 'abc'"]),
    (["bench", "--repeats", "-1"], ["--repeats", "got -1"]),
    (["bench", "--quik"], ["unrecognized arguments: --quik"]),
])
def test_user_mistakes_are_one_line(args, fragments):
    line = one_error_line(run(*args), *fragments)
    assert line.startswith("python -m attnx")


def smoke(capsys, **kw):
    args = argparse.Namespace(**{"quick": True, "json": False, "threads": 0, "repeats": 1, **kw})
    try:
        runner.smoke(args)
    finally:
        attnx.set_num_threads(0)
    return capsys.readouterr().out


def test_bench_smoke_row_json(capsys):
    out = smoke(capsys, json=True, threads=1)
    (line,) = out.strip().splitlines()
    row = json.loads(line)
    assert row["case"].startswith("smoke") and row["threads"] == 1
    assert row["attnx_s"] > 0 and row["attnx_gflops"] > 0
    assert row["numpy_s"] > 0 and row["vs_numpy"] > 0
    # the ceilings every row carries: the units this CPU has, None for the others
    dots = attnx._attnx.bf16_dots()
    assert (row["bf16dot_peak_gflops"] is None) == (dots is None)
    assert (row["amx_peak_gflops"] is None) == (dots is None or not dots.startswith("amx"))
    assert row["ceiling"] == "fma" and row["of_ceiling"] == row["of_peak"]   # float32, "highest"


def test_bench_medium_row_beside_its_call(capsys):
    """A case with medium=True times precision="medium" with the others and
    gives it a row of its own, against the same call under "highest"."""
    from attnx.bench.cases import Case
    from attnx.bench.context import Context
    from attnx.bench.report import Printer
    args = argparse.Namespace(quick=True, json=True, threads=1, repeats=1)
    case = Case("case", dict(name="tiny", B=1, Hq=2, Hk=2, Lq=32, Lk=32, D=16, medium=True))
    try:
        rows = runner.measure(Context(args), Printer(True), case)
    finally:
        attnx.set_num_threads(0)
    assert [r["case"] for r in rows] == ["tiny", "tiny, precision='medium'"]
    highest, medium = rows
    assert medium["precision"] == "medium" and medium["highest_s"] == highest["attnx_s"]
    assert medium["vs_highest"] == highest["attnx_s"] / medium["attnx_s"]
    dots = attnx._attnx.bf16_dots()
    assert medium["ceiling"] == ("fma" if dots is None else "bf16dot" if dots == "avx512_bf16"
                                 else "amx")
    assert [json.loads(line)["case"] for line in capsys.readouterr().out.splitlines()] == \
        ["tiny", "tiny, precision='medium'"]


def test_bench_smoke_table(capsys):
    lines = smoke(capsys).splitlines()
    assert lines[0].startswith(f"attnx {attnx.__version__}, ISA ")
    peak = lines[2].split()
    assert peak[:4] == ["FP32", "FMA", "peak", "measured"] and float(peak[peak.index("GFLOP/s") - 1]) > 0
    # the other units' peaks: measured where the kernels have them
    dots = attnx._attnx.bf16_dots()
    assert lines[3].startswith("bfloat16 dot products' peak (vdpbf16ps chains): " + (
        "none on this CPU;" if dots is None else ""))
    assert ("AMX tiles' peak (TDPBF16PS): none on this CPU" in lines[3]) == (
        dots is None or not dots.startswith("amx"))
    assert lines[4].split()[:6] == ["case", "attnx", "of", "peak", "torch", "numpy"]
    assert lines[5].startswith("smoke ") and len(lines) == 6
    assert lines[5].split()[6].endswith("%")     # after "smoke B=1 H=2 L=32 D=16" and attnx: its share of the peak
