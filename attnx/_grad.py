"""Gradients of ``scaled_dot_product_attention``: the vjp and backward forms, and
``merge_attention``.

The arithmetic is the C core's fused backward pass (FlashAttention-2's scheme:
probabilities recomputed tile by tile from the forward's ``lse``, never the
Lq×Lk matrix); this module normalises the arguments exactly as the forward
does, allocates the gradients in the caller's layout and reduces a float
mask's gradient over its broadcast axes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import NDArray

from . import _attnx
# (Alignment, Layout, Precision, Window: names in the signatures that takes() writes)
from ._args import (CAUSAL_ARG, F32, Alignment, ArrayInput, Causal, Layout, Precision, Window, as_array,
                    as_float, attention_args, check_flag, small_float_array,
                    check_layout, lse_like, output_like, shape_str)
from ._functional import CALL_THREADS, OPTIONS, fold_calls, scaled_dot_product_attention
from ._options import Options, check_names, takes
from ._reference import reference_attention_backward
from ._saved import Fingerprints

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AttentionGrads", "scaled_dot_product_attention_vjp",
           "scaled_dot_product_attention_backward", "merge_attention", "reference_backward"]


class AttentionGrads(NamedTuple):
    """Gradients of attention's inputs, each shaped (and laid out) like the input as passed.

    query, key, value: float32 (float64 from attnx.reference_backward). attn_mask: the gradient of a float mask,
    summed over the axes along which it was broadcast (shaped like the mask as
    passed); None for a bool mask or no mask. sinks: the gradient of the sink
    logits, shaped like ``sinks`` as passed (summed over its broadcast axes); None
    without sinks.
    """

    query: NDArray[Any]
    key: NDArray[Any]
    value: NDArray[Any]
    attn_mask: Optional[NDArray[Any]] = None
    sinks: Optional[NDArray[Any]] = None


def _mask_grad(dmask: NDArray[Any], mask: object) -> NDArray[Any]:
    """The full (batch..., Hq, Lq, Lk) gradient summed to the shape of the mask as
    passed (in float64: the sums cancel, a row's dS adds up to 0)."""
    return _reduce_to(dmask, np.shape(as_array(mask, "attn_mask"))).astype(dmask.dtype)


def _mask_grad_arrays(mask: object, scores: Tuple[int, ...]) -> Tuple[F32, F32]:
    """A float mask's gradient, zeroed, shaped like the mask as passed, and its
    writeable (batch..., Hq, Lq, Lk) view with stride 0 along every axis the
    mask is broadcast over: the core sums dS along those axes as it computes
    it, so no (batch..., Hq, Lq, Lk) array exists unless the mask is one."""
    # the mask was checked by attention_args; read its shape without converting it again
    shape = tuple(int(n) for n in getattr(mask, "shape", None) or as_array(mask, "attn_mask").shape)
    g = np.zeros(shape, np.float32)
    lead = len(scores) - len(shape)
    strides = [0 if n == 1 else st
               for n, st in zip((1,) * lead + shape, (0,) * lead + g.strides)]
    view: F32 = np.lib.stride_tricks.as_strided(g, scores, strides)
    return g, view


@takes(Options, before="mask_grad")
def scaled_dot_product_attention_backward(
        dout: ArrayInput, query: ArrayInput, key: ArrayInput, value: ArrayInput,
        out: ArrayInput, lse: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, mask_grad: bool = True,
        **options: Unpack[Options]) -> AttentionGrads:
    """Gradients of :func:`attnx.scaled_dot_product_attention` from saved tensors.

    ``dout`` is the gradient of the loss with respect to ``out`` (the output's
    shape); ``out`` and ``lse`` are what the forward returned for these inputs
    with ``return_lse=True``; every other argument is the forward's, with the
    same meaning. For callers that keep their own saved tensors; most code
    wants :func:`attnx.scaled_dot_product_attention_vjp`.

    Returns :class:`attnx.AttentionGrads` (query, key, value, attn_mask), each
    shaped like the input as passed (layout included; GQA key/value gradients
    summed over each group; a float mask's gradient summed over its broadcast
    axes as the backward computes it, so no (B..., Hq, Lq, Lk) array is made
    unless the mask has that shape; None for a bool mask, or with
    ``mask_grad=False``, which skips it). Keys past ``key_lengths``, query rows past
    ``query_lengths`` and rows with no allowed key get zero gradients. float32.
    Deterministic: the same bits on every run with a given thread count.

    Example
    -------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8), dtype=np.float32) for _ in range(3))
    >>> out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> g = attnx.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse)
    >>> g.query.shape, g.value.shape, g.attn_mask
    ((1, 2, 4, 8), (1, 2, 4, 8), None)
    """
    check_names(options, OPTIONS, "scaled_dot_product_attention_backward")
    p = attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       **options).astype(np.float32)
    o = output_like(out, "out", p)
    do = output_like(dout, "dout", p)
    lse4 = lse_like(lse, p)

    # gradients in the caller's layout, and their (batch..., H, L, X) views
    grads = [np.empty(p.caller_shape(a.shape), np.float32) for a in (p.q, p.k, p.v)]
    views = [p.core_view(g) for g in grads]
    gm = dmask = None
    if check_flag(mask_grad, "mask_grad") and p.mask is not None and p.mask.dtype != np.bool_:
        gm, dmask = _mask_grad_arrays(attn_mask, p.scores_shape)
    for (q, k, v, m, o4, do4, l4, dq, dk, dv, dm, mb), (kl, ql, slopes, sk) in fold_calls(
            p.batch_shape, [p.q, p.k, p.v, p.mask, o, do, lse4, *views, dmask, p.mask_blocks],
            p.per_head()):
        assert (q is not None and k is not None and v is not None and o4 is not None
                and do4 is not None and l4 is not None and dq is not None and dk is not None
                and dv is not None)
        assert m is not None or mb is None
        mask: Any = m if mb is None else (m, mb)
        _attnx.backward(q, k, v, o4, do4, l4, dq, dk, dv, dm, mask, kl, ql, p.causal, p.scale,
                        p.variants.core(slopes, sk), CALL_THREADS.get())
    gs = None
    if p.variants.sinks is not None:
        gs = _sinks_grad(p.variants.sinks.reshape(p.batch_shape + p.q.shape[-3:-2]), o, do,
                         lse4[..., 0], options.get("sinks")).astype(np.float32)
    return AttentionGrads(grads[0], grads[1], grads[2], gm, gs)


