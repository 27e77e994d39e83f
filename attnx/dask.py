"""``attnx.dask``: attnx's attention on dask arrays, split into blocks.

``attnx.dask.scaled_dot_product_attention`` takes the arguments of
:func:`attnx.scaled_dot_product_attention` with ``query``, ``key``, ``value``
(and ``attn_mask``) as dask arrays (NumPy arrays are wrapped with
``da.asarray``) and returns a lazy float32 dask array holding the same numbers.
Each task calls :func:`attnx.scaled_dot_product_attention` on one block, so a
sequence longer than one machine's memory is computed piece by piece:

* chunks of the batch and head axes are independent problems;
* chunks of the query axis are independent;
* chunks of the key axis are attended separately (``return_lse=True``) and
  combined exactly with :func:`attnx.merge_attention`, pairwise in a tree.

dask is imported here only (``import attnx`` never imports it).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import NDArray

import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _attnx
from ._args import Alignment, AttentionArgs, Causal, Layout, Window, attention_args
from ._functional import scaled_dot_product_attention as _sdpa_numpy
from ._grad import merge_attention as _merge_numpy

__all__ = ["scaled_dot_product_attention", "bench"]

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_ALIGN_NAME = {int(_attnx.ALIGN_UPPER_LEFT): "upper_left", int(_attnx.ALIGN_LOWER_RIGHT): "lower_right"}

#: The names of the block tasks in the graph: ("attnx-block-<token>", batch..., head, q, k).
BLOCK_PREFIX = "attnx-block-"


def _meta(x: Any, float_meta: bool = True) -> NDArray[Any]:
    """A zero-stride stand-in of ``x``'s shape for attnx's argument checks (no
    memory, nothing computed). Float inputs stand in as float32 (whose range
    check is a no-op); other dtypes as themselves, so that attnx names the
    argument and its dtype in its TypeError."""
    dtype = np.dtype(x.dtype)
    if float_meta and dtype in _FLOATS:
        dtype = np.dtype(np.float32)
    return np.broadcast_to(np.zeros((), dtype), tuple(int(n) for n in x.shape))


def _small(x: Any) -> Any:
    """A per-sequence or per-head argument (lengths, sinks, slopes) as a NumPy
    value: they are tiny, so a dask array there is computed now."""
    if x is None:
        return None
    if isinstance(x, da.Array):
        return np.asarray(x.compute())
    return x


def _starts(chunks: Sequence[int]) -> List[int]:
    """The start offset of each chunk."""
    return [0] + list(np.cumsum(chunks[:-1], dtype=np.int64).tolist()) if chunks else []


def _group_chunks(chunks: Tuple[int, ...], group: int) -> Tuple[int, ...]:
    """Head chunks of the query whose every boundary is a multiple of ``group``
    (the query heads sharing one key/value head stay in one chunk)."""
    if group == 1:
        return chunks
    bounds = [b for b in np.cumsum(chunks).tolist() if b % group == 0]
    out, prev = [], 0
    for b in bounds:
        if b > prev:
            out.append(b - prev)
            prev = b
    return tuple(out) or chunks


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
                          "enable_gqa": st["enable_gqa"]}
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


# ------------------------------------------------ the graph of one call, in steps

#: A task key: (name, index...).
_Key = Tuple[Any, ...]
#: The per-(batch..., Hq) row values (key_lengths, query_lengths, sinks, alibi), None when not given.
_Rows = Tuple[Optional[NDArray[Any]], ...]


class _Split(NamedTuple):
    """The core-view dask inputs rechunked for the blocks, and how they are cut."""
    q: Any                                  # (batch..., Hq, Lq, E), E in one chunk
    k: Any                                  # (batch..., Hk, Lk, E), head chunks = q's / group
    v: Any                                  # (batch..., Hk, Lk, Ev), chunked like k
    mask: Optional[Any]                     # (batch..., Hq, Lq, Lk) with size-1 axes, or None
    mask_bcast: Optional[List[bool]]        # per mask axis: broadcast (one chunk of size 1)
    row_chunks: Tuple[Tuple[int, ...], ...]  # chunks of (batch..., Hq), shared by q and the output
    group: int                              # query heads per key/value head


def _as_dask(x: Any, name: str) -> Any:
    """``x`` as a dask array (a NumPy array wrapped with ``da.asarray``) whose
    chunk sizes are known (boolean indexing leaves them NaN: the graph needs them)."""
    a = x if isinstance(x, da.Array) else da.asarray(x)
    if any(math.isnan(n) for n in a.shape):
        raise ValueError(f"{name} has unknown chunk sizes (shape {a.shape}, e.g. after boolean "
                         f"indexing): pass {name}.compute_chunk_sizes()")
    return a


def _checked(query: Any, key: Any, value: Any, attn_mask: Optional[Any], dropout_p: float,
             is_causal: Causal, scale: Optional[float], enable_gqa: bool, layout: Layout,
             key_lengths: Optional[Any], query_lengths: Optional[Any], window: Window,
             sinks: Optional[Any], softcap: Optional[float], alibi_slopes: Optional[Any],
             alignment: Alignment) -> Tuple[Any, Any, Any, Optional[Any], AttentionArgs]:
    """The arrays as dask arrays and every argument checked by attnx, on
    zero-stride stand-ins of the arrays (nothing read): ``(q, k, v, mask,
    args)``, the arrays as passed (layout and ndim unchanged). The small
    per-sequence / per-head values are computed here (``_small``)."""
    qd, kd, vd = (_as_dask(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    md = None if attn_mask is None else _as_dask(attn_mask, "attn_mask")
    key_lengths, query_lengths = _small(key_lengths), _small(query_lengths)
    sinks, alibi_slopes = _small(sinks), _small(alibi_slopes)
    p = attention_args(_meta(qd), _meta(kd), _meta(vd),
                       None if md is None else _meta(md), dropout_p, is_causal, scale, enable_gqa,
                       layout=layout, key_lengths=key_lengths, query_lengths=query_lengths,
                       window=window, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                       alignment=alignment)
    return qd, kd, vd, md, p


def _core_view(qd: Any, kd: Any, vd: Any, layout: Layout) -> Tuple[Any, Any, Any]:
    """q, k, v in the core view (batch..., H, L, E), as attnx's AttentionArgs:
    ``"blhd"`` swaps L and H; a 2-D (L, E) input gets a head axis of 1."""
    if layout == "blhd":
        qd, kd, vd = (da.swapaxes(a, -2, -3) for a in (qd, kd, vd))
    if qd.ndim == 2:
        qd, kd, vd = qd[None], kd[None], vd[None]
    return qd, kd, vd


def _rechunked(qd: Any, kd: Any, vd: Any, md: Optional[Any],
               scores_shape: Tuple[int, ...]) -> _Split:
    """The core-view inputs rechunked so that every (batch, head, query, key)
    chunk is one block: E and Ev in one chunk; key/value on query's batch
    chunks and on query's head chunks / group (grouped-query attention: the
    query's head chunks merged until every boundary is a multiple of group);
    value on key's key chunks; the mask (padded to the scores' ndim) like
    the scores, its broadcast (size-1) axes left as one chunk."""
    nd = qd.ndim
    Hq, Hk, Ev = qd.shape[-3], kd.shape[-3], vd.shape[-1]
    group = Hq // Hk if Hk and Hq != Hk else 1
    batch_chunks = qd.chunks[:nd - 3]
    qh = _group_chunks(qd.chunks[-3], group)
    kh = tuple(c // group for c in qh)
    qd = qd.rechunk(batch_chunks + (qh, qd.chunks[-2], (qd.shape[-1],)))
    kd = kd.rechunk(batch_chunks + (kh, kd.chunks[-2], (kd.shape[-1],)))
    vd = vd.rechunk(batch_chunks + (kh, kd.chunks[-2], (Ev,)))
    mask_bcast = None
    if md is not None:
        if md.ndim < nd:
            md = md[(None,) * (nd - md.ndim)]
        mask_bcast = [md.shape[d] == 1 and scores_shape[d] != 1 for d in range(nd)]
        target = batch_chunks + (qh, qd.chunks[-2], kd.chunks[-2])     # the scores' chunks
        md = md.rechunk(tuple((1,) if mask_bcast[d] else target[d] for d in range(nd)))
    return _Split(qd, kd, vd, md, mask_bcast, batch_chunks + (qh,), group)


def _row_values(p: AttentionArgs, rows_shape: Tuple[int, ...]) -> _Rows:
    """key_lengths, query_lengths, sinks and ALiBi slopes, each as a
    (batch..., Hq) array (None when not given), to be cut like the rows."""
    def rows(a: Optional[NDArray[Any]]) -> Optional[NDArray[Any]]:
        return None if a is None else np.ascontiguousarray(a).reshape(rows_shape)
    return (rows(p.key_lengths), rows(p.query_lengths),
            rows(p.variants.sinks), rows(p.variants.alibi))


def _shared_args(p: AttentionArgs, softcap: Optional[float], group: int, heads_are_batch: bool,
                 nd: int, Lq: int, Lk: int) -> Dict[str, Any]:
    """The scalar arguments every block task shares (``_block``'s ``st``);
    ``off``: the whole problem's diagonal is j = i + off."""
    va = p.variants
    off = Lk - Lq if (p.causal == _attnx.CAUSAL_LOWER_RIGHT
                      or (p.causal == _attnx.CAUSAL_NONE and va.align == _attnx.ALIGN_LOWER_RIGHT)) else 0
    causal = p.causal != _attnx.CAUSAL_NONE
    st: Dict[str, Any] = dict(
        scale=p.scale, softcap=softcap, enable_gqa=group != 1, causal=causal, window=va.window,
        off=off, heads_are_batch=heads_are_batch, lead1=not heads_are_batch and nd == 3)
    return st


def _band_sides(causal: bool, window: Optional[Tuple[int, int]]) -> Tuple[Optional[int], Optional[int]]:
    """How far left (``lo``) and right (``hi``) of the diagonal a row may see
    keys (None: unbounded): the window's sides, and causal's 0 on the right."""
    lo_side = window[0] if window is not None and window[0] >= 0 else None
    hi_sides = ([0] if causal else []) + (
        [window[1]] if window is not None and window[1] >= 0 else [])
    hi_side = min(hi_sides) if hi_sides else None
    return lo_side, hi_side


def _attended(q0: int, lq: int, k0: int, lk: int, off: int,
              lo_side: Optional[int], hi_side: Optional[int]) -> bool:
    """Whether a row of query chunk [q0, q0+lq) may see a key of key chunk
    [k0, k0+lk): both non-empty, and the key chunk not wholly right of the
    diagonal/band (row i's last key: i + off + hi) nor wholly left of the
    band (row i's first key: i + off - lo)."""
    if lq == 0 or lk == 0:
        return False
    if hi_side is not None and k0 > q0 + lq - 1 + off + hi_side:
        return False                          # wholly above the diagonal / band
    if lo_side is not None and k0 + lk - 1 < q0 + off - lo_side:
        return False                          # wholly left of the band
    return True


def _block_task(s: _Split, bname: str, bidx: Tuple[int, ...], iq: int, ik: int, q0: int, k0: int,
                rows_b: _Rows, st: Dict[str, Any], late_sinks: bool) -> Tuple[_Key, Any]:
    """The key and task of block (bidx..., iq, ik): ``_block`` on that chunk
    of q, k, v and the mask (index 0 on the mask's broadcast axes), with the
    block's row values ``rows_b`` (sinks left out when they join late)."""
    kl_b, ql_b, sinks_b, alibi_b = rows_b
    qkey = (s.q.name,) + bidx + (iq, 0)
    kkey = (s.k.name,) + bidx + (ik, 0)   # k/v head chunks = q's / group
    vkey = (s.v.name,) + bidx + (ik, 0)
    mkey = None
    if s.mask is not None and s.mask_bcast is not None:
        idx = bidx + (iq, ik)
        mkey = (s.mask.name,) + tuple(0 if b else i for b, i in zip(s.mask_bcast, idx))
    fn = functools.partial(_block, q0=q0, k0=k0, kl=kl_b, ql=ql_b,
                           sinks=None if late_sinks else sinks_b,
                           alibi=alibi_b, st=st)
    return (bname,) + bidx + (iq, ik), (fn, qkey, kkey, vkey, mkey)


def _merge_tree(dsk: Dict[Any, Any], parts: List[_Key], prefix: _Key) -> Optional[_Key]:
    """Adds to ``dsk`` the pairwise merges of the ``(out, lse)`` tasks
    ``parts`` (then pairs of pairs, ...), keyed ``prefix + (level, j)``, and
    returns the key of the root (None when ``parts`` is empty)."""
    level = 0
    while len(parts) > 1:             # merge pairwise, then pairs of pairs
        nxt = []
        for j in range(0, len(parts) - 1, 2):
            mk = prefix + (level, j // 2)
            dsk[mk] = (_merge, parts[j], parts[j + 1])
            nxt.append(mk)
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts, level = nxt, level + 1
    return parts[0] if parts else None


def _graph(s: _Split, rows: _Rows, st: Dict[str, Any], late_sinks: bool,
           Lq: int, Lk: int) -> Tuple[Dict[Any, Any], str]:
    """The tasks of the output and the output's name: for every (batch...,
    head) chunk and query chunk, a block task per key chunk it attends
    (``_attended``), their merge tree and the ``_finish`` of the output
    block (oname, batch..., head, query chunk, 0)."""
    token = tokenize(s.q.name, s.k.name, s.v.name, None if s.mask is None else s.mask.name,
                     *rows, dict(st), Lq, Lk)
    bname, mname, oname = BLOCK_PREFIX + token, "attnx-merge-" + token, "attnx-sdpa-" + token
    q_chunks, k_chunks = s.q.chunks[-2], s.k.chunks[-2]
    q_starts, k_starts = _starts(q_chunks), _starts(k_chunks)
    lo_side, hi_side = _band_sides(st["causal"], st["window"])
    row_starts = [_starts(c) for c in s.row_chunks]
    Ev = s.v.shape[-1]
    dsk: Dict[Any, Any] = {}
    for bidx in np.ndindex(*(len(c) for c in s.row_chunks)):
        sl = tuple(slice(r[i], r[i] + c[i]) for r, c, i in zip(row_starts, s.row_chunks, bidx))
        rows_b = tuple(None if a is None else a[sl] for a in rows)       # the block's rows
        blk_rows = tuple(c[i] for c, i in zip(s.row_chunks, bidx))         # (batch..., h) of the block
        for iq, (q0, lq) in enumerate(zip(q_starts, q_chunks)):
            parts = []
            for ik, (k0, lk) in enumerate(zip(k_starts, k_chunks)):
                if not _attended(q0, lq, k0, lk, st["off"], lo_side, hi_side):
                    continue
                key_, task = _block_task(s, bname, bidx, iq, ik, q0, k0, rows_b, st, late_sinks)
                dsk[key_] = task
                parts.append(key_)
            root = _merge_tree(dsk, parts, (mname,) + bidx + (iq,))
            fin = functools.partial(_finish, sinks=rows_b[2] if late_sinks else None,
                                    shape=blk_rows + (lq, Ev))
            dsk[(oname,) + bidx + (iq, 0)] = (fin, root)
    return dsk, oname


def _assemble(dsk: Dict[Any, Any], oname: str, s: _Split, ndim_in: int, layout: Layout) -> Any:
    """The output dask array of the tasks ``dsk`` (core view (batch..., Hq,
    Lq, Ev), chunked as q's rows and queries), back in the caller's layout
    and ndim."""
    deps = [s.q, s.k, s.v] + ([] if s.mask is None else [s.mask])
    graph = HighLevelGraph.from_collections(oname, dsk, dependencies=deps)
    Ev = s.v.shape[-1]
    out = da.Array(graph, oname, s.row_chunks + (s.q.chunks[-2], (Ev,)), dtype=np.float32,
                   meta=np.empty((0,) * s.q.ndim, np.float32))
    if ndim_in == 2:
        out = out[0]
    if layout == "blhd":
        out = da.swapaxes(out, -2, -3)
    return out


def scaled_dot_product_attention(
        query: Any, key: Any, value: Any, attn_mask: Optional[Any] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, layout: Layout = "bhld", key_lengths: Optional[Any] = None,
        query_lengths: Optional[Any] = None, window: Window = None, sinks: Optional[Any] = None,
        softcap: Optional[float] = None, alibi_slopes: Optional[Any] = None,
        alignment: Alignment = None) -> Any:
    """:func:`attnx.scaled_dot_product_attention` on dask arrays, as a lazy dask array.

    Same arguments and the same numbers (up to float32 rounding of the
    merge) as the NumPy function; see its docstring for the semantics.

    Parameters
    ----------
    query : dask or NumPy array, (B..., Hq, Lq, E)   (``"blhd"``: (B..., Lq, Hq, E))
    key : dask or NumPy array, (B..., Hk, Lk, E)   (``"blhd"``: (B..., Lk, Hk, E))
    value : dask or NumPy array, (B..., Hk, Lk, Ev)   (``"blhd"``: (B..., Lk, Hk, Ev))
        2-D and 3-D inputs as for the NumPy function. NumPy arrays are
        wrapped with ``da.asarray`` (dask's automatic chunks).
    attn_mask : dask or NumPy array, optional
        bool or float, broadcastable to (B..., Hq, Lq, Lk); its broadcast
        (size-1) axes stay size 1, its other axes are rechunked like the
        scores (batch, heads and queries as ``query``, keys as ``key``).
    key_lengths, query_lengths, sinks, alibi_slopes : array_like, optional
        Small per-sequence / per-head values, read when this function is
        called (a dask array here is computed at once).
    dropout_p, is_causal, scale, enable_gqa, layout, window, softcap, alignment
        As for :func:`attnx.scaled_dot_product_attention`.

    Returns
    -------
    out : dask array, float32, (B..., Hq, Lq, Ev)   (``"blhd"``: (B..., Lq, Hq, Ev))
        Chunked like ``query`` along batch, heads and queries, one chunk
        along Ev. Nothing is computed before ``.compute()``.

    How the work is split
    ---------------------
    The head dimensions E and Ev are rechunked to one chunk. ``key`` and
    ``value`` are rechunked to ``query``'s batch chunks; ``value`` to
    ``key``'s chunks along the keys. Heads: with grouped-query attention
    (Hq = g·Hk) the query's head chunks are merged until every boundary is a
    multiple of g, and key/value get the head chunks ``query_chunk / g``, so a
    block's query heads find their key/value heads in one block. Every
    (batch chunk, head chunk, query chunk, key chunk) is one task calling
    ``attnx.scaled_dot_product_attention(..., return_lse=True)``; the key
    blocks of a query block are merged pairwise (a tree) with
    :func:`attnx.merge_attention`, which is exact.

    Blocks that no row may attend to are not in the graph at all: with
    ``is_causal`` (upper-left or lower-right), key chunks wholly above the
    diagonal; with ``window``, key chunks wholly outside the band. A block
    whose diagonal is attnx's own upper-left or lower-right one (e.g. square
    blocks on the diagonal) gets ``is_causal``/``alignment`` as they are; a
    causal block whose diagonal is elsewhere (query and key chunks of
    different sizes, or Lk - Lq not a multiple of the chunk) is split by
    rows into at most two calls on views of it, without a mask; with a
    ``window`` or ALiBi such a block gets the band as an explicit (lq, lk)
    bool mask (combined with ``attn_mask``).

    Every variant is supported with chunked keys and queries: ``softcap`` is
    per score; ``key_lengths``/``query_lengths`` are shifted by the block's
    start and clipped to it; ALiBi needs the distance to the global diagonal,
    so a block whose diagonal is not attnx's own gets ALiBi as a float mask
    (``-slope·|d(i) - j|``, with ``attn_mask`` folded in; memory h·lq·lk per such
    block); ``sinks``: with one key chunk they go to attnx as they are; with
    several, the sink must join each row's denominator exactly once, and a
    row may have no allowed key in any particular block (where attnx ignores
    the sink), so the blocks run without sinks and the merged row is scaled
    by exp(lse)/(exp(lse)+exp(sink)) at the end (a row with no allowed key
    anywhere stays zero, as in attnx).

    Errors are attnx's own (TypeError/ValueError naming the argument),
    raised by this call: the arguments are checked by attnx on zero-stride
    stand-ins of the arrays' shapes, without reading them. Values (NaN, a
    float64 beyond float32's range) are checked by the tasks, at compute.

    Example
    -------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 64, 16), dtype=np.float32) for _ in range(3))
    >>> qd, kd, vd = (da.from_array(a, chunks=(1, 2, 16, 16)) for a in (q, k, v))
    >>> out = attnx.dask.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    >>> out.shape, out.chunks[2]
    ((1, 2, 64, 16), (16, 16, 16, 16))
    >>> bool(np.allclose(out.compute(), attnx.scaled_dot_product_attention(q, k, v, is_causal=True),
    ...                  atol=2e-6))
    True
    """
    qd, kd, vd, md, p = _checked(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa, layout, key_lengths, query_lengths, window, sinks,
                                 softcap, alibi_slopes, alignment)
    ndim_in = qd.ndim
    heads_are_batch = ndim_in == 3 and layout == "bhld"
    s = _rechunked(*_core_view(qd, kd, vd, layout), md, p.scores_shape)
    Lq, Lk = s.q.shape[-2], s.k.shape[-2]
    rows = _row_values(p, s.q.shape[:-2])                  # each (batch..., Hq) or None
    st = _shared_args(p, softcap, s.group, heads_are_batch, s.q.ndim, Lq, Lk)
    # sinks go to attnx with the block when a query block is one task and its lse is
    # attnx's own; otherwise they join the merged rows in _finish
    late_sinks = len(s.k.chunks[-2]) > 1 or rows[3] is not None
    dsk, oname = _graph(s, rows, st, late_sinks, Lq, Lk)
    return _assemble(dsk, oname, s, ndim_in, layout)


# --------------------------------------------------------------------- bench

def bench(L: int, H: int, D: int, chunk: int, n_workers: int = 2,
          repeats: int = 3) -> Dict[str, Union[str, float]]:
    """Causal attention over (1, H, L, D) float32 inputs: a LocalCluster of
    ``n_workers`` processes (one dask thread and one attnx thread each) with
    chunks of ``chunk`` queries and keys, against one process's
    :func:`attnx.scaled_dot_product_attention` on every CPU, on the same
    inputs. The two alternate ``repeats`` times, 0.3 s apart; the medians are
    returned as ``{"case", "dask_s", "numpy_s", "ratio"}`` (ratio = dask_s /
    numpy_s; the dask time includes gathering the result)."""
    from distributed import Client, LocalCluster

    import attnx
    shape, chunks = (1, H, L, D), (1, H, chunk, D)
    rs = da.random.default_rng(0)
    q, k, v = (rs.standard_normal(shape, chunks=chunks, dtype=np.float32) for _ in range(3))
    # distributed puts OMP_NUM_THREADS=1 in this process's environment for its workers,
    # which attnx's default thread count may then read: use every CPU explicitly
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    before = attnx.get_num_threads()
    dask_s, numpy_s = [], []
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.run(attnx.set_num_threads, 1)
        q, k, v = client.persist([q, k, v])
        qn, kn, vn = (np.asarray(a.compute()) for a in (q, k, v))      # inputs in memory
        out_d = scaled_dot_product_attention(q, k, v, is_causal=True)
        attnx.set_num_threads(threads)
        try:
            for _ in range(repeats):
                time.sleep(0.3)
                t = time.perf_counter()
                result = out_d.compute()
                dask_s.append(time.perf_counter() - t)
                time.sleep(0.3)
                t = time.perf_counter()
                expected = _sdpa_numpy(qn, kn, vn, is_causal=True)
                numpy_s.append(time.perf_counter() - t)
        finally:
            attnx.set_num_threads(before)
    err = float(np.abs(result - expected).max())
    d, n = float(np.median(dask_s)), float(np.median(numpy_s))
    case = (f"chunks of {chunk}, {n_workers} workers x 1 thread vs 1 process x {threads} "
            f"threads, max |diff| {err:.1e}")
    return {"case": case, "dask_s": d, "numpy_s": n, "ratio": d / n}
