"""The errors of each ``precision`` against float64, beside torch's SDPA in
float32 and in bfloat16 on the same inputs (the table of docs/guide/precision.md).

    python tools/precision_errors.py [--L 1024] [--D 64] [--heads 8] [--causal] [--seed 0]

Inputs: standard normal float32 q, k, v (B=1), a standard normal upstream
gradient; each error is the largest absolute difference from attnx.reference
(float64, on the float32 inputs), for the output and the three gradients.
Prints a Markdown table and the CPU's bfloat16 dot products (none: "medium"
computes as "highest"), and a row for "medium" as the kernels with bfloat16
dot products are designed to round (issue 44), emulated in float64, so that
the design's error can be set against torch's on any CPU.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import attnx
from attnx import _attnx


def bf16(x):
    """x rounded to bfloat16 (nearest, ties to even), as float64."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def medium_emulated(q, k, v, dout, causal):
    """What "medium" kernels with bfloat16 dot products are to compute (issue 44's
    design), modelled in float64 with their roundings: q, k, v and the upstream
    gradient rounded to bfloat16 once, the unnormalised probabilities P~ =
    exp(s - max) rounded for P·V (their sum kept unrounded), and in the backward
    P and dS rounded for dV = Pᵀ·dO and dK = dSᵀ·Q (dQ = dS·K takes dS and the
    keys as they are: float32 products) and D = rowsum(dO * O) from the rounded
    dO, as dP = dO·Vᵀ takes it; the softmax, its sums and lse unrounded.
    Returns out, dq, dk, dv (float64), to measure the design on any CPU (the
    kernels give these within float32 rounding of their sums)."""
    E = q.shape[-1]
    scale = 1 / np.sqrt(E)
    q16, k16, v16, do16 = bf16(q), bf16(k), bf16(v), bf16(dout)
    s = np.einsum("bhie,bhje->bhij", q16, k16) * scale
    if causal:
        L = s.shape[-1]
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    pt = np.exp(s - m)
    l = pt.sum(-1, keepdims=True)
    out = np.einsum("bhij,bhjd->bhid", bf16(pt), v16) / l
    p = pt / l                                      # the backward's P, from lse
    dp = np.einsum("bhid,bhjd->bhij", do16, v16)
    delta = (do16 * out).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    dv = np.einsum("bhij,bhid->bhjd", bf16(p), do16)
    dq = np.einsum("bhij,bhje->bhie", ds, np.asarray(k, np.float64)) * scale
    dk = np.einsum("bhij,bhie->bhje", bf16(ds), q16) * scale
    return out, dq, dk, dv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="the inputs' draw")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    shape = (1, a.heads, a.L, a.D)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    kw = dict(is_causal=a.causal)
    ref = attnx.reference(q, k, v, **kw)
    grads = attnx.reference_backward(dout, q, k, v, **kw)[:3]

    def errors(out, gs):
        return [float(np.abs(np.asarray(out, np.float64) - ref).max())] + [
            float(np.abs(np.asarray(g, np.float64) - r).max()) for g, r in zip(gs, grads)]

    rows = {}
    for p in ("highest", "medium"):
        out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, precision=p, **kw)
        g = vjp(dout)
        rows[f'attnx, precision="{p}"'] = errors(out, (g.query, g.key, g.value))
    out, *gs = medium_emulated(q, k, v, dout, a.causal)
    rows['"medium" as designed for bfloat16 dot products, emulated'] = errors(out, gs)
    for name, dtype in (("torch SDPA, float32", torch.float32), ("torch SDPA, bfloat16", torch.bfloat16)):
        ts = [torch.from_numpy(x).to(dtype).requires_grad_() for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*ts, **kw)
        out.backward(torch.from_numpy(dout).to(dtype))
        rows[name] = errors(out.detach().float().numpy(),
                            [t.grad.float().numpy() for t in ts])
    print(f"B=1 H={a.heads} L={a.L} D={a.D} causal={a.causal}; bfloat16 dot products: "
          f"{_attnx.bf16_dots()}; ISA {_attnx.isa()}")
    print()
    print("| | out | dq | dk | dv |")
    print("|---|---|---|---|---|")
    for name, e in rows.items():
        print(f"| {name} | " + " | ".join(f"{x:.2e}" for x in e) + " |")


if __name__ == "__main__":
    main()
