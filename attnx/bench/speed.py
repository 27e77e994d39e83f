"""The speed measurements: one function per kind of row (its name is the
row's ``"kind"``), each timing attnx against its peers on the same inputs
and threads (:meth:`.context.Context.time`), and the NumPy code tutorials
teach, the slowest peer."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import NDArray

from . import onnx
from .context import F32, Context, inputs, read_all
from .rows import Row


def numpy_attention(Q: F32, K: F32, V: F32) -> Tuple[F32, F32]:
    """The NumPy attention that tutorials teach (it builds every score):
    Q (N, Lq, D), K (N, Lk, D), V (N, Lk, Dv) -> out (N, Lq, Dv), weights (N, Lq, Lk)."""
    d_k = Q.shape[-1]
    scores = Q @ K.transpose(0, 2, 1) / np.sqrt(d_k)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return weights @ V, weights


def numpy_attention_backward(Q: F32, K: F32, V: F32, dO: F32) -> Tuple[F32, F32, F32]:
    """The obvious NumPy backward of numpy_attention (it builds P, dP and dS):
    Q (N, Lq, D), K, V (N, Lk, D), dO (N, Lq, D) -> dQ, dK, dV."""
    scale = 1.0 / np.sqrt(Q.shape[-1])
    s = Q @ K.transpose(0, 2, 1) * scale
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    P = e / e.sum(axis=-1, keepdims=True)
    O = P @ V
    dV = P.transpose(0, 2, 1) @ dO
    dP = dO @ V.transpose(0, 2, 1)
    dS = P * (dP - (dO * O).sum(axis=-1, keepdims=True))
    return (dS @ K) * scale, (dS.transpose(0, 2, 1) @ Q) * scale, dV


def case(ctx: Context, name: str, B: int, Hq: int, Hk: int, Lq: int, Lk: int, D: int, *,
         causal: bool = False, mask: Optional[NDArray[Any]] = None, layout: str = "bhld",
         need_weights: bool = False, numpy: bool = False, threads: Optional[int] = None,
         bfloat16: bool = False, medium: bool = False) -> List[Row]:
    """One row: attnx, torch's SDPA (unless need_weights), ONNX Runtime's
    MultiHeadAttention where it is installed (float32, no mask, Lq == Lk:
    :mod:`.onnx`) and, with ``numpy``, the tutorial NumPy code, on the same
    inputs and threads (``bfloat16``:
    bfloat16 tensors for attnx and torch, and attnx on float32 tensors of
    the same values beside them: the row's vs_float32 is how much faster
    the bfloat16 call is). With ``medium``, the same call under
    precision="medium" is timed among them and makes a second row (its
    vs_highest: how much faster than the first row's attnx call)."""
    attnx, torch, F = ctx.attnx, ctx.torch, ctx.F
    nt = threads or ctx.threads
    attnx.set_num_threads(nt)
    if torch:
        torch.set_num_threads(nt)
    q, k, v = inputs(B, Hq, Hk, Lq, Lk, D, layout)
    aq, ak, av = (q, k, v) if not bfloat16 else (torch.from_numpy(x).bfloat16() for x in (q, k, v))
    gqa = Hq != Hk
    lay = "blhd" if layout == "blhd" else "bhld"
    def a_call(precision: str) -> Callable[[], object]:
        return lambda: attnx.scaled_dot_product_attention(
            aq, ak, av, attn_mask=mask, is_causal=causal, enable_gqa=gqa, layout=lay,
            need_weights=need_weights, precision=precision)
    fns: List[Callable[[], object]] = [a_call("highest")]
    names = ["attnx"]
    if medium:
        fns.append(a_call("medium"))
        names.append("medium")
    if bfloat16:
        fq, fk, fv = (torch.from_numpy(x).bfloat16().float() for x in (q, k, v))
        fns.append(lambda: attnx.scaled_dot_product_attention(
            fq, fk, fv, attn_mask=mask, is_causal=causal, enable_gqa=gqa, layout=lay))
        names.append("float32")
    if torch and not need_weights:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        if bfloat16:
            tq, tk, tv = (x.bfloat16() for x in (tq, tk, tv))
        if layout == "blhd":   # torch wants (B, H, L, D): a transposed view, as its users pass it
            tq, tk, tv = (x.transpose(1, 2) for x in (tq, tk, tv))
        tm = torch.from_numpy(mask) if mask is not None else None
        tc = bool(causal) and mask is None
        kw = {"enable_gqa": True} if gqa else {}
        if causal and mask is not None:
            tm = tm & torch.ones(Lq, Lk, dtype=torch.bool).tril()
        fns.append(lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=tc, **kw))
        names.append("torch")
    if (ctx.ort and not need_weights and not bfloat16 and mask is None and not gqa
            and layout == "bhld" and Lq == Lk):
        fns.append(onnx.attention(ctx.ort, q, k, v, causal=causal, threads=nt))
        names.append("onnxruntime")
    if numpy:
        q3, k3, v3 = (x.reshape(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v))
        fns.append(lambda: numpy_attention(q3, k3, v3))
        names.append("numpy")
    # NumPy's matmul (OpenBLAS) and ONNX Runtime's pool spin after a call
    settle = [names.index(n) for n in ("numpy", "onnxruntime") if n in names]
    times = dict(zip(names, ctx.time(fns, settle)))
    flops = 4.0 * B * Hq * Lq * Lk * D
    row = ctx.speed_row(name, flops, times, nt, dense=not causal, dots=bfloat16)
    if bfloat16:
        row["note"] = f"{row['vs_float32']:.2f}x attnx's speed on float32 tensors"
    rows = [row] + ([medium_row(ctx, name, flops, times, nt, dense=not causal)] if medium else [])
    attnx.set_num_threads(0)
    return rows


