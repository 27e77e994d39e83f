"""``scaled_dot_product_attention``: argument normalisation around the C core.

Everything here is cheap NumPy bookkeeping on views: dtype conversion (only
when needed), layout and batch-dimension reshapes, mask broadcasting as
strides, lengths checks. The arithmetic runs in ``attnx._attnx`` (C).
"""

from __future__ import annotations

import collections
import math
import numbers

import numpy as np

from . import _attnx

__all__ = ["scaled_dot_product_attention"]

_FLOAT_KINDS = (np.float16, np.float32, np.float64)
_CAUSAL = {False: 0, True: 1, "upper_left": 1, "top_left": 1, "lower_right": 2}


def _shape(a):
    return "(" + ", ".join(str(n) for n in a.shape) + ("," if a.ndim == 1 else "") + ")"


def _as_float(x, name, dtype=np.float32):
    """x as an ndarray of ``dtype``; float16/32/64 are converted, other kinds raise."""
    try:
        a = np.asarray(x)
    except Exception as exc:  # e.g. a ragged list
        raise TypeError(f"{name} must be array-like of floats; got {type(x).__name__}: {exc}") from None
    if a.dtype.type not in _FLOAT_KINDS:
        raise TypeError(
            f"{name} must be float16, float32 or float64 (computed in float32); "
            f"got dtype {a.dtype} with shape {_shape(a)}")
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a


def _unit_last_stride(a):
    """A view of ``a`` whose last axis is contiguous and aligned (copies only if not)."""
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    if not a.flags.aligned:
        return a.copy()
    return a


def _lengths(x, name, batch_shape, limit, B, H, heads_are_batch):
    """Lengths as an int64 (B, H) array (a broadcast view), checked in [0, limit]."""
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array; got dtype {a.dtype} with shape {_shape(a)}")
    target = batch_shape
    try:
        a = np.broadcast_to(a, target)
    except ValueError:
        raise ValueError(
            f"{name} with shape {_shape(a)} does not broadcast to the batch shape "
            f"{tuple(target)}") from None
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} must lie in [0, {limit}]; got values from {a.min()} to {a.max()}")
    a = np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
    if heads_are_batch:           # no head axis: one length per leading row
        return a.reshape(B, H)
    return np.broadcast_to(a.reshape(B, 1), (B, H))