def _sinks_grad(sinks: NDArray[Any], o: NDArray[Any], do: NDArray[Any], lse: NDArray[Any],
                given: object) -> NDArray[np.float64]:
    """d sink_h = -sum_i exp(sink_h - lse_i) · rowsum(dO ∘ O)_i over the rows that
    attend (finite lse), summed to the shape of the sinks as passed.
    sinks (batch..., Hq); o, do (batch..., Hq, Lq, Ev); lse (batch..., Hq, Lq)."""
    d = np.einsum("...e,...e->...", do, o, dtype=np.float64)              # (batch..., Hq, Lq)
    lse64 = lse.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        p_sink = np.where(np.isfinite(lse64), np.exp(sinks[..., None] - lse64), 0.0)
    full = -(p_sink * d).sum(axis=-1)                                      # (batch..., Hq)
    return _reduce_to(full, np.shape(as_array(given, "sinks")))


def _reduce_to(g: NDArray[Any], shape: Tuple[int, ...]) -> NDArray[Any]:
    """A gradient of a broadcast argument summed to the argument's ``shape``."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)), dtype=np.float64)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True, dtype=np.float64)
    return np.array(g.reshape(shape))


@takes(Options)
def scaled_dot_product_attention_vjp(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False,
        **options: Unpack[Options]) -> Tuple[F32, Callable[[ArrayInput], AttentionGrads]]:
    """The forward's output and a function of its cotangent (JAX's ``vjp``).

    Same arguments and semantics as :func:`attnx.scaled_dot_product_attention`.
    Returns ``(out, vjp)``; ``vjp(dout)`` gives :class:`attnx.AttentionGrads`
    for an upstream gradient ``dout`` shaped like ``out``, and may be called
    any number of times. The backward recomputes the probabilities tile by
    tile from the forward's inputs, its ``lse`` (Lq floats a row) and a
    private copy of ``out``: modifying the returned ``out`` in place (a
    residual ``out += x``) changes nothing. ``query``, ``key``, ``value`` and
    ``attn_mask`` are kept by reference, with a fingerprint of each: if one is
    modified in place before ``vjp`` is called, ``vjp`` raises RuntimeError
    naming it (the gradients would be those of other values). Small arguments
    (lengths, sinks, slopes) are copied.

    Example
    -------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 16), dtype=np.float32) for _ in range(3))
    >>> out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    >>> g = vjp(np.ones_like(out))
    >>> g.query.shape, g.key.shape, g.value.shape, g.attn_mask
    ((2, 4, 10, 16), (2, 4, 10, 16), (2, 4, 10, 16), None)
    """
    check_names(options, OPTIONS, "scaled_dot_product_attention_vjp")
    return attention_vjp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         **options)


def attention_vjp(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                  attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
                  is_causal: Causal = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, *,
                  where: Optional[str] = "scaled_dot_product_attention_vjp",
                  **options: Unpack[Options]) -> Tuple[F32, Callable[[ArrayInput], AttentionGrads]]:
    """:func:`scaled_dot_product_attention_vjp`; ``where`` names the public function
    in the error of a modified input, None skips the fingerprints (a caller
    whose q, k, v are its own intermediate arrays, MultiHeadAttention.vjp)."""
    q, k, v = (as_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    mask = None if attn_mask is None else as_array(attn_mask, "attn_mask")

    kw: Any = dict(options, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                   scale=scale, enable_gqa=enable_gqa)
    for name in ("key_lengths", "query_lengths", "sinks", "alibi_slopes"):   # small: copied
        if kw.get(name) is not None:
            kw[name] = np.array(as_array(kw[name], name))
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    saved_out = out.copy()
    prints = None if where is None else Fingerprints(where, query=q, key=k, value=v,
                                                     attn_mask=mask)

    def vjp(dout: ArrayInput) -> AttentionGrads:
        if prints is not None:
            prints.check()
        return scaled_dot_product_attention_backward(dout, q, k, v, saved_out, lse, **kw)

    return out, vjp


@takes(Options)
def reference_backward(
        dout: ArrayInput, query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False,
        **options: Unpack[Options]) -> AttentionGrads:
    """The gradients of :func:`attnx.reference` in float64 NumPy: the oracle of the tests.

    Same arguments as :func:`attnx.scaled_dot_product_attention_vjp`, plus the
    upstream gradient ``dout`` first (shaped like the output); returns
    :class:`attnx.AttentionGrads` of float64 arrays shaped like the inputs as
    passed. Slow and memory-hungry: it builds every score.
    """
    check_names(options, OPTIONS, "reference_backward")
    p = attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       **options).astype(np.float64)
    B = math.prod(p.batch_shape)
    q, k, v, mask = p.folded()
    do = output_like(dout, "dout", p, np.float64)
    dq, dk, dv, ds, dsinks = reference_attention_backward(
        do.reshape((B,) + do.shape[-3:]), q, k, v, mask, CAUSAL_ARG[p.causal], p.scale,
        p.key_lengths, p.query_lengths, p.variants)

    def as_passed(a: NDArray[np.float64]) -> NDArray[np.float64]:
        """A (B, H, L, X) gradient in the caller's shape and layout."""
        core = a.reshape(p.batch_shape + a.shape[1:])
        out = np.empty(p.caller_shape(core.shape))
        p.core_view(out)[...] = core
        return out

    gm = None
    if mask is not None and mask.dtype != np.bool_:
        gm = _mask_grad(ds.reshape(p.scores_shape), attn_mask).astype(np.float64)
    gs = None
    if options.get("sinks") is not None:
        gs = _reduce_to(dsinks.reshape(p.batch_shape + dsinks.shape[-1:]),
                        np.shape(as_array(options.get("sinks"), "sinks"))).astype(np.float64)
    return AttentionGrads(as_passed(dq), as_passed(dk), as_passed(dv), gm, gs)


