"""What each task of ``attnx.dask``'s graph computes, on NumPy blocks.

``_block`` is attention of one block of queries against one block of keys
(``(out, lse)``), with causal, window and ALiBi measured from the whole
problem's diagonal: passed on to attnx where the block's diagonal is attnx's
own, else split by rows (``_causal_rows``) or given as an explicit mask
(``_position_mask``). ``_merge`` joins two key blocks' results (one level of
the merge tree), ``_finish`` gives the output block.

No dask here: the tasks need NumPy and attnx only. The graph that calls them
is built in ``attnx._dask_graph``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

from ._grad import merge_attention as _merge_numpy


def _block(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], mask: Optional[NDArray[Any]], *,
           q0: int, k0: int, kl: Optional[NDArray[Any]], ql: Optional[NDArray[Any]],
           sinks: Optional[NDArray[Any]], alibi: Optional[NDArray[Any]],
           st: Dict[str, Any]) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Attention of one block of queries (rows q0 ... q0+lq-1 of the whole query
    axis) against one block of keys (columns k0 ... k0+lk-1): ``(out, lse)``
    with out (batch..., h, lq, Ev) and lse (batch..., h, lq), core layout.

    ``kl``/``ql``/``sinks``/``alibi``: the (batch..., h) values of this block's
    rows (None when not given); the lengths are shifted here by k0/q0. The
    diagonal of the whole problem is j = i + off; in this block it is
    jj = ii + D with D = q0 + off - k0. Where D is attnx's own upper-left (0) or
    lower-right (lk - lq) diagonal, causal/window/ALiBi are passed on as
    they are; otherwise causal alone is split by rows (``_causal_rows``, no
    mask), and a window or ALiBi becomes an explicit (lq, lk) mask (a float
    mask holding the ALiBi bias when slopes are given)."""
    lq, lk = q.shape[-2], k.shape[-2]
    heads_are_batch = st["heads_are_batch"]
    causal, window = st["causal"], st["window"]
    D = q0 + st["off"] - k0
    kw: Dict[str, Any] = {"scale": st["scale"], "softcap": st["softcap"],
                          "precision": st["precision"], "enable_gqa": st["enable_gqa"]}
    if kl is not None:
        kl = np.clip(kl - k0, 0, lk)
    if ql is not None:
        ql = np.clip(ql - q0, 0, lq)
    if not heads_are_batch:          # lengths are per sequence: one value per batch index
        kl = None if kl is None else kl[..., 0]
        ql = None if ql is None else ql[..., 0]
    kw.update(key_lengths=kl, query_lengths=ql, sinks=sinks)
    positional = causal or window is not None or alibi is not None
    row_shift: Optional[NDArray[np.float64]] = None     # added to lse afterwards (ALiBi)
    if positional and lq and lk and (D == 0 or D == lk - lq):
        name = "upper_left" if D == 0 else "lower_right"
        kw["is_causal"] = name if causal else False
        if window is not None or alibi is not None:
            kw.update(window=window, alibi_slopes=alibi, alignment=name)
    elif causal and window is None and alibi is None and lq and lk:
        return _causal_rows(q, k, v, mask, kw, D, st["lead1"])
    elif positional and lq and lk:
        mask, row_shift = _position_mask(mask, lq, lk, D, causal, window, alibi)
    out, lse = _call(q, k, v, mask, kw, st["lead1"])
    if row_shift is not None:
        with np.errstate(invalid="ignore"):
            lse = np.where(np.isneginf(lse), lse, lse + row_shift).astype(np.float32)
    return out, lse


def _call(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], mask: Optional[NDArray[Any]],
          kw: Dict[str, Any], lead1: bool) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """attnx on one block; ``lead1``: the block is 3-D (L, H, E) blhd or 2-D
    in the core view (H, L, E), which gets a batch axis of 1 for the call."""
    if lead1:
        q, k, v = q[None], k[None], v[None]
        mask = None if mask is None else mask[None]
    out, lse = _sdpa_numpy_call(q, k, v, mask, kw)
    return (out[0], lse[0]) if lead1 else (out, lse)


def _causal_rows(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], mask: Optional[NDArray[Any]],
                 kw: Dict[str, Any], D: int, lead1: bool,
                 ) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """A causal block whose diagonal jj = ii + D is neither corner, without a
    mask: rows ii < -D see no key (zeros, lse -inf); rows whose diagonal ends
    inside the block (ii + D < lk - 1), [n0, n1), see keys 0 ... n1 + D - 1
    with the lower-right diagonal of that slice, which is the block's own
    (jj = ii + D); the rows after see every key of the block. At most two
    attnx calls on views of the block; their rows are concatenated."""
    lq, lk = q.shape[-2], k.shape[-2]
    n0 = min(max(-D, 0), lq)
    n1 = min(max(lk - 1 - D, n0), lq)
    outs: List[NDArray[np.float32]] = []
    lses: List[NDArray[np.float32]] = []
    if n0:
        outs.append(np.zeros(q.shape[:-2] + (n0, v.shape[-1]), np.float32))
        lses.append(np.full(q.shape[:-2] + (n0,), -np.inf, np.float32))
    for a, b, n, causal in ((n0, n1, n1 + D, "lower_right"), (n1, lq, lk, False)):
        if b <= a:
            continue
        sub = dict(kw, is_causal=causal)
        if kw.get("query_lengths") is not None:
            sub["query_lengths"] = np.clip(kw["query_lengths"] - a, 0, b - a)
        if kw.get("key_lengths") is not None:
            sub["key_lengths"] = np.minimum(kw["key_lengths"], n)
        m = mask
        if m is not None:      # a broadcast (size-1) row or key axis stays as it is
            m = m[..., slice(a, b) if m.shape[-2] != 1 else slice(None),
                  slice(0, n) if m.shape[-1] != 1 else slice(None)]
        o, lse = _call(q[..., a:b, :], k[..., :n, :], v[..., :n, :], m, sub, lead1)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)