def medium_row(ctx: Context, name: str, flops: float, times: Dict[str, float], nt: int, *,
               dense: bool) -> Row:
    """The row of a call under precision="medium" (``times["medium"]``) beside
    the same call's under "highest" (``times["attnx"]``), timed with it."""
    t = {**{k: v for k, v in times.items() if k not in ("attnx", "medium", "float32")},
         "attnx": times["medium"], "highest": times["attnx"]}
    row = ctx.speed_row(f"{name}, precision='medium'", flops, t, nt, dense=dense, dots=True)
    row["precision"] = "medium"
    row["note"] = f"{row['vs_highest']:.2f}x the same call's speed under precision='highest'"
    return row


def decode(ctx: Context, Lk: int, Hq: int, Hk: int, D: int) -> List[Row]:
    """Lq = 1 over a cache of Hk heads: bandwidth bound. Per storage dtype
    (float32, float16, bfloat16 when ml_dtypes is installed, and an int8
    KVCache with its float32 scales), the GB/s of K and V read against the
    roofline: a plain reduction over the same bytes on as many threads
    (:func:`.context.read_all`). Every dtype's call and roofline (and torch's
    float32 call) are timed interleaved in one round, so that the ratios
    between the caches are of the same moments of a shared machine.
    (On AMD EPYC Zen 5, 2 threads, over 512 MiB: NumPy's maximum as uint32
    or float32 67-69 GB/s, float32 add 38, torch's sum 81.) The float16,
    bfloat16 and int8 caches are read under precision="medium" too, in the
    same rounds: a row each, with vs_highest (against the same cache's call) and, for
    int8, vs_bfloat16_cache against the bfloat16 cache under "highest"."""
    attnx = ctx.attnx
    attnx.set_num_threads(ctx.threads)
    q = inputs(1, Hq, Hk, 1, Lk, D)[0]
    k32, v32 = inputs(1, Hk, Hk, Lk, Lk, D, seed=1)[1:]
    dtypes: List[Any] = [np.float32, np.float16]
    try:
        import ml_dtypes
        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    dtypes.append(np.int8)      # an int8 KVCache: int8 values and a float32 scale a row
    gqa = f" GQA {Hq}/{Hk}" if Hq != Hk else f" H={Hq}"
    fns: List[Callable[[], object]] = []
    settle: List[int] = []
    # per dtype: its name, bytes read, and where its calls sit in fns
    specs: List[Tuple[str, int, int, Optional[int]]] = []
    unrotated_at: Optional[int] = None
    medium_at: Dict[str, int] = {}      # the calls under precision="medium", by cache
    for dt in dtypes:
        at, torch_at = len(fns), None
        if dt == np.int8:
            cache = attnx.KVCache(1, Hk, Lk, D, dtype=np.int8)
            cache.append(k32, v32)
            k, v = cache.k, cache.v
            scales: Sequence[NDArray[Any]] = (cache.k_scale, cache.v_scale)
            fns += [partial(cache.attend, q), partial(read_all, k, v, ctx.threads, scales)]
            medium_at["int8 KVCache"] = len(fns)
            fns.append(partial(cache.attend, q, precision="medium"))
            # the same bytes read as the previous release's format (rows neither
            # centred nor rotated): the cost of the two small products a call that
            # rotate, and of the lse's shift back, beside the kernels'
            plain = copy.copy(cache)
            plain.k_rotation = plain.v_rotation = plain.k_center = None
            unrotated_at = len(fns)
            fns.append(partial(plain.attend, q))
        else:
            k, v, scales = k32.astype(dt), v32.astype(dt), ()
            fns += [partial(attnx.scaled_dot_product_attention, q, k, v, enable_gqa=Hq != Hk),
                    partial(read_all, k, v, ctx.threads)]
            if np.dtype(dt).name in ("bfloat16", "float16"):
                medium_at[np.dtype(dt).name] = len(fns)
                fns.append(partial(attnx.scaled_dot_product_attention, q, k, v,
                                   enable_gqa=Hq != Hk, precision="medium"))
        if ctx.torch and dt == np.float32:
            tq, tk, tv = (ctx.torch.from_numpy(x) for x in (q, k, v))
            ctx.torch.set_num_threads(ctx.threads)
            torch_at = len(fns)
            settle.append(torch_at)      # torch's OpenMP threads spin after its call
            fns.append(partial(ctx.F.scaled_dot_product_attention, tq, tk, tv,
                               enable_gqa=Hq != Hk))
        name = "int8 KVCache" if dt == np.int8 else np.dtype(dt).name   # its bytes: the scales too
        specs.append((name, k.nbytes + v.nbytes + sum(a.nbytes for a in scales), at, torch_at))
    times = ctx.time(fns, settle)
    rows: List[Row] = []
    for name, nbytes, at, torch_at in specs:
        t, t_roof = times[at], times[at + 1]
        gbs, roof = nbytes / t / 1e9, nbytes / t_roof / 1e9
        row: Row = {"case": f"decode {name}{gqa} Lk={Lk} D={D}", "threads": ctx.threads,
                    "attnx_s": t, "attnx_gflops": 4.0 * Hq * Lk * D / t / 1e9,
                    "attnx_GBps": gbs, "roofline_GBps": roof, "of_roofline": gbs / roof,
                    "note": f"reads K+V at {gbs:.1f} GB/s = {gbs / roof:.0%} of a plain "
                            f"reduction's {roof:.1f} GB/s over the same bytes"}
        if torch_at is not None:
            row["torch_gflops"] = 4.0 * Hq * Lk * D / times[torch_at] / 1e9
            row["vs_torch"] = times[torch_at] / t
        if rows:
            row["vs_float32_cache"] = rows[0]["attnx_s"] / t
            row["note"] += f"; {row['vs_float32_cache']:.2f}x the float32 cache's speed"
        bf16 = [r for r in rows if "bfloat16" in r["case"]]
        if name == "int8 KVCache" and bf16:
            row["vs_bfloat16_cache"] = bf16[0]["attnx_s"] / t
            row["note"] += f", {row['vs_bfloat16_cache']:.2f}x the bfloat16 cache's"
        if name == "int8 KVCache" and unrotated_at is not None:
            row["vs_unrotated_int8"] = times[unrotated_at] / t
            row["note"] += (f"; {row['vs_unrotated_int8']:.2f}x the same int8 rows read "
                            f"uncentred and unrotated (the previous format)")
        rows.append(row)
    for name, at in medium_at.items():
        highest = next(r for r in rows if r["case"].startswith(f"decode {name}"))
        t = times[at]
        gbs = highest["attnx_GBps"] * highest["attnx_s"] / t     # the same bytes
        row = {"case": f"{highest['case']}, precision='medium'", "threads": ctx.threads,
               "precision": "medium", "attnx_s": t, "attnx_gflops": 4.0 * Hq * Lk * D / t / 1e9,
               "attnx_GBps": gbs, "roofline_GBps": highest["roofline_GBps"],
               "of_roofline": gbs / highest["roofline_GBps"], "vs_highest": highest["attnx_s"] / t,
               "note": f"{highest['attnx_s'] / t:.2f}x the same cache under precision='highest'"}
        bf16 = [r for r in rows if r["case"].startswith("decode bfloat16")]
        if name == "int8 KVCache" and bf16:
            row["vs_bfloat16_cache"] = bf16[0]["attnx_s"] / t
            row["note"] += f", {row['vs_bfloat16_cache']:.2f}x the bfloat16 cache's"
        rows.append(row)
    attnx.set_num_threads(0)
    return rows