def merge_attention(outs: Sequence[ArrayInput], lses: Sequence[ArrayInput], *,
                    layout: Layout = "bhld",
                    sinks: Optional[ArrayInput] = None) -> Tuple[F32, F32]:
    """Attention over the union of disjoint sets of keys, from the attention over each.

    ``outs[s]`` (B..., H, Lq, Ev) (``layout="blhd"``: (B..., Lq, H, Ev)) and
    ``lses[s]`` (B..., H, Lq) are what ``scaled_dot_product_attention(...,
    return_lse=True)`` returned for the same queries against the s-th set of
    keys (chunks of a long sequence, pieces of a KV cache, other machines).
    Returns ``(out, lse)`` of attention over all of them: with M = max_s lse_s,
    ``out = sum_s exp(lse_s - M) out_s / sum_s exp(lse_s - M)`` and
    ``lse = M + log sum_s exp(lse_s - M)``; exact up to float32 rounding. A row
    with no allowed key anywhere (every lse -inf) gives zeros and -inf.

    ``sinks``: attention-sink logits, one per head, broadcastable to (B..., H)
    as in :func:`attnx.scaled_dot_product_attention`. Compute the parts
    *without* sinks and pass them here: the sink joins the merged softmax's
    denominator once (``out *= S / (S + exp(sink))``, ``lse = log(S +
    exp(sink))`` with S the merged sum; parts computed with sinks would count
    the sink once per part). A row with no allowed key still gives zeros and
    -inf, as the whole call does.

    Example
    -------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8), dtype=np.float32) for _ in range(3))
    >>> a = attnx.scaled_dot_product_attention(q, k[:, :, :2], v[:, :, :2], return_lse=True)
    >>> b = attnx.scaled_dot_product_attention(q, k[:, :, 2:], v[:, :, 2:], return_lse=True)
    >>> out, lse = attnx.merge_attention([a[0], b[0]], [a[1], b[1]])
    >>> bool(np.allclose(out, attnx.scaled_dot_product_attention(q, k, v), atol=1e-6))
    True
    """
    for name, c in (("outs", outs), ("lses", lses)):
        if not (isinstance(c, (list, tuple)) or (isinstance(c, np.ndarray) and c.ndim)):
            raise TypeError(f"{name} must be a list or tuple of arrays (or one array stacking "
                            f"them), one per set of keys; got {type(c).__name__}")
    outs, lses = list(outs), list(lses)
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"outs and lses must be non-empty sequences of the same length; got "
                         f"{len(outs)} and {len(lses)}")
    check_layout(layout)
    min_ndim = 2 if layout == "bhld" else 3
    os_: List[F32] = [as_float(o, f"outs[{i}]") for i, o in enumerate(outs)]
    ls: List[F32] = [as_float(x, f"lses[{i}]") for i, x in enumerate(lses)]
    for i, (o, lse) in enumerate(zip(os_, ls)):
        if o.ndim < min_ndim:
            raise ValueError(f"outs[{i}] must have at least {min_ndim} dimensions "
                             f"({'(B..., H, Lq, Ev)' if layout == 'bhld' else '(B..., Lq, H, Ev)'}); "
                             f"got {shape_str(o)}")
        rows = o.shape[:-1] if layout == "bhld" else o.shape[:-3] + (o.shape[-2], o.shape[-3])
        if o.shape != os_[0].shape or lse.shape != rows:
            raise ValueError(f"outs[{i}] {shape_str(o)} and lses[{i}] {shape_str(lse)} must match "
                             f"outs[0] {shape_str(os_[0])} and its rows (B..., H, Lq)")
    L = np.stack(ls)                                        # (S, B..., H, Lq)
    M = L.max(axis=0)
    Msub = np.where(np.isneginf(M), np.float32(0), M)
    with np.errstate(invalid="ignore", over="ignore"):
        f = np.exp(L - Msub)                                # (S, B..., H, Lq)
        den = f.sum(axis=0)
        fo = f if layout == "bhld" else np.swapaxes(f, -1, -2)
        num = sum(fs[..., None] * np.where(fs[..., None] == 0, np.float32(0), o)
                  for fs, o in zip(fo, os_))
        dn = den if layout == "bhld" else np.swapaxes(den, -1, -2)
        out = np.where(dn[..., None] == 0, np.float32(0), num / np.where(dn == 0, 1, dn)[..., None])
        lse_out = np.where(den == 0, -np.inf, Msub + np.log(np.where(den == 0, 1, den)))
    if sinks is not None:
        return join_sinks(out, lse_out, sinks, layout)
    return out.astype(np.float32), lse_out.astype(np.float32)


