"""Masks that cost what they keep: the rows of kind ``block_mask``.

Each row times a masked call (bool mask, its :class:`attnx.BlockMask`, the
float mask) against the call that does only the work the mask keeps (packed
documents through ``varlen_attention``, ``is_causal=True``), or against a
mask of the same kept fraction with no empty block; with torch (full runs),
torch's compiled ``flex_attention`` with a BlockMask of the same documents.
All contestants of a row interleaved in one process (issue 45's targets:
documents >= 0.8x varlen and >= 1.5x flex, forward + backward >= 0.8x
varlen's vjp, causal >= 0.85x is_causal, prefix-LM >= 1.5x the random mask,
a mask with no empty block no slower than before)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from .context import Context, inputs
from .rows import Row


def documents(L: int, seed: int = 0) -> List[int]:
    """Document lengths uniform in [200, 700] until they fill L tokens (the last cut)."""
    rng, out, total = np.random.default_rng(seed), [], 0
    while total < L:
        n = min(int(rng.integers(200, 701)), L - total)
        out.append(n)
        total += n
    return out


def _flex(ctx: Context, lengths: Sequence[int], q: NDArray[Any], k: NDArray[Any],
          v: NDArray[Any]) -> Optional[Callable[[], object]]:
    """torch's compiled flex_attention with a BlockMask of the documents, compiled
    and run once here (outside the timing), or None without torch or when
    torch cannot compile it. Compiled for static shapes (``dynamic=False``):
    a second length otherwise makes torch 2.13 recompile with dynamic shapes,
    whose C++ its inductor fails to build on an AVX2 CPU."""
    torch = ctx.torch
    if torch is None or ctx.quick:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch.set_num_threads(ctx.threads)
    L = int(sum(lengths))
    doc = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
    bm = create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], 1, 1, L, L, device="cpu")
    fn = torch.compile(flex_attention, dynamic=False)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    try:
        fn(tq, tk, tv, block_mask=bm)
    except Exception:           # noqa: BLE001 (inductor's compile errors: no flex column)
        return None
    return lambda: fn(tq, tk, tv, block_mask=bm)


def block_mask(ctx: Context, name: str, L: int, H: int, D: int, what: str, *,
               grad: bool = False, prefix: int = 0) -> Row:
    """One row: ``what`` is "documents" (against varlen_attention, and flex),
    "causal" (against is_causal=True), "prefix" (a prefix-LM against a random
    mask keeping as much) or "dense" (10% dropped at random: the plain mask
    against its BlockMask, the classification's cost)."""
    attnx = ctx.attnx
    attnx.set_num_threads(ctx.threads)
    q, k, v = inputs(1, H, H, L, L, D)
    dout = inputs(1, H, H, L, L, D, seed=1)[0]
    rng = np.random.default_rng(1)

    def sdpa(**kw: Any) -> Callable[[], object]:
        if not grad:
            return lambda: attnx.scaled_dot_product_attention(q, k, v, **kw)

        def step() -> object:
            out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
            return vjp(dout)
        return step

    fns: Dict[str, Callable[[], object]] = {}
    if what == "documents":
        lengths = documents(L)
        bm = attnx.BlockMask.documents(lengths)
        fns = {"attnx": sdpa(attn_mask=bm.mask), "blockmask": sdpa(attn_mask=bm)}
        if not grad:
            fns["float"] = sdpa(attn_mask=np.where(bm.mask, 0.0, -np.inf).astype(np.float32))
        packed = [x[0].transpose(1, 0, 2).copy() for x in (q, k, v, dout)]
        cu = np.concatenate([[0], np.cumsum(lengths)])

        def varlen() -> object:
            if not grad:
                return attnx.varlen_attention(*packed[:3], cu, cu)
            out, vjp = attnx.varlen_attention_vjp(*packed[:3], cu, cu)
            return vjp(packed[3])
        fns["base"] = varlen
        flex = None if grad else _flex(ctx, lengths, q, k, v)
        if flex is not None:
            fns["flex"] = flex
        base = "varlen_attention on the same documents"
    elif what == "causal":
        fns = {"attnx": sdpa(attn_mask=np.tri(L, dtype=np.bool_)), "base": sdpa(is_causal=True)}
        base = "is_causal=True"
    elif what == "prefix":
        bm = attnx.BlockMask.prefix_lm(L, prefix)
        random = rng.random((L, L)) < bm.kept_fraction()
        fns = {"attnx": sdpa(attn_mask=bm.mask), "blockmask": sdpa(attn_mask=bm),
               "base": sdpa(attn_mask=random)}
        base = f"a random mask keeping as much ({bm.kept_fraction():.0%}), no empty block"
    else:
        dense = rng.random((L, L)) >= 0.1
        bm = attnx.BlockMask(dense)
        fns = {"attnx": sdpa(attn_mask=dense), "base": sdpa(attn_mask=bm),
               "nomask": sdpa()}
        base = "the same mask as a BlockMask (classified once)"
    names = list(fns)
    times = dict(zip(names, ctx.time([fns[n] for n in names],
                                     settle=[names.index("flex")] if "flex" in fns else [])))
    row: Row = {"case": name, "threads": ctx.threads, "attnx_s": times["attnx"],
                "base_s": times["base"], "vs_base": times["base"] / times["attnx"]}
    for n in ("blockmask", "float", "flex", "nomask"):
        if n in times:
            row[f"{n}_s"] = times[n]
    if "blockmask" in times and what != "prefix":
        row["blockmask_vs_base"] = times["base"] / times["blockmask"]
    if "float" in times:
        row["float_vs_base"] = times["base"] / times["float"]
    if "flex" in times:
        row["vs_flex"] = times["flex"] / times["attnx"]
    if what == "prefix":
        row["blockmask_vs_base"] = times["base"] / times["blockmask"]
    row["note"] = (f"'vs base': the bool mask's speed against {base}"
                   + (f"; without a mask {times['nomask'] / times['attnx']:.2f}x"
                      if "nomask" in times else ""))
    attnx.set_num_threads(0)
    return row