def backward(ctx: Context, name: str, B: int, H: int, L: int, D: int, *, causal: bool = False,
             step: bool = True, numpy: bool = False, medium: bool = False) -> List[Row]:
    """Gradients: ``step`` times a forward (with lse) + backward against torch's
    forward + backward (14·B·H·L²·D FLOP); otherwise the backward alone
    against torch's backward alone (10·B·H·L²·D), and, with ``numpy``, the
    obvious NumPy backward that materialises P, dP and dS. With ``medium``
    (and ``step``), the step under precision="medium" too: a second row."""
    attnx, torch, F = ctx.attnx, ctx.torch, ctx.F
    attnx.set_num_threads(ctx.threads)
    q, k, v, dout = inputs(B, H, H, L, L, D) + inputs(B, H, H, L, L, D, seed=1)[:1]
    out, lse = attnx.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)

    def a_step(precision: str = "highest") -> object:
        o, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, is_causal=causal,
                                                        precision=precision)
        return vjp(dout)

    def a_bwd() -> object:
        return attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                           is_causal=causal)
    fns: List[Callable[[], object]] = [a_step if step else a_bwd]
    names = ["attnx"]
    if medium and step:
        fns.append(partial(a_step, "medium"))
        names.append("medium")
    if torch:
        torch.set_num_threads(ctx.threads)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        tdo = torch.from_numpy(dout)
        if step:
            fns.append(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                       .backward(tdo))
        else:
            graph = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            fns.append(lambda: torch.autograd.grad(graph, (tq, tk, tv), tdo, retain_graph=True))
        names.append("torch")
    if numpy:
        fns.append(lambda: numpy_attention_backward(q[0], k[0], v[0], dout[0]))
        names.append("numpy")
    settle = [names.index("numpy")] if numpy else []
    times = dict(zip(names, ctx.time(fns, settle)))
    flops = (14.0 if step else 10.0) * B * H * L * L * D
    rows = [ctx.speed_row(name, flops, times, ctx.threads, dense=not causal)]
    if "medium" in times:
        rows.append(medium_row(ctx, name, flops, times, ctx.threads, dense=not causal))
    attnx.set_num_threads(0)
    return rows