# The arguments as the core takes them: (B, H, L, E) views and flags.
_Prepared = collections.namedtuple("_Prepared", (
    "q", "k", "v", "mask", "key_lengths", "query_lengths", "causal", "scale",
    "batch_shape", "layout", "ndim"))


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
             layout, key_lengths, query_lengths, dtype):
    """Check and normalise the public arguments (see scaled_dot_product_attention)."""
    q = _as_float(query, "query", dtype)
    k = _as_float(key, "key", dtype)
    v = _as_float(value, "value", dtype)

    if layout not in ("bhld", "blhd"):
        raise ValueError(f'layout must be "bhld" or "blhd"; got {layout!r}')
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions; got "
            f"query {_shape(q)}, key {_shape(k)}, value {_shape(v)}")
    nd = q.ndim
    if nd < 2:
        raise ValueError(f"query, key and value must be at least 2-D (L, E); got query {_shape(q)}")
    if layout == "blhd":
        if nd < 3:
            raise ValueError(f'layout="blhd" needs (B..., L, H, E) inputs, at least 3-D; got query {_shape(q)}')
        q, k, v = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    if nd == 2:
        q, k, v = q[None], k[None], v[None]

    # q: (lead..., Hq, Lq, E)  k: (lead..., Hk, Lk, E)  v: (lead..., Hk, Lk, Ev)
    Hq, Lq, E = q.shape[-3:]
    Hk, Lk, Ek = k.shape[-3:]
    Hv, Lv, Ev = v.shape[-3:]
    batch_shape = q.shape[:-3]

    def shapes():
        return f"query {_shape(np.asarray(query))}, key {_shape(np.asarray(key))}, value {_shape(np.asarray(value))}"

    if k.shape[:-3] != batch_shape or v.shape[:-3] != batch_shape:
        raise ValueError(f"query, key and value must have the same batch dimensions; got {shapes()}")
    if Ek != E:
        raise ValueError(f"query and key must have the same last dimension E; got {shapes()}")
    if Lv != Lk or Hv != Hk:
        raise ValueError(f"key and value must have the same heads and length; got {shapes()}")
    if Hq != Hk:
        if not enable_gqa:
            raise ValueError(
                f"query has {Hq} heads but key/value have {Hk}; pass enable_gqa=True for "
                f"grouped-query attention; got {shapes()}")
        if Hk == 0 or Hq % Hk:
            raise ValueError(
                f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads ({Hk}); got {shapes()}")

    if dropout_p != 0.0 or not isinstance(dropout_p, (float, int, np.floating, np.integer)):
        raise ValueError(f"dropout_p must be 0.0 (attnx computes inference attention); got {dropout_p!r}")
    if isinstance(is_causal, (bool, np.bool_)):
        causal = _CAUSAL[bool(is_causal)]
    elif isinstance(is_causal, str) and is_causal in _CAUSAL:
        causal = _CAUSAL[is_causal]
    else:
        raise ValueError(f'is_causal must be False, True, "upper_left" or "lower_right"; got {is_causal!r}')
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    else:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite; got {scale}")

    B = math.prod(batch_shape)
    q4 = _unit_last_stride(q.reshape((B, Hq, Lq, E)))
    k4 = _unit_last_stride(k.reshape((B, Hk, Lk, E)))
    v4 = _unit_last_stride(v.reshape((B, Hk, Lk, Ev)))
    full = batch_shape + (Hq, Lq, Lk)

    mask4 = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype != np.bool_:
            if m.dtype.type not in _FLOAT_KINDS:
                raise TypeError(
                    f"attn_mask must be bool (True = attend) or float (added to the scores); got dtype "
                    f"{m.dtype} with shape {_shape(m)}. For a 0/1 integer mask pass mask.astype(bool) "
                    f"if 1 means attend, or mask == 0 if 1 means blocked")
            if m.dtype != dtype:
                m = m.astype(dtype)
        if m.ndim > len(full):
            raise ValueError(f"attn_mask with shape {_shape(m)} has more dimensions than the scores {full}")
        try:
            m = np.broadcast_to(m, full)
        except ValueError:
            raise ValueError(
                f"attn_mask with shape {_shape(np.asarray(attn_mask))} does not broadcast to the "
                f"scores' shape (B..., Hq, Lq, Lk) = {full}") from None
        if not m.flags.aligned:
            m = m.copy()
        mask4 = m.reshape((B, Hq, Lq, Lk))

    heads_are_batch = nd == 3 and layout == "bhld"
    lead = (Hq,) if heads_are_batch else batch_shape
    kl = ql = None
    if key_lengths is not None:
        kl = _lengths(key_lengths, "key_lengths", lead, Lk, B, Hq, heads_are_batch)
    if query_lengths is not None:
        ql = _lengths(query_lengths, "query_lengths", lead, Lq, B, Hq, heads_are_batch)

    return _Prepared(q4, k4, v4, mask4, kl, ql, causal, scale, batch_shape, layout, nd)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 layout="bhld", key_lengths=None, query_lengths=None,
                                 need_weights=False):
    """Masked multi-head scaled dot-product attention, ``softmax(Q Kᵀ · scale + mask) V``.

    Names and argument order follow ``torch.nn.functional.scaled_dot_product_attention``,
    so code ports by changing the import. Computed in float32 by the C core.

    Parameters
    ----------
    query : array_like, (B..., Hq, Lq, E)
        With ``layout="blhd"``: (B..., Lq, Hq, E). 2-D (Lq, E) and 3-D (N, Lq, E)
        inputs work as in the tutorials: no head axis is needed.
    key : array_like, (B..., Hk, Lk, E)   (``"blhd"``: (B..., Lk, Hk, E))
    value : array_like, (B..., Hk, Lk, Ev)   (``"blhd"``: (B..., Lk, Hk, Ev))
    attn_mask : array_like, optional
        bool: True = may attend (PyTorch SDPA convention). float: added to the
        scores (use -inf to block). Broadcastable to (B..., Hq, Lq, Lk); a
        broadcast mask is read through strides, never expanded.
    dropout_p : float
        Must be 0.0: attnx computes inference attention.
    is_causal : bool or str
        True or "upper_left": query i sees keys j <= i (PyTorch). "lower_right":
        query i sees keys j <= i + Lk - Lq (the last query sees every key, as
        when decoding with a KV cache). Combined with ``attn_mask`` and the
        lengths by AND.
    scale : float, optional
        Defaults to 1/sqrt(E). Must be finite.
    enable_gqa : bool
        Allow Hq to be a multiple of Hk (grouped-query attention): query head h
        uses key/value head h // (Hq // Hk).
    layout : {"bhld", "blhd"}
        Axis order of query, key, value and the output.
    key_lengths, query_lengths : array_like of int, optional
        Shape (B...) (for 3-D inputs, (N,)). Keys at positions >= key_lengths
        are ignored; query rows at positions >= query_lengths give zeros. This
        is the padding mask without building it.
    need_weights : bool
        Also return the attention weights, (B..., Hq, Lq, Lk), float32.

    Returns
    -------
    out : ndarray, float32, (B..., Hq, Lq, Ev)   (``"blhd"``: (B..., Lq, Hq, Ev))
    weights : ndarray, float32, (B..., Hq, Lq, Lk); only when ``need_weights``.

    A row with no allowed key gives zeros (output and weights), never NaN;
    NaN and inf in the inputs propagate. The inputs are never modified.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 16), dtype=np.float32) for _ in range(3))
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 10, 16)
    """
    p = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 layout, key_lengths, query_lengths, np.float32)
    out, out4, weights, w4 = _allocate(p, need_weights, np.float32)
    _attnx.forward(p.q, p.k, p.v, out4, w4, p.mask, p.key_lengths, p.query_lengths,
                   p.causal, p.scale)
    return _finish(p, out, weights, need_weights)


def _allocate(p, need_weights, dtype):
    """Outputs in the caller's layout, and their (B, H, L, .) views for the core."""
    B, Hq, Lq, _ = p.q.shape
    Lk, Ev = p.k.shape[2], p.v.shape[3]
    if p.layout == "blhd":
        out = np.empty(p.batch_shape + (Lq, Hq, Ev), dtype=dtype)
        out4 = np.swapaxes(out, -2, -3).reshape((B, Hq, Lq, Ev))
    else:
        out = np.empty(p.batch_shape + (Hq, Lq, Ev), dtype=dtype)
        out4 = out.reshape((B, Hq, Lq, Ev))
    if not need_weights:
        return out, out4, None, None
    weights = np.empty(p.batch_shape + (Hq, Lq, Lk), dtype=dtype)
    return out, out4, weights, weights.reshape((B, Hq, Lq, Lk))


def _finish(p, out, weights, need_weights):
    if p.ndim == 2:  # no head axis was given: drop the one added
        out = out[0]
        weights = weights[0] if need_weights else None
    return (out, weights) if need_weights else out
