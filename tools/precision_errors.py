"""The errors of each ``precision`` against float64, beside torch's SDPA in
float32 and in bfloat16 on the same inputs (the table of docs/guide/precision.md).

    python tools/precision_errors.py [--L 1024] [--D 64] [--heads 8]

Inputs: standard normal float32 q, k, v (B=1), a standard normal upstream
gradient; each error is the largest absolute difference from attnx.reference
(float64, on the float32 inputs), for the output and the three gradients.
Prints a Markdown table and the CPU's bfloat16 dot products (none: "medium"
computes as "highest").
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import attnx
from attnx import _attnx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
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
