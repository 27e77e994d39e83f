"""A preallocated key/value cache for decoding: append in place, attend over it."""

from __future__ import annotations

from typing import Any, Optional, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._args import as_array, nonnegative_int, positive_int, shape_str
from ._functional import scaled_dot_product_attention

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of ``batch`` sequences, preallocated for ``max_len`` tokens.

    ``k`` (batch, heads, max_len, head_dim) and ``v`` (batch, heads, max_len,
    value_dim) are allocated once and never reallocated; ``lengths`` (batch,)
    int64 says how many tokens each sequence holds. ``dtype`` float32 or
    float16 (half the memory; attention is computed in float32).

    Example
    -------
    >>> import numpy as np, attnx
    >>> cache = attnx.KVCache(batch=1, heads=2, max_len=16, head_dim=8)
    >>> rng = np.random.default_rng(0)
    >>> kv = lambda n: rng.standard_normal((1, 2, n, 8), dtype=np.float32)
    >>> cache.append(kv(5), kv(5))                 # the prompt
    >>> out = cache.attend(kv(5))                  # its 5 queries, causal
    >>> cache.append(kv(1), kv(1))                 # one generated token
    >>> cache.attend(kv(1)).shape, cache.lengths.tolist()
    ((1, 2, 1, 8), [6])
    """

    def __init__(self, batch: SupportsIndex, heads: SupportsIndex, max_len: SupportsIndex,
                 head_dim: SupportsIndex, value_dim: Optional[SupportsIndex] = None,
                 dtype: DTypeLike = np.float32):
        self.batch = positive_int(batch, "batch")
        self.heads = positive_int(heads, "heads")
        self.max_len = nonnegative_int(max_len, "max_len")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.value_dim = self.head_dim if value_dim is None else positive_int(value_dim, "value_dim")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise TypeError(f"dtype must be float32 or float16; got {dt}")
        self.k: NDArray[Any] = np.zeros((self.batch, self.heads, self.max_len, self.head_dim), dt)
        self.v: NDArray[Any] = np.zeros((self.batch, self.heads, self.max_len, self.value_dim), dt)
        self.lengths: NDArray[np.int64] = np.zeros(self.batch, np.int64)

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, heads={self.heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.k.dtype}, "
                f"lengths={self.lengths.tolist()})")

    def _new(self, x: object, name: str, width: int) -> NDArray[Any]:
        a = as_array(x, name)
        if a.ndim != 4 or a.shape[:2] != (self.batch, self.heads) or a.shape[3] != width:
            raise ValueError(f"{name} must be (batch, heads, n, {width}) = ({self.batch}, "
                             f"{self.heads}, n, {width}); got {shape_str(a)}")
        return a

    def append(self, k_new: object, v_new: object) -> None:
        """Write n new tokens of every sequence after its last one, in place.

        k_new (batch, heads, n, head_dim), v_new (batch, heads, n, value_dim).
        Raises ValueError, writing nothing, when a sequence would pass max_len.
        """
        k = self._new(k_new, "k_new", self.head_dim)
        v = self._new(v_new, "v_new", self.value_dim)
        n = k.shape[2]
        if v.shape[2] != n:
            raise ValueError(f"k_new and v_new must hold the same number of tokens; got "
                             f"{shape_str(k)} and {shape_str(v)}")
        if self.batch and int(self.lengths.max()) + n > self.max_len:
            raise ValueError(f"the cache is full: appending {n} token(s) to lengths "
                             f"{self.lengths.tolist()} would pass max_len={self.max_len}")
        for b in range(self.batch):
            at = int(self.lengths[b])
            self.k[b, :, at:at + n] = k[b]
            self.v[b, :, at:at + n] = v[b]
        self.lengths += n

    def attend(self, q: object, **options: Any) -> Any:
        """Attention of n new queries over the cache, causal from the bottom right.

        q (batch, Hq, n, head_dim), Hq a multiple of heads (grouped-query
        attention); query i of sequence b sees keys j <= lengths[b] - n + i.
        options: any keyword of :func:`attnx.scaled_dot_product_attention` but
        the masks and the layout (scale, window, sinks, softcap, alibi_slopes,
        return_lse, need_weights). Returns what that function returns.
        """
        for bad in ("attn_mask", "is_causal", "key_lengths", "layout", "enable_gqa"):
            if bad in options:
                raise TypeError(f"KVCache.attend sets {bad} itself; got {bad}={options[bad]!r}")
        qa = as_array(q, "q")
        if qa.ndim != 4 or qa.shape[0] != self.batch or qa.shape[3] != self.head_dim:
            raise ValueError(f"q must be (batch, Hq, n, head_dim) = ({self.batch}, Hq, n, "
                             f"{self.head_dim}); got {shape_str(qa)}")
        kw = dict(options, is_causal="lower_right", enable_gqa=True)
        if self.batch and (self.lengths == self.lengths[0]).all():
            L = int(self.lengths[0])       # one call over the filled part: views, no copy
            return scaled_dot_product_attention(qa, self.k[:, :, :L], self.v[:, :, :L], **kw)
        parts = [scaled_dot_product_attention(qa[b:b + 1], self.k[b:b + 1, :, :int(n)],
                                              self.v[b:b + 1, :, :int(n)], **kw)
                 for b, n in enumerate(self.lengths)]
        if isinstance(parts[0], tuple):
            return tuple(np.concatenate(x) for x in zip(*parts))
        return np.concatenate(parts)
