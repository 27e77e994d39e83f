"""The task graph of one ``attnx.dask`` call, in steps.

The inputs in the core view (``_core_view``), rechunked so that every
(batch, head, query, key) chunk is one block (``_rechunked``); the small
per-row values and the scalar arguments every block shares (``_row_values``,
``_shared_args``); then a block task for every key chunk a query chunk may
attend (``_attended``, and a bool BlockMask's map: ``_kept_blocks``), their
merge tree and the output block's ``_finish`` (``_graph``), assembled into
the output dask array (``_assemble``). The tasks themselves are in
``attnx._dask_blocks``.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import NDArray

import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _attnx
from ._args import AttentionArgs, Layout
from ._dask_blocks import _block, _finish, _merge


#: The names of the block tasks in the graph: ("attnx-block-<token>", batch..., head, q, k).
BLOCK_PREFIX = "attnx-block-"


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


def _shared_args(p: AttentionArgs, softcap: Optional[float], precision: str, group: int,
                 heads_are_batch: bool, nd: int, Lq: int, Lk: int) -> Dict[str, Any]:
    """The scalar arguments every block task shares (``_block``'s ``st``);
    ``off``: the whole problem's diagonal is j = i + off."""
    va = p.variants
    off = Lk - Lq if (p.causal == _attnx.CAUSAL_LOWER_RIGHT
                      or (p.causal == _attnx.CAUSAL_NONE and va.align == _attnx.ALIGN_LOWER_RIGHT)) else 0
    causal = p.causal != _attnx.CAUSAL_NONE
    st: Dict[str, Any] = dict(
        scale=p.scale, softcap=softcap, precision=precision, enable_gqa=group != 1, causal=causal, window=va.window,
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


def _kept_blocks(blocks: Optional[NDArray[np.uint8]], mask_dtype: Optional[np.dtype[Any]],
                 rows_shape: Tuple[int, ...]) -> Optional[NDArray[np.bool_]]:
    """A bool :class:`attnx.BlockMask`'s map as "some entry of the block keeps
    its key", a view broadcast to (batch..., Hq, nq, nk) like the scores' rows
    (nq, nk: its blocks of ``MAP_ROWS`` queries by ``MAP_KEYS`` keys); None
    without a map, and for a float mask: there a key's ``-inf`` added to a NaN
    or inf score is NaN, which reaches the row in attnx (and in each task), so
    no block of a float mask may be left out of the graph."""
    if blocks is None or mask_dtype != np.bool_:
        return None
    keep = (blocks & np.uint8(_attnx.MAP_KEEP)) != 0          # its lead broadcasts as the mask's
    return np.broadcast_to(keep, rows_shape + keep.shape[-2:])


def _map_keeps(keep: NDArray[np.bool_], q0: int, lq: int, k0: int, lk: int) -> bool:
    """Whether the map ``keep`` (nq, nk) of a block's rows keeps some entry of
    query chunk [q0, q0+lq) and key chunk [k0, k0+lk): the OR over the map's
    blocks that overlap the chunks (a map axis of 1 covers every query or key)."""
    nq, nk = keep.shape
    rows, keys = int(_attnx.MAP_ROWS), int(_attnx.MAP_KEYS)
    rq = slice(0, 1) if nq == 1 else slice(q0 // rows, -(-(q0 + lq) // rows))
    rk = slice(0, 1) if nk == 1 else slice(k0 // keys, -(-(k0 + lk) // keys))
    return bool(keep[rq, rk].any())


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
           Lq: int, Lk: int, kept: Optional[NDArray[np.bool_]] = None,
           ) -> Tuple[Dict[Any, Any], str]:
    """The tasks of the output and the output's name: for every (batch...,
    head) chunk and query chunk, a block task per key chunk it attends
    (``_attended``) and, with a bool BlockMask's map ``kept`` ((batch...,
    Hq, nq, nk), ``_kept_blocks``), of which the map keeps some entry for some
    of the block's rows; their merge tree and the ``_finish`` of the output
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
        # the map of the block's rows: kept where any of them keeps
        keep_b = None if kept is None else np.asarray(kept[sl].any(axis=tuple(range(len(sl)))))
        for iq, (q0, lq) in enumerate(zip(q_starts, q_chunks)):
            parts = []
            for ik, (k0, lk) in enumerate(zip(k_starts, k_chunks)):
                if not _attended(q0, lq, k0, lk, st["off"], lo_side, hi_side):
                    continue
                if keep_b is not None and not _map_keeps(keep_b, q0, lq, k0, lk):
                    continue                  # every entry of the chunks is False: adds nothing
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
