"""ONNX Runtime as a contestant of ``python -m attnx bench`` (attnx/bench/onnx.py,
the ``[onnx]`` extra): its graph computes the same attention as attnx on the
inputs the benchmark gives both, and a forward row carries its columns. A
contestant that computed something else would make its ratios meaningless."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import attnx
from attnx.bench import markdown, onnx, runner
from attnx.bench.cases import Case
from attnx.bench.context import Context, inputs
from attnx.bench.report import Printer

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 64, 16), (2, 3, 37, 24)])
def test_onnxruntime_computes_attnx_attention(shape, causal):
    B, H, L, D = shape
    q, k, v = inputs(B, H, H, L, L, D, seed=3)
    call = onnx.attention(ort, q, k, v, causal=causal, threads=1)
    out = onnx.to_bhld(call(), H)
    ref = attnx.reference(q, k, v, is_causal=causal)
    assert out.shape == (B, H, L, D)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    # the inputs are the caller's, untouched (the graph's are copies in its layout)
    q2, k2, v2 = inputs(B, H, H, L, L, D, seed=3)
    assert all(np.array_equal(a, b) for a, b in ((q, q2), (k, k2), (v, v2)))


def test_forward_row_has_onnxruntime_columns(capsys):
    args = argparse.Namespace(quick=True, json=True, threads=1, repeats=1)
    plain = Case("case", dict(name="tiny", B=1, Hq=2, Hk=2, Lq=32, Lk=32, D=16))
    masked = Case("case", dict(name="tiny masked", B=1, Hq=2, Hk=2, Lq=32, Lk=32, D=16,
                               mask=np.tril(np.ones((32, 32), bool))))
    torch = pytest.importorskip("torch")
    torch_threads = torch.get_num_threads()      # the bench sets every contestant's count
    try:
        ctx = Context(args)
        rows = [r for c in (plain, masked) for r in runner.measure(ctx, Printer(True), c)]
    finally:
        attnx.set_num_threads(0)
        torch.set_num_threads(torch_threads)
    capsys.readouterr()
    row, masked_row = rows
    assert row["onnxruntime_s"] > 0 and row["onnxruntime_gflops"] > 0
    assert "onnxruntime_s" not in masked_row          # no mask input in its graph
    table = markdown.speed(rows, {})
    assert "ONNX Runtime" in table.splitlines()[0]


def test_markdown_without_onnxruntime_has_no_such_column():
    rows = [{"case": "B=1 H=8 L=1024 D=64, 2 threads", "threads": 2, "attnx_gflops": 200.0,
             "of_peak": 0.8, "torch_gflops": 100.0, "vs_torch": 2.0, "kind": "case"}]
    assert "ONNX Runtime" not in markdown.speed(rows, {})
