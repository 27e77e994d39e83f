"""``attnx.BlockMask``: a mask classified once, for masks that are mostly
empty blocks (packed documents, prefix-LM, causal written as a mask, tree
masks of speculative decoding), reused across heads, layers and calls.

Every masked call classifies its mask by itself: the C core reads the mask
once, in blocks of ``MAP_ROWS`` (64) query rows by ``MAP_KEYS`` (32) keys,
and then skips the tiles of keys a block keeps nothing of (no products, no
softmax, no reads of K or V) and applies no mask where a block drops
nothing; forward and backward alike, with the same results as without
skipping. A :class:`BlockMask` does that reading once, when it is built (one
pass over the mask's bytes with the GIL released), and hands the blocks'
classes to every call with the mask, like FlexAttention's
``create_block_mask``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, SupportsIndex, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attnx
from ._arrays import as_array, integer_array, is_float_dtype, shape_str
from ._scalars import nonnegative_int

__all__ = ["BlockMask"]

#: Called with every BlockMask built (unpickled and copied ones too). attnx.torch
#: adds the function that gives it its tensors (torch.compile reads those: it cannot
#: read the sealed arrays).
ON_BUILD: List[Callable[["BlockMask"], Any]] = []


class BlockMask:
    """A bool or float mask with the classes of its blocks, computed once.

    Pass it as ``attn_mask`` to :func:`attnx.scaled_dot_product_attention`,
    its ``_vjp`` and ``_backward``, ``attnx.torch.scaled_dot_product_attention``
    (no gradient for the mask: it holds no tensor) and
    ``attnx.dask.scaled_dot_product_attention`` (and anything that takes an
    array: it is one, ``np.asarray(block_mask)`` gives the mask); the core then skips the
    tiles the mask empties and does not mask the tiles it keeps whole,
    without reading the mask to find them.

    Parameters
    ----------
    mask : array_like, bool or float, shape (..., Lq, Lk)
        True = may attend (bool), or added to the scores (float: ``-inf``
        blocks are skipped, blocks of zeros are not masked); broadcastable
        to the scores (B..., Hq, Lq, Lk) as any ``attn_mask``. Copied once
        (bool, or float32), read-only: a BlockMask never changes.

    ``mask`` is the mask, (..., Lq, Lk), read-only. ``blocks`` holds a uint8
    per block of ``MAP_ROWS`` query rows by ``MAP_KEYS`` keys, (..., nq, nk)
    with nq = ceil(Lq / 64) (1 when the mask's Lq axis has size 1) and nk =
    ceil(Lk / 32): ``KEEP`` (1) where some entry keeps its key, ``DROP`` (2)
    where some entry changes its score (0 only for empty axes); read-only.

    Examples
    --------
    Eight documents of 256 tokens packed in one sequence: 1/8 of the work.

    >>> import numpy as np, attnx
    >>> bm = attnx.BlockMask.documents([256] * 8)
    >>> bm
    BlockMask(shape=(2048, 2048), dtype=bool, kept=12.5%, blocks: 87.5% empty, 12.5% full, 0.0% partial)
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 2048, 64), dtype=np.float32) for _ in range(3))
    >>> out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm)
    >>> np.allclose(out, attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm.mask), atol=1e-6)
    True
    """

    KEEP = int(_attnx.MAP_KEEP)
    DROP = int(_attnx.MAP_DROP)
    MAP_ROWS = int(_attnx.MAP_ROWS)
    MAP_KEYS = int(_attnx.MAP_KEYS)

    def __init__(self, mask: ArrayLike):
        m = as_array(mask, "mask")
        if m.dtype != np.bool_ and not is_float_dtype(m.dtype):
            raise TypeError(f"mask must be bool (True = attend) or float (added to the scores); "
                            f"got dtype {m.dtype} with shape {shape_str(m)}")
        if m.ndim < 2:
            raise ValueError(f"mask must be at least 2-D (..., Lq, Lk); got shape {shape_str(m)}")
        m = np.array(m, dtype=np.bool_ if m.dtype == np.bool_ else np.float32, order="C")
        lead = m.shape[:-2]
        m4 = m.reshape((int(np.prod(lead, dtype=np.int64)), 1) + m.shape[-2:])
        blocks = _attnx.classify_mask(m4, 0)     # the GIL released
        self._mask = _sealed(m)
        self._blocks = _sealed(blocks.reshape(lead + blocks.shape[2:]))
        for hook in ON_BUILD:
            hook(self)

    @property
    def mask(self) -> NDArray[Any]:
        """The mask (..., Lq, Lk), bool or float32; read-only for good."""
        return self._mask

    @property
    def blocks(self) -> NDArray[np.uint8]:
        """The blocks' classes (..., nq, nk), uint8; read-only for good."""
        return self._blocks

    def __reduce__(self) -> Tuple[Any, Tuple[NDArray[Any], NDArray[np.uint8]]]:
        # pickled or deep-copied, the arrays come back writeable: _rebuilt seals them
        return _rebuilt, (self._mask, self._blocks)

    # ---- built from a rule ----------------------------------------------------

    @classmethod
    def documents(cls, lengths: Union[Sequence[int], ArrayLike], *,
                  causal: bool = False) -> "BlockMask":
        """Packed documents: ``lengths`` (N,) tokens each, L = their sum; query i
        sees key j only in its own document (and only j <= i with ``causal``).
        A bool (L, L) mask, block-diagonal."""
        n = integer_array(lengths, "lengths")
        if n.ndim != 1 or (n.size and n.min() < 0):
            raise ValueError(f"lengths must be 1-D non-negative document lengths; got "
                             f"{n.tolist()!r:.200}")
        doc = np.repeat(np.arange(n.size), n.astype(np.int64))
        mask = doc[:, None] == doc[None, :]
        if causal:
            mask &= np.tri(doc.size, dtype=np.bool_)
        return cls(mask)

    @classmethod
    def prefix_lm(cls, length: SupportsIndex, prefix: SupportsIndex) -> "BlockMask":
        """A prefix-LM: the first ``prefix`` tokens see each other (bidirectional),
        the rest are causal: query i sees key j when j <= i or j < prefix.
        A bool (length, length) mask."""
        L, P = nonnegative_int(length, "length"), nonnegative_int(prefix, "prefix")
        if P > L:
            raise ValueError(f"prefix must be at most length = {L}; got {P}")
        mask = np.tri(L, dtype=np.bool_)
        mask[:, :P] = True
        return cls(mask)

    # ---- what it holds --------------------------------------------------------

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.mask.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.mask.dtype

    @property
    def ndim(self) -> int:
        return int(self.mask.ndim)

    def kept_fraction(self) -> float:
        """The fraction of entries that keep their key (bool True, float not -inf)."""
        if self.mask.size == 0:
            return 0.0
        kept = self.mask if self.mask.dtype == np.bool_ else self.mask != -np.inf
        return float(np.count_nonzero(kept)) / self.mask.size

    def block_fractions(self) -> Tuple[float, float, float]:
        """The fractions of blocks that are empty (skipped), full (not masked)
        and partial (masked element by element)."""
        b = self.blocks
        if b.size == 0:
            return 0.0, 0.0, 0.0
        empty = np.count_nonzero((b & self.KEEP) == 0) / b.size
        full = np.count_nonzero(b == self.KEEP) / b.size
        return empty, full, 1.0 - empty - full

    def __array__(self, dtype: Optional[Any] = None, copy: Optional[bool] = None) -> NDArray[Any]:
        if copy:
            return np.array(self.mask, dtype=dtype)
        return self.mask if dtype is None else self.mask.astype(dtype)

    def __repr__(self) -> str:
        e, f, p = self.block_fractions()
        return (f"BlockMask(shape={self.shape}, dtype={self.dtype}, kept="
                f"{100 * self.kept_fraction():.1f}%, blocks: {100 * e:.1f}% empty, "
                f"{100 * f:.1f}% full, {100 * p:.1f}% partial)")


def _sealed(a: NDArray[Any]) -> NDArray[Any]:
    """``a``, held by nothing else, seen through a read-only buffer, without a
    copy: neither the view nor any view of it can be made writeable again
    (``setflags(write=True)`` raises ValueError; on a read-only array that owns
    its memory it would succeed, and edits would leave the block map stale)."""
    a.flags.writeable = False
    return np.asarray(a.data.toreadonly())


def _rebuilt(mask: NDArray[Any], blocks: NDArray[np.uint8]) -> BlockMask:
    """A pickled or copied BlockMask: its mask and blocks as they were, sealed again."""
    bm = BlockMask.__new__(BlockMask)
    bm._mask = _sealed(np.ascontiguousarray(mask))
    bm._blocks = _sealed(np.ascontiguousarray(blocks))
    for hook in ON_BUILD:
        hook(bm)
    return bm


def split_block_mask(attn_mask: Any) -> Tuple[Any, Optional[NDArray[np.uint8]]]:
    """``attn_mask`` as (the mask, its blocks) when it is a BlockMask, else (it, None)."""
    if isinstance(attn_mask, BlockMask):
        return attn_mask.mask, attn_mask.blocks
    return attn_mask, None