def join_sinks(out: NDArray[Any], lse: NDArray[Any], sinks: ArrayInput,
               layout: Layout = "bhld") -> Tuple[F32, F32]:
    """Attention ``(out, lse)`` over keys without sinks, with the sinks joined to
    each row's denominator: out (B..., H, Lq, Ev) (blhd: (B..., Lq, H, Ev)), lse
    (B..., H, Lq), sinks broadcastable to (B..., H). In float64; rows with lse
    -inf (no allowed key) stay zeros and -inf."""
    s = small_float_array(sinks, "sinks")
    heads = lse.shape[:-1]
    try:
        s64 = np.broadcast_to(s, heads).astype(np.float64)[..., None]       # (B..., H, 1)
    except ValueError:
        raise ValueError(f"sinks with shape {shape_str(s)} does not broadcast to the heads of "
                         f"lses (B..., H) = {heads}") from None
    if not np.isfinite(s64).all():
        raise ValueError("sinks must be finite")
    lse64 = lse.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.logaddexp(lse64, s64)                                       # (B..., H, Lq)
        w = np.where(np.isneginf(lse64), 0.0, np.exp(lse64 - total))
    w_out = w if layout == "bhld" else np.swapaxes(w, -1, -2)
    joined = (np.asarray(out, np.float64) * w_out[..., None]).astype(np.float32)
    return joined, np.where(np.isneginf(lse64), -np.inf, total).astype(np.float32)