def mha_step(ctx: Context, B: int, L: int, d_model: int, H: int) -> Row:
    """MultiHeadAttention forward + backward against torch.nn.MultiheadAttention's."""
    attnx, torch = ctx.attnx, ctx.torch
    attnx.set_num_threads(ctx.threads)
    mha = attnx.MultiHeadAttention(d_model, H, seed=0)
    x, dout = (np.random.default_rng(s).standard_normal((B, L, d_model), dtype=np.float32)
               for s in (0, 1))

    def a_step() -> object:
        out, vjp = mha.vjp(x)
        return vjp(dout)
    fns: List[Callable[[], object]] = [a_step]
    names = ["attnx"]
    if torch:
        torch.set_num_threads(ctx.threads)
        tm = torch.nn.MultiheadAttention(d_model, H, batch_first=True)
        tx = torch.tensor(x, requires_grad=True)
        tdo = torch.from_numpy(dout)
        fns.append(lambda: tm(tx, tx, tx, need_weights=False)[0].backward(tdo))
        names.append("torch")
    times = dict(zip(names, ctx.time(fns)))
    flops = 14.0 * B * L * L * d_model + 2.0 * 3 * 4 * B * L * d_model * d_model
    row = ctx.speed_row(f"MHA fwd+bwd B={B} L={L} d_model={d_model} H={H}",
                        flops, times, ctx.threads)
    attnx.set_num_threads(0)
    return row