def _position_mask(mask: Optional[NDArray[Any]], lq: int, lk: int, D: int, causal: bool,
                   window: Optional[Tuple[int, int]], alibi: Optional[NDArray[Any]],
                   ) -> Tuple[Optional[NDArray[Any]], Optional[NDArray[np.float64]]]:
    """The mask of a block whose diagonal jj = ii + D is not attnx's own: causal
    and window as a bool (lq, lk) condition (only where the block crosses
    them), ALiBi as a float mask. Returns the mask to pass (``mask``, the
    user's block, folded in) and, for ALiBi, the per-row shift of the lse.

    ALiBi in a block on one side of the diagonal (rel = ii + D - jj of one
    sign) splits into a row term and a key term, -slope·|rel| = row(ii) +
    key(jj): the key term is a (h, 1, lk) float mask, the row term cancels in
    the softmax and is added to the lse afterwards. Only a block crossing the
    diagonal needs the full (h, lq, lk) bias."""
    ii = np.arange(lq, dtype=np.int64)[:, None] + D          # d(i), block coordinates
    jj = np.arange(lk, dtype=np.int64)[None, :]
    rel_min, rel_max = D - (lk - 1), lq - 1 + D               # of rel = d(i) - j
    conds = []
    if causal and rel_min < 0:
        conds.append(ii >= jj)
    if window is not None:
        left, right = window
        if left >= 0 and rel_max > left:
            conds.append(ii - jj <= left)
        if right >= 0 and -rel_min > right:
            conds.append(jj - ii <= right)
    allowed: Optional[NDArray[np.bool_]] = None
    for c in conds:
        allowed = c if allowed is None else (allowed & c)
    row_shift = None
    if alibi is None:
        if allowed is None:
            return mask, None
        if mask is None or mask.dtype == np.bool_:
            return (allowed if mask is None else mask & allowed), None
        return np.where(allowed, mask.astype(np.float32), np.float32(-np.inf)), None
    slope = np.asarray(alibi, np.float64)[..., None, None]    # (batch..., h, 1, 1)
    if rel_min >= 0:       # keys left of the diagonal: -slope (d(i) - j)
        key_term = slope * (jj - (lk - 1))
        row_shift = (-slope * (ii - (lk - 1)))[..., 0]
    elif rel_max <= 0:     # keys right of it: -slope (j - d(i))
        key_term = -slope * jj
        row_shift = (slope * ii)[..., 0]
    else:
        key_term = -slope * np.abs(ii - jj)
    bias = key_term.astype(np.float32)
    if mask is not None and mask.dtype != np.bool_:
        bias = bias + mask.astype(np.float32)
    elif mask is not None:
        allowed = mask if allowed is None else (allowed & mask)
    if allowed is not None:
        bias = np.where(allowed, bias, np.float32(-np.inf))
    return bias, row_shift


def _sdpa_numpy_call(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], mask: Optional[NDArray[Any]],
                     kw: Dict[str, Any]) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """``attnx.scaled_dot_product_attention(..., return_lse=True)``, looked up at
    call time (so that a test can count the calls)."""
    import attnx
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True, **kw)
    return out, lse


def _merge(a: Tuple[NDArray[Any], NDArray[Any]],
           b: Tuple[NDArray[Any], NDArray[Any]]) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Attention over the union of two disjoint key sets (one level of the tree)."""
    return _merge_numpy([a[0], b[0]], [a[1], b[1]])


def _finish(res: Optional[Tuple[NDArray[Any], NDArray[Any]]], *, sinks: Optional[NDArray[Any]],
            shape: Tuple[int, ...]) -> NDArray[np.float32]:
    """The output block from the merged ``(out, lse)`` (zeros of ``shape`` when
    no key block was scheduled). ``sinks`` (batch..., h): the sink logits, when
    the keys were split: the blocks were computed without them, and
    ``merge_attention(..., sinks=)`` joins them to each row's softmax
    denominator once; a row with no allowed key (lse = -inf) stays zero."""
    if res is None:
        return np.zeros(shape, np.float32)
    out, lse = res
    if sinks is not None:
        out = _merge_numpy([out], [lse], sinks=sinks)[0]
    return np.asarray(out, np.float32)
