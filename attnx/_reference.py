"""Float64 NumPy reference of masked multi-head scaled dot-product attention.

This is the oracle the C core is tested against (and what ``python -m attnx``
checks its demo with). It is written for clarity, not speed: it builds the
full (B, H, Lq, Lk) score matrix in float64.

Semantics (shared with the C core):

* ``scores = (q @ k^T) * scale + float_mask``; a key is *allowed* for a query
  when the bool mask is True, the causal rule admits it and it lies inside
  ``key_lengths``.
* ``m`` is the row maximum of the allowed scores; when ``m`` is ``-inf`` it
  is replaced by 0 before subtracting (so a row whose allowed scores are all
  ``-inf`` sums to zero and gives zeros, never NaN); NaN propagates.
* a row with no allowed key, or with all allowed scores ``-inf``, gives zeros
  in the output and in the weights; query rows past ``query_lengths`` too.
* keys with zero weight add nothing to the output, even when their values
  hold inf or NaN (padding may hold anything); NaN weights propagate.
* a row whose allowed scores hold NaN (or +inf) is NaN throughout: its
  output and every weight, those of masked or padded keys included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attnx
from ._args import (CAUSAL_ARG, NO_VARIANTS, ArrayInput, Causal, Variants, as_array,
                    attention_args, check_flag, default_scale)
from ._options import Options

if TYPE_CHECKING:
    from typing_extensions import Unpack

F64 = NDArray[np.float64]

__all__ = ["reference", "reference_attention"]


def reference_attention(q: ArrayInput, k: ArrayInput, v: ArrayInput,
                        attn_mask: Optional[ArrayInput] = None, is_causal: Causal = False,
                        scale: Optional[float] = None, key_lengths: Optional[ArrayLike] = None,
                        query_lengths: Optional[ArrayLike] = None,
                        ) -> Tuple[F64, F64]:
    """Float64 attention on already-normalised 4-D arrays.

    q: (B, Hq, Lq, E), k: (B, Hk, Lk, E), v: (B, Hk, Lk, Ev), Hq % Hk == 0.
    attn_mask: None, bool (True = attend) or float (added to the scores),
    broadcastable to (B, Hq, Lq, Lk).
    is_causal: False, True / "upper_left" (key j allowed when j <= i) or
    "lower_right" (j <= i + Lk - Lq).
    key_lengths, query_lengths: None or ints broadcastable to (B, Hq).

    Returns (out (B, Hq, Lq, Ev), weights (B, Hq, Lq, Lk)), both float64.
    """
    out, w, _, _ = _forward64(q, k, v, attn_mask, is_causal, scale, key_lengths, query_lengths,
                              NO_VARIANTS)
    return out, w


def _forward64(q: ArrayInput, k: ArrayInput, v: ArrayInput, attn_mask: Optional[ArrayInput],
               is_causal: Causal, scale: Optional[float], key_lengths: object,
               query_lengths: object, variants: Variants) -> Tuple[F64, F64, F64, Optional[F64]]:
    """reference_attention with the variants: (out, weights, the sink's weight
    (B, Hq, Lq, 1), and tanh(s / softcap) (B, Hq, Lq, Lk) or None)."""
    q, k, v = (_float64(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    B, Hq, Lq, E = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    group = Hq // Hk if Hk else 1
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = default_scale(E)
    with np.errstate(invalid="ignore", over="ignore"):
        scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        t = None
        if variants.softcap:
            t = np.tanh(scores / variants.softcap)
            scores = variants.softcap * t
        if variants.alibi is not None:
            scores = scores - variants.alibi.reshape(B, Hq, 1, 1) * _distance(variants, is_causal, Lq, Lk)
    mask = None if attn_mask is None else as_array(attn_mask, "attn_mask")
    bool_mask = mask if mask is not None and mask.dtype == np.bool_ else None
    if mask is not None and bool_mask is None:
        scores = scores + mask.astype(np.float64)
    allowed, row_ok = _allowed(scores.shape, bool_mask, is_causal, key_lengths, query_lengths)
    allowed &= _band(variants, is_causal, Lq, Lk)
    sinks = None if variants.sinks is None else variants.sinks.reshape(B, Hq, 1, 1)
    w, w_sink = _softmax(np.where(allowed, scores, -np.inf), allowed, sinks)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(row_ok, w, 0.0)
        w_sink = np.where(row_ok, w_sink, 0.0)
        # masked keys contribute nothing, whatever their values hold
        out = _weighted_sum(w, v)
    return out, w, w_sink, t


def _diagonal(variants: Variants, is_causal: Causal, Lq: int, Lk: int) -> NDArray[np.int64]:
    """d(i) for every query row, (Lq, 1): i, or i + Lk - Lq aligned lower-right."""
    lower_right = is_causal == "lower_right" or (
        not is_causal and variants.align == _attnx.ALIGN_LOWER_RIGHT)
    return np.arange(Lq)[:, None] + (Lk - Lq if lower_right else 0)


def _distance(variants: Variants, is_causal: Causal, Lq: int, Lk: int) -> F64:
    """|d(i) - j|, (Lq, Lk), for ALiBi."""
    d: F64 = np.abs(_diagonal(variants, is_causal, Lq, Lk) - np.arange(Lk)[None, :]).astype(np.float64)
    return d


def _band(variants: Variants, is_causal: Causal, Lq: int, Lk: int) -> NDArray[np.bool_]:
    """(Lq, Lk): the keys the window lets each query see (all without a window)."""
    if variants.window is None:
        return np.ones((Lq, Lk), dtype=bool)
    left, right = variants.window
    d, j = _diagonal(variants, is_causal, Lq, Lk), np.arange(Lk)[None, :]
    ok = np.ones((Lq, Lk), dtype=bool)
    if left >= 0:
        ok &= j >= d - left
    if right >= 0:
        ok &= j <= d + right
    return ok


def _float64(x: object, name: str) -> F64:
    """An array argument as float64 (no copy when it already is)."""
    return np.asarray(as_array(x, name), dtype=np.float64)


def _allowed(shape: Tuple[int, ...], bool_mask: Optional[NDArray[np.bool_]], is_causal: Causal,
             key_lengths: object, query_lengths: object) -> Tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """Which scores of (B, H, Lq, Lk) are allowed (the bool mask, the causal
    rule and key_lengths, by AND), and which query rows lie inside query_lengths."""
    B, Hq, Lq, Lk = shape
    allowed = np.ones(shape, dtype=bool)
    if bool_mask is not None:
        allowed &= bool_mask
    if is_causal:
        offset = Lk - Lq if is_causal == "lower_right" else 0
        allowed &= np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + offset
    if key_lengths is not None:
        kl = np.broadcast_to(as_array(key_lengths, "key_lengths"), (B, Hq))
        allowed &= np.arange(Lk)[None, None, None, :] < kl[:, :, None, None]
    row_ok = np.ones((B, Hq, Lq, 1), dtype=bool)
    if query_lengths is not None:
        ql = np.broadcast_to(as_array(query_lengths, "query_lengths"), (B, Hq))
        row_ok = np.arange(Lq)[None, None, :, None] < ql[:, :, None, None]
    return allowed, row_ok


def _softmax(scores: F64, allowed: NDArray[np.bool_],
             sinks: Optional[F64] = None) -> Tuple[F64, F64]:
    """The weights of each row's allowed scores (others -inf): zeros for a row
    with none or all -inf, never NaN; NaN and +inf propagate. With sinks
    (B, H, 1, 1) each row's denominator also holds exp(sink) (not for a row
    that is zeros). Returns (weights, the sink's weight (B, H, Lq, 1))."""
    if scores.shape[-1] > 0:
        m = np.max(scores, axis=-1, keepdims=True)
    else:
        m = np.zeros(scores.shape[:-1] + (1,))
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        # the kernels' exp is exactly 0 below EXP_FLUSH_BELOW (-87.34: e^x is
        # below float32's smallest normal there): flush the same weights
        p = np.where(scores - m < _attnx.EXP_FLUSH_BELOW, 0.0, np.exp(scores - m))
        p = np.where(allowed, p, 0.0)
        s = np.sum(p, axis=-1, keepdims=True)
        sink = np.zeros_like(s)
        if sinks is not None:     # exp(sink - m), as the core folds it in (m' = max(m, sink))
            mn = np.maximum(m, sinks)
            p, s = p * np.exp(m - mn), s * np.exp(m - mn)
            sink = np.where(s == 0, 0.0, np.exp(sinks - mn))
        den = s + sink
        w: F64 = np.where(s == 0, 0.0, p / np.where(s == 0, 1.0, den))
        w_sink: F64 = np.where(s == 0, 0.0, sink / np.where(s == 0, 1.0, den))
    return w, w_sink


def _weighted_sum(w: F64, v: F64) -> F64:
    """out[..., i, :] = sum over j with w[..., i, j] != 0 of w[..., i, j] * v[..., j, :].

    Keys with zero weight (masked, padded, or -inf scores) are left out of the
    sum entirely, so an inf or NaN in their values cannot leak into the output
    (0 * inf would be NaN). NaN weights are kept: they propagate.
    """
    if np.isfinite(v).all():
        out: F64 = np.matmul(w, v)
        return out
    B, H, Lq, Lk = w.shape
    out = np.zeros((B, H, Lq, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                sel = w[b, h, i] != 0
                out[b, h, i] = w[b, h, i, sel] @ v[b, h, sel]
    return out


# need_weights=True adds the weights; the options are declared once, in attnx._options
@overload
def reference(query: ArrayInput, key: ArrayInput, value: ArrayInput,
              attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
              is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False,
              *, need_weights: Literal[False] = False, **options: Unpack[Options]) -> F64: ...
@overload
def reference(query: ArrayInput, key: ArrayInput, value: ArrayInput,
              attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
              is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False,
              *, need_weights: Literal[True], **options: Unpack[Options]) -> Tuple[F64, F64]: ...
@overload
def reference(query: ArrayInput, key: ArrayInput, value: ArrayInput,
              attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
              is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False,
              *, need_weights: bool = False,
              **options: Unpack[Options]) -> Union[F64, Tuple[F64, F64]]: ...


def reference(*args: Any, need_weights: bool = False, **kwargs: Any) -> Any:
    """``scaled_dot_product_attention`` computed in float64 with plain NumPy.

    Same arguments, shapes and checks as :func:`attnx.scaled_dot_product_attention`;
    returns float64 arrays. Slow and memory-hungry (it builds every score):
    meant as a test oracle.

    Shapes: query (B..., Hq, Lq, E), key (B..., Hk, Lk, E), value
    (B..., Hk, Lk, Ev) (``layout="blhd"``: (B..., L, H, E); 2-D and 3-D
    inputs as in :func:`attnx.scaled_dot_product_attention`); returns out
    (B..., Hq, Lq, Ev) and, with ``need_weights=True``, weights
    (B..., Hq, Lq, Lk), both float64. Masks: bool, True = may attend, or
    float, added to the scores; ``is_causal``, ``key_lengths`` and
    ``query_lengths`` as there. The inputs may be anything
    :func:`attnx.scaled_dot_product_attention` accepts (PyTorch CPU tensors,
    objects with ``__array__`` or ``__dlpack__``); float16/float32 inputs are
    converted to float64 and everything is computed in float64. A float64
    input or mask holding finite values beyond float32's range raises the
    same ValueError as :func:`attnx.scaled_dot_product_attention` (whose
    float32 arithmetic cannot hold them), so the two never disagree on them.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> q = np.eye(3, dtype=np.float32)
    >>> attnx.reference(q, q, q).dtype
    dtype('float64')
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 8), dtype=np.float32) for _ in range(3))
    >>> out, w = attnx.reference(q, k, v, is_causal=True, need_weights=True)
    >>> out.shape, w.shape, bool(np.allclose(w.sum(-1), 1.0))
    ((1, 2, 5, 8), (1, 2, 5, 5), True)
    >>> bool(np.allclose(attnx.scaled_dot_product_attention(q, k, v, is_causal=True), out,
    ...                  atol=1e-5, rtol=5e-6))
    True
    """
    need_weights = check_flag(need_weights, "need_weights")
    # the arguments' names, order and defaults are attention_args's (the overloads above
    # give them to type checkers, the options from attnx._options)
    p = attention_args(*args, **kwargs).astype(np.float64)
    q, k, v, mask = p.folded()
    o, w, _, _ = _forward64(q, k, v, mask, CAUSAL_ARG[p.causal], p.scale, p.key_lengths,
                            p.query_lengths, p.variants)
    out = np.empty(p.caller_shape(p.out_shape))
    p.core_view(out)[...] = o.reshape(p.out_shape)
    return p.results(out, w.reshape(p.scores_shape) if need_weights else None)


def reference_attention_backward(dout: ArrayInput, q: ArrayInput, k: ArrayInput, v: ArrayInput,
                                 attn_mask: Optional[ArrayInput] = None, is_causal: Causal = False,
                                 scale: Optional[float] = None,
                                 key_lengths: Optional[ArrayLike] = None,
                                 query_lengths: Optional[ArrayLike] = None,
                                 variants: Variants = NO_VARIANTS,
                                 ) -> Tuple[F64, F64, F64, F64, F64]:
    """Float64 gradients of :func:`reference_attention` for an upstream gradient
    ``dout`` (B, Hq, Lq, Ev), on the same already-normalised 4-D arrays.

    With P the weights and O the output of the forward:
    dV = Pᵀ dO (summed over each GQA group), dP = dO Vᵀ, D = rowsum(dO ∘ O),
    dS = P ∘ (dP − D) (exactly 0 where P is 0), dQ = scale · dS K,
    dK = scale · dSᵀ Q (summed over each group), d(scores) = dS.

    With a softcap c, dS is multiplied by 1 - tanh(s/c)² before dQ and dK;
    with sinks, d sink = -sum_i P_sink,i · D_i.

    Returns (dq (B, Hq, Lq, E), dk (B, Hk, Lk, E), dv (B, Hk, Lk, Ev),
    dscores (B, Hq, Lq, Lk), dsinks (B, Hq)), float64: dscores is the gradient
    of a float mask before any reduction over its broadcast axes.
    """
    qq, kk, vv, do = (_float64(a, name)
                      for a, name in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout")))
    B, Hq, Lq, E = qq.shape
    Hk = kk.shape[1]
    group = Hq // Hk if Hk else 1
    if scale is None:
        scale = default_scale(E)
    out, p, p_sink, t = _forward64(qq, kk, vv, attn_mask, is_causal, scale, key_lengths,
                                   query_lengths, variants)
    kr, vr = np.repeat(kk, group, axis=1), np.repeat(vv, group, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        dv = np.matmul(np.swapaxes(p, -1, -2), do)
        dp = np.matmul(do, np.swapaxes(vr, -1, -2))
        d = np.sum(do * out, axis=-1, keepdims=True)
        ds = np.where(p == 0, 0.0, p * (dp - d))
        ds_raw = ds if t is None else ds * (1.0 - t * t)      # through the softcap's tanh
        dq = scale * np.matmul(ds_raw, kr)
        dk = scale * np.matmul(np.swapaxes(ds_raw, -1, -2), qq)
        dsink = -np.sum(p_sink * d, axis=(-2, -1))             # (B, Hq)
    dk = dk.reshape((B, Hk, group) + dk.shape[2:]).sum(axis=2)
    dv = dv.reshape((B, Hk, group) + dv.shape[2:]).sum(axis=2)
    return dq, dk, dv, ds, dsink