def variant(ctx: Context, name: str, L: int, H: int, D: int, base: Dict[str, Any],
            opts: Dict[str, Any], *, grad: bool = False) -> Row:
    """attnx with ``base`` + ``opts`` (a variant) against attnx with ``base``
    alone, interleaved: the forward, or with ``grad`` the backward alone."""
    attnx = ctx.attnx
    attnx.set_num_threads(ctx.threads)
    q, k, v, dout = inputs(1, H, H, L, L, D) + inputs(1, H, H, L, L, D, seed=1)[:1]

    def call(kw: Dict[str, Any]) -> Callable[[], object]:
        if not grad:
            return lambda: attnx.scaled_dot_product_attention(q, k, v, **kw)
        out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        return lambda: attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)
    t_var, t_base = ctx.time([call({**base, **opts}), call(base)])
    row: Row = {"case": name, "threads": ctx.threads, "attnx_s": t_var, "base_s": t_base,
                "vs_base": t_base / t_var,
                "note": f"{t_var / t_base:.2f}x the time without it "
                        f"({1e3 * t_var:.1f} ms against {1e3 * t_base:.1f} ms)"}
    attnx.set_num_threads(0)
    return row


def varlen(ctx: Context, lengths: Sequence[int], H: int, D: int, *, grad: bool = False) -> Row:
    """A packed batch through attnx.varlen_attention against torch's SDPA on the
    same batch padded, with a padding mask (forward, or forward + backward)."""
    attnx, torch, F = ctx.attnx, ctx.torch, ctx.F
    attnx.set_num_threads(ctx.threads)
    lens = np.asarray(lengths)
    B, L, total = len(lens), int(lens.max()), int(lens.sum())
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((total, H, D), dtype=np.float32) for _ in range(4))
    cu = np.concatenate([[0], np.cumsum(lens)])

    def a_call() -> object:
        if not grad:
            return attnx.varlen_attention(q, k, v, cu, cu)
        out, vjp = attnx.varlen_attention_vjp(q, k, v, cu, cu)
        return vjp(dout)
    fns: List[Callable[[], object]] = [a_call]
    names = ["attnx"]
    if torch:
        torch.set_num_threads(ctx.threads)
        pad = [torch.from_numpy(attnx.unpack(x, cu)).transpose(1, 2).contiguous()
               for x in (q, k, v, dout)]                         # (B, H, L, D), padded
        tq, tk, tv = (x.clone().requires_grad_(grad) for x in pad[:3])
        mask = torch.arange(L)[None, :] < torch.from_numpy(lens)[:, None]
        tm = mask[:, None, None, :]                              # (B, 1, 1, L) keys

        def t_call() -> object:
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
            return out.backward(pad[3]) if grad else out
        fns.append(t_call)
        names.append("torch")
    times = dict(zip(names, ctx.time(fns)))
    flops = (14.0 if grad else 4.0) * H * D * float((lens.astype(np.float64) ** 2).sum())
    padding = 1 - total / (B * L)
    row = ctx.speed_row(f"varlen {B} seqs {lens.min()}..{L}{', fwd+bwd' if grad else ''}, "
                        f"H={H} D={D}", flops, times, ctx.threads)
    row["note"] = f"torch on the batch padded to {L} ({padding:.0%} padding) with a padding mask"
    attnx.set_num_threads(0)
    return row
