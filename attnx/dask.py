"""``attnx.dask``: attnx's attention on dask arrays, split into blocks.

``attnx.dask.scaled_dot_product_attention`` takes the arguments of
:func:`attnx.scaled_dot_product_attention` with ``query``, ``key``, ``value``
(and ``attn_mask``) as dask arrays (NumPy arrays are wrapped with
``da.asarray``; ``attn_mask`` may be an :class:`attnx.BlockMask`) and returns
a lazy float32 dask array holding the same numbers.
Each task calls :func:`attnx.scaled_dot_product_attention` on one block, so a
sequence longer than one machine's memory is computed piece by piece:

* chunks of the batch and head axes are independent problems;
* chunks of the query axis are independent;
* chunks of the key axis are attended separately (``return_lse=True``) and
  combined exactly with :func:`attnx.merge_attention`, pairwise in a tree.

dask is imported here only, and in ``attnx._dask_graph``, which builds the
task graph (``import attnx`` never imports either); the tasks themselves are
in ``attnx._dask_blocks``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
from numpy.typing import NDArray

import dask.array as da

from ._args import Alignment, AttentionArgs, Causal, Layout, Precision, Window, attention_args
from ._blockmask import split_block_mask
from ._dask_graph import BLOCK_PREFIX as BLOCK_PREFIX  # the block tasks' names: tests, notebook
from ._dask_graph import (_assemble, _core_view, _graph, _kept_blocks, _rechunked, _row_values,
                          _shared_args)
from ._functional import scaled_dot_product_attention as _sdpa_numpy

__all__ = ["scaled_dot_product_attention", "bench"]

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


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
             alignment: Alignment, precision: Precision,
             ) -> Tuple[Any, Any, Any, Optional[Any], Optional[NDArray[np.uint8]], AttentionArgs]:
    """The arrays as dask arrays and every argument checked by attnx, on
    zero-stride stand-ins of the arrays (nothing read): ``(q, k, v, mask,
    blocks, args)``, the arrays as passed (layout and ndim unchanged); an
    :class:`attnx.BlockMask` gives its mask (a dask array, cut into blocks as
    any mask) and its map ``blocks`` (None for any other mask). The small
    per-sequence / per-head values are computed here (``_small``)."""
    qd, kd, vd = (_as_dask(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    attn_mask, blocks = split_block_mask(attn_mask)
    md = None if attn_mask is None else _as_dask(attn_mask, "attn_mask")
    key_lengths, query_lengths = _small(key_lengths), _small(query_lengths)
    sinks, alibi_slopes = _small(sinks), _small(alibi_slopes)
    p = attention_args(_meta(qd), _meta(kd), _meta(vd),
                       None if md is None else _meta(md), dropout_p, is_causal, scale, enable_gqa,
                       layout=layout, key_lengths=key_lengths, query_lengths=query_lengths,
                       window=window, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                       alignment=alignment, precision=precision)
    return qd, kd, vd, md, blocks, p


def scaled_dot_product_attention(
        query: Any, key: Any, value: Any, attn_mask: Optional[Any] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, layout: Layout = "bhld", key_lengths: Optional[Any] = None,
        query_lengths: Optional[Any] = None, window: Window = None, sinks: Optional[Any] = None,
        softcap: Optional[float] = None, alibi_slopes: Optional[Any] = None,
        alignment: Alignment = None, precision: Precision = "highest") -> Any:
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
    attn_mask : dask or NumPy array, or :class:`attnx.BlockMask`, optional
        bool or float, broadcastable to (B..., Hq, Lq, Lk); its broadcast
        (size-1) axes stay size 1, its other axes are rechunked like the
        scores (batch, heads and queries as ``query``, keys as ``key``). A
        BlockMask's mask is cut into blocks as any mask (each task's call
        classifies its block); with a bool BlockMask, the blocks its map
        shows empty are left out of the graph (below).
    key_lengths, query_lengths, sinks, alibi_slopes : array_like, optional
        Small per-sequence / per-head values, read when this function is
        called (a dask array here is computed at once).
    dropout_p, is_causal, scale, enable_gqa, layout, window, softcap, alignment, precision
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
    diagonal; with ``window``, key chunks wholly outside the band; with a
    bool :class:`attnx.BlockMask`, key chunks whose map blocks (64 queries
    by 32 keys, read when this function is called) keep nothing for any of
    the query chunk's rows, batches and heads (packed documents: the chunks
    off the documents' diagonal blocks). A float BlockMask's blocks all
    stay: a ``-inf`` added to a NaN score is NaN, as in attnx. A block
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
    qd, kd, vd, md, blocks, p = _checked(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale, enable_gqa, layout, key_lengths, query_lengths,
                                         window, sinks, softcap, alibi_slopes, alignment,
                                         precision)
    ndim_in = qd.ndim
    heads_are_batch = ndim_in == 3 and layout == "bhld"
    s = _rechunked(*_core_view(qd, kd, vd, layout), md, p.scores_shape)
    Lq, Lk = s.q.shape[-2], s.k.shape[-2]
    rows = _row_values(p, s.q.shape[:-2])                  # each (batch..., Hq) or None
    st = _shared_args(p, softcap, precision, s.group, heads_are_batch, s.q.ndim, Lq, Lk)
    # sinks go to attnx with the block when a query block is one task and its lse is
    # attnx's own; otherwise they join the merged rows in _finish
    late_sinks = len(s.k.chunks[-2]) > 1 or rows[3] is not None
    kept = _kept_blocks(blocks, None if md is None else md.dtype, s.q.shape[:-2])
    dsk, oname = _graph(s, rows, st, late_sinks, Lq, Lk, kept)
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

