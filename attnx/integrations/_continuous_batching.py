"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``)
with attnx, reading the paged cache in place.

transformers 5.x serves many requests at once from a paged KV cache. With
``"sdpa"`` every layer of every step gathers all cached keys of all requests
(``index_select`` over ``read_index``) and runs one dense attention over all
queries × all keys under a block-diagonal mask. With attnx each request
attends to its own keys only, read where the cache holds them.

Two small hooks, installed by :func:`install` (``register()`` calls it), make
that possible without editing transformers; both leave every other attention
implementation exactly as it was:

* ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` accepts attnx's
  names (it otherwise refuses any implementation that is not ``"sdpa"``,
  ``"paged|eager"`` or flash). transformers then builds no mask for attnx.
* ``PagedAttentionCache.update``, for attnx's names on full-attention layers,
  writes the step's new keys and values into the cache as it always does,
  but skips the gather: the attention function gets the layer's rows of the
  cache and ``read_index`` instead (sliding-window layers, a ring buffer,
  keep transformers' own update and its gathered keys).

:func:`varlen_forward` then reads each request's keys from the cache's pages
(``read_index`` runs through whole pages of ``page_size`` rows in position
order; the pages become a ``block_table`` for :func:`attnx.varlen_attention`),
and falls back to the gathered rows if a ``read_index`` is ever laid out
otherwise.

Releases differ in who calls the paged cache's ``update``: up to 5.23 the
attention function does (transformers passes the cache as ``kwargs["cache"]``
and ``cu_seq_lens_k`` still keyed by layer type, as its ``sdpa`` and
``eager_paged`` functions expect), from 5.24 the model's attention layer does,
before the attention function. :func:`varlen_forward` calls it where the
release expects the attention function to (:func:`update_if_needed`). The
releases the hooks were checked on are ``SUPPORTED``; ``register()`` refuses
any other.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, NamedTuple, Optional, Set, Tuple

import numpy as np
import torch
from numpy.typing import NDArray

from .._varlen import varlen_attention
from ..torch import _numpy, _threads_for

__all__ = ["install", "varlen_forward", "SUPPORTED", "check_version"]

#: the transformers releases attnx's integration was checked on: [oldest, first
#: not admitted). The [transformers] and [test] extras of pyproject.toml say the
#: same (tests/test_continuous_batching.py compares them); CI tests the oldest
#: and the newest release in its install matrix.
SUPPORTED = ("5.23", "6")


def _release(version: str) -> Tuple[int, ...]:
    """A version's release numbers: "5.23.0.dev0" -> (5, 23, 0)."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def check_version(version: str) -> None:
    """Raise RuntimeError naming ``version`` and the supported range unless
    transformers ``version`` lies in ``SUPPORTED``."""
    lo, hi = (_release(v) for v in SUPPORTED)
    if not lo <= _release(version) < hi:
        raise RuntimeError(f"attnx supports transformers>={SUPPORTED[0]},<{SUPPORTED[1]} (the "
                           f"releases its integration is tested on); this is transformers "
                           f"{version}: install one of them (pip install 'attnx[transformers]')")

#: the attention implementation names attnx registered (the hooks act for these)
NAMES: Set[str] = set()

#: the kwarg that carries a layer's cache rows from the update hook to the attention
_ROWS = "_attnx_cache_rows"


class CacheRows(NamedTuple):
    """A full-attention layer's cache as the update hook hands it on."""

    k: torch.Tensor           # (rows, Hk, D): the layer's view of the cache
    v: torch.Tensor           # (rows, Hk, Dv)
    read_index: torch.Tensor  # (total_k,) int64: request i's keys at rows read_index[ck[i]:ck[i+1]]
    page_size: int
    memo: Dict[str, Any]      # the cache's own: the last read_index and its block table


def _hooks() -> Tuple[Any, Any, Any]:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator)
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager)
    return ContinuousBatchingManager, PagedAttentionCache, FullAttentionCacheAllocator


#: transformers' own methods, which the hooks call for everything but attnx
_original_switch: Any = None
_original_update: Any = None


def install(name: str) -> None:
    """Let ``name`` (an attnx attention implementation) run transformers'
    continuous batching, reading the cache in place. Idempotent."""
    global _original_switch, _original_update
    manager, cache, full = _hooks()
    NAMES.add(name)
    if getattr(manager.switch_to_cb_friendly_attn, "_attnx", False):
        return
    _original_switch, _original_update = manager.switch_to_cb_friendly_attn, cache.update

    def switch_to_cb_friendly_attn(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if model.config._attn_implementation in NAMES:
            return None             # attnx takes packed requests as they are
        return _original_switch(self, model, *args, **kwargs)

    def cache_update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor,
                     layer_idx: int, kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        allocator = self.layer_to_allocator[layer_idx]
        # full-attention layers only: the sliding-window allocator (a subclass, a ring
        # buffer whose update reads before it writes) keeps transformers' own update
        if (self.config._attn_implementation not in NAMES or type(allocator) is not full
                or kwargs.get("block_table") is not None
                or layer_idx not in getattr(allocator, "_kv_token_views", {})):
            return _original_update(self, key_states, value_states, layer_idx, kwargs)  # type: ignore[no-any-return]
        # as transformers' update (cache.py), without its index_select of every key
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        k_rows, v_rows = allocator._kv_token_views[layer_idx]
        write = kwargs["write_index"][allocator.index]
        k_rows.index_copy_(0, write, key_states[0].transpose(0, 1))
        v_rows.index_copy_(0, write, value_states[0].transpose(0, 1))
        # the step's block table is found once a step, and kept by the cache (not the
        # module: two managers, in one thread or several, never read each other's)
        memo = self.__dict__.setdefault("_attnx_table", {})
        kwargs[_ROWS] = CacheRows(k_rows, v_rows, kwargs["read_index"][allocator.index],
                                  int(allocator.tokens_per_page), memo)
        return key_states, value_states

    switch_to_cb_friendly_attn._attnx = True      # type: ignore[attr-defined]
    manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    cache.update = cache_update


def _block_table(read_index: NDArray[np.int64], ck: NDArray[np.int64],
                 page: int) -> Optional[NDArray[np.int64]]:
    """The pages (of ``page`` rows, numbered from the layer's first row) that
    hold each request's keys, if read_index[ck[i]:ck[i+1]] is request i's pages
    row by row from their first rows (transformers' layout); else None."""
    n, lengths = ck.shape[0] - 1, np.diff(ck)
    if read_index.shape[0] != ck[-1] or n == 0:
        return None
    need = -(-lengths // page)
    cols = np.arange(max(int(need.max()), 1))
    used = cols < need[:, None]
    starts = np.where(used, ck[:-1, None] + cols * page, 0)
    first = read_index[starts] if read_index.size else np.zeros(starts.shape, np.int64)
    if (first[used] % page).any():
        return None
    table = np.where(used, first // page, 0)
    pos = np.arange(read_index.shape[0]) - np.repeat(ck[:-1], lengths)
    seq = np.repeat(np.arange(n), lengths)
    if not np.array_equal(table[seq, pos // page] * page + pos % page, read_index):
        return None
    return table


def _table_for(rows: CacheRows, ck: NDArray[np.int64]) -> Optional[NDArray[np.int64]]:
    """_block_table, computed again only when the index changes (compared by
    value: the step's index tensor is a slice of a buffer transformers reuses,
    and inference tensors keep no version counter). The last index, its
    cu_seqlens_k and page size, and their pages are one tuple in the cache's
    memo, replaced whole (every layer of a step reads the same index)."""
    ri = rows.read_index.numpy()
    last = rows.memo.get("entry")
    if last is not None and last[2] == rows.page_size and np.array_equal(last[1], ck) \
            and np.array_equal(last[0], ri):
        table: Optional[NDArray[np.int64]] = last[3]
        return table
    table = _block_table(ri, ck, rows.page_size)
    rows.memo["entry"] = (ri.copy(), ck.copy(), rows.page_size, table)
    return table


def _pages(t: torch.Tensor, n: int, page: int) -> np.ndarray[Any, Any]:
    """A layer's (rows, H, D) cache view as its first n pages (n, page, H, D), in place."""
    a = _numpy(t, "key")
    return a[:n * page].reshape(n, page, *a.shape[1:])


def update_if_needed(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                     kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Call the paged cache's ``update`` where the release expects the attention
    function to (transformers 5.23: the cache in ``kwargs["cache"]``, and
    ``cu_seq_lens_k`` still a dict keyed by layer type until it runs); else
    return key and value as they are (5.24 on: the model called it)."""
    if not isinstance(kwargs.get("cu_seq_lens_k"), dict):
        return key, value
    cache = kwargs.pop("cache", None)
    if cache is None or not hasattr(cache, "update"):
        raise RuntimeError("attnx: continuous batching passed cu_seq_lens_k by layer type but "
                           "no paged cache (kwargs['cache']) to update: this transformers "
                           "release is not one attnx supports")
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        kwargs=kwargs)
    return k, v


def varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, kwargs: Dict[str, Any],
                   options: Dict[str, Any]) -> torch.Tensor:
    """A continuous-batching step's attention, never failing silently:
    transformers' generation loop catches an exception and hands back the
    requests empty (with ``.error``), so a failure is also warned about
    (RuntimeWarning, with the error) before it is raised again."""
    try:
        key, value = update_if_needed(module, key, value, kwargs)
        return _varlen_forward(query, key, value, kwargs, options)
    except Exception as e:
        warnings.warn(f"attnx: a continuous-batching step failed; transformers returns the "
                      f"requests of this batch without tokens: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)
        raise


def _varlen_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kwargs: Dict[str, Any], options: Dict[str, Any]) -> torch.Tensor:
    """A continuous-batching step's attention: query (1, Hq, total_q, D), the
    requests packed along total_q as ``cu_seq_lens_q`` says; each request's
    queries are the last positions of its ``cu_seq_lens_k`` keys (causal,
    aligned lower-right). Keys from the cache's pages when the update hook
    handed them on, else from key/value (1, Hk, total_k, D) as transformers
    passes them. Returns (1, total_q, Hq, Dv)."""
    cq = kwargs["cu_seq_lens_q"].numpy().astype(np.int64)
    ck = kwargs["cu_seq_lens_k"].numpy().astype(np.int64)
    rows: Optional[CacheRows] = kwargs.get(_ROWS)
    q = _numpy(query[0].transpose(0, 1), "query")
    table = None
    if rows is not None and rows.read_index.numel():
        table = _table_for(rows, ck)
        if table is None:       # not whole pages: gather this layer's keys (as transformers does)
            key = rows.k[rows.read_index].transpose(0, 1)[None]
            value = rows.v[rows.read_index].transpose(0, 1)[None]
    if table is not None:
        assert rows is not None
        # the values' view starts a page after the keys' (pages of a layer alternate K, V)
        n = min(rows.k.shape[0], rows.v.shape[0]) // rows.page_size
        k, v = _pages(rows.k, n, rows.page_size), _pages(rows.v, n, rows.page_size)
    else:
        k, v = (_numpy(t[0].transpose(0, 1), n) for t, n in ((key, "key"), (value, "value")))
    # the thread count of a call reading every request's keys (a stand-in of their shape)
    keys = torch.empty((1, key.shape[1], int(ck[-1]), key.shape[3]), dtype=key.dtype, device="meta")
    with _threads_for(query, keys, "bhld"):
        out = varlen_attention(q, k, v, cq, ck, block_table=table, enable_gqa=True, **options)
    return torch.from_numpy(out).to(query.dtype).unsqueeze(0)
