"""The benchmark's cases, as data: each :class:`Case` names the measurement
that runs it (a key of :data:`.runner.KINDS`: a function of :mod:`.speed`,
:mod:`.memory` or :mod:`.models`) and its keyword arguments; :func:`cases`
lists them in the order they run. Nothing here measures anything."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple

import numpy as np


class Case(NamedTuple):
    """A row (or rows) of the benchmark: the measurement that makes it, and
    its keyword arguments."""
    kind: str
    params: Dict[str, Any]


def forward_cases(quick: bool, nt: int) -> List[Case]:
    """The forward at B=1 H=8 L=1024 D=64 with its peers, then decoding."""
    base = dict(B=1, Hq=8, Hk=8, Lq=1024, Lk=1024, D=64)
    return [
        Case("case", dict(name=f"B=1 H=8 L=1024 D=64, {nt} threads", **base, numpy=True,
                          medium=True)),
        *([Case("case", dict(name="B=1 H=8 L=1024 D=64, 1 thread", **base, threads=1))]
          if nt > 1 else []),
        Case("case", dict(name="  same, causal", **base, causal=True)),
        Case("case", dict(name="  same, need_weights", **base, need_weights=True, numpy=True)),
        Case("decode", dict(Lk=8192, Hq=32, Hk=32, D=128)),
        Case("decode", dict(Lk=32768, Hq=32, Hk=8, D=128)),     # GQA: the same bytes of cache
        *([Case("memory", dict(L=16384, H=8, D=64))] if not quick else []),
    ]


def training_cases(quick: bool, nt: int, torch: bool) -> List[Case]:
    """Gradients, the layer, whole models, memory, dask."""
    base = dict(B=1, H=8, L=1024, D=64)
    Lm = 1024 if quick else 3072
    return [
        Case("backward", dict(name=f"fwd+bwd B=1 H=8 L=1024 D=64, {nt} threads", **base,
                              medium=True)),
        Case("backward", dict(name="  same, backward only", **base, step=False, numpy=True)),
        Case("backward", dict(name="  same, causal backward only", **base, step=False,
                              causal=True)),
        Case("mha_step", dict(B=8, L=256, d_model=512, H=8)),
        *[Case("transformers_decoder", dict(L=256 if quick else 1024, dtype=dtype, small=quick))
          for dtype in ("float32", "bfloat16") if torch],
        *([Case("backward_memory", dict(L=16384, H=8, D=64))] if not quick else []),
        *[Case("mask_backward", dict(L=Lm, H=8, D=64, mshape=mshape))
          for mshape in ((1, 1, 1, Lm), (1, 1, Lm, Lm))],
        Case("dask_cluster", dict(L=8192, H=8, D=64, chunk=2048) if quick else
             dict(L=65536, H=8, D=64, chunk=8192)),
    ]


def variant_cases(quick: bool) -> List[Case]:
    """The variants, each against the same call without it; then packed batches."""
    sinks, slopes = np.linspace(-1, 1, 8, dtype=np.float32), 2.0 ** -np.arange(1, 9, dtype=np.float32)
    spread = np.linspace(64, 2048, 16).astype(int)    # ~48% padding when padded to 2048
    Lw, w = (4096, 256) if quick else (16384, 1024)
    return [
        *[Case("variant", dict(name=f"{what}{', causal' if causal else ''} L=1024 H=8 D=64",
                               L=1024, H=8, D=64, base={"is_causal": causal}, opts=opts))
          for what, opts in (("sinks", {"sinks": sinks}), ("softcap 30", {"softcap": 30.0}),
                             ("ALiBi", {"alibi_slopes": slopes}))
          for causal in (False, True)],
        *[Case("variant", dict(name=f"window ({w}, 0) vs causal, L={Lw} H=8 D=64"
                                    f"{', backward' if grad else ''}", L=Lw, H=8, D=64,
                               base={"is_causal": True}, opts={"window": (w, 0)}, grad=grad))
          for grad in (False, True)],
        *[Case("varlen", dict(lengths=(spread if not quick else spread // 4).tolist(), H=8, D=64,
                              grad=grad)) for grad in (False, True)],
    ]


def sweep_cases(quick: bool, torch: bool) -> List[Case]:
    """The forward over sequence lengths and head sizes, then masks, GQA, layouts, dtypes
    (the bfloat16 rows with precision="medium" beside them, as the first forward row
    and the first fwd+bwd row)."""
    lengths = [16, 128, 1024] if quick else [16, 64, 256, 1024, 4096]
    dims = [64] if quick else [32, 64, 128]
    L, D = (256, 64) if quick else (1024, 64)
    bool_mask = np.random.default_rng(1).random((1, 1, L, L)) > 0.2
    float_mask = np.where(bool_mask, 0.0, -np.inf).astype(np.float32)
    pad = np.ones((2, 1, 1, L), dtype=bool)
    pad[1, ..., L * 3 // 4:] = False
    one, two = dict(B=1, Hq=8, Hk=8, Lq=L, Lk=L, D=D), dict(B=2, Hq=8, Hk=8, Lq=L, Lk=L, D=D)
    return [
        *[Case("case", dict(name=f"sweep L={n} D={d}", B=1, Hq=8, Hk=8, Lq=n, Lk=n, D=d))
          for n in lengths for d in dims],
        Case("case", dict(name=f"sweep L={L} D={D} bool mask (1,1,L,L)", **one, mask=bool_mask)),
        Case("case", dict(name=f"sweep L={L} D={D} float mask (1,1,L,L)", **one,
                          mask=float_mask)),
        Case("case", dict(name=f"sweep L={L} D={D} B=2 padding mask (B,1,1,L)", **two, mask=pad)),
        Case("case", dict(name=f"sweep L={L} D={D} causal + padding", **two, mask=pad,
                          causal=True)),
        Case("case", dict(name=f"sweep L={L} D={D} GQA Hq=8 Hk=2", **{**one, "Hk": 2})),
        Case("case", dict(name=f"sweep L={L} D={D} layout blhd", **one, layout="blhd")),
        *([Case("case", dict(name=f"sweep L={L} D={D} bfloat16 (torch bfloat16)", **one,
                             bfloat16=True, medium=True))] if torch else []),
        *([Case("case", dict(name="sweep L=4096 D=128 causal bfloat16 (torch bfloat16)", B=1,
                             Hq=8, Hk=8, Lq=4096, Lk=4096, D=128, causal=True, bfloat16=True,
                             medium=True))] if torch and not quick else []),
    ]


def mask_cases(quick: bool) -> List[Case]:
    """Masks that cost what they keep (issue 45): packed documents, a causal mask,
    a prefix-LM, a mask with no empty block; B=1 H=8 D=64."""
    Ls = [1024] if quick else [2048, 4096]
    L1 = 1024 if quick else 4096
    L2 = 1024 if quick else 2048
    docs = [Case("block_mask", dict(name=f"documents 200-700, L={L}{', fwd+bwd' if g else ''}",
                                    L=L, H=8, D=64, what="documents", grad=g))
            for g in (False, True) for L in Ls]
    return docs + [
        Case("block_mask", dict(name=f"causal bool mask, L={L1}", L=L1, H=8, D=64,
                                what="causal")),
        Case("block_mask", dict(name=f"prefix-LM {L1 // 4}, L={L1}", L=L1, H=8, D=64,
                                what="prefix", prefix=L1 // 4)),
        Case("block_mask", dict(name=f"10% dropped at random, L={L2}", L=L2, H=8, D=64,
                                what="dense")),
    ]


def cases(quick: bool, threads: int, torch: bool) -> List[Case]:
    """Every case of the benchmark, in the order they run (``quick``: fewer and
    smaller; ``torch``: whether torch is installed, for the rows that need it)."""
    return (forward_cases(quick, threads) + training_cases(quick, threads, torch)
            + variant_cases(quick) + mask_cases(quick) + sweep_cases(quick, torch))


SMOKE = Case("case", dict(name="smoke B=1 H=2 L=32 D=16", B=1, Hq=2, Hk=2, Lq=32, Lk=32, D=16,
                          numpy=True))
"""One tiny row through the benchmark's own machinery (the tests run it)."""
