"""Boolean attention masks: ``causal_mask`` and ``padding_mask``.

Both follow attnx's convention (PyTorch SDPA's): **True = may attend**.
PyTorch's ``nn.MultiheadAttention`` uses the opposite for its bool masks
(True = blocked); pass ``~mask`` there.

The C core applies the causal rule and the lengths itself
(``is_causal=`` and ``key_lengths=``/``query_lengths=`` of
:func:`attnx.scaled_dot_product_attention`), without building any mask; these
helpers are for when an explicit mask is wanted (to combine with other masks,
to plot, or to port code that builds one, such as a Transformer tutorial's masks).
"""

from __future__ import annotations

from typing import Optional, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._args import check_flag, check_range, integer_array, nonnegative_int

__all__ = ["causal_mask", "padding_mask"]


def causal_mask(Lq: SupportsIndex, Lk: Optional[SupportsIndex] = None, *,
                lower_right: bool = False) -> NDArray[np.bool_]:
    """The causal (look-ahead) mask: bool (Lq, Lk), True where query i may see key j.

    Parameters
    ----------
    Lq : int
        Number of queries (rows), >= 0.
    Lk : int, optional
        Number of keys (columns), >= 0; defaults to ``Lq``.
    lower_right : bool
        False (default): aligned top-left like PyTorch's ``is_causal=True``,
        ``mask[i, j] = j <= i``. True: aligned bottom-right, the last query
        sees every key, ``mask[i, j] = j <= i + Lk - Lq`` (decoding with a KV
        cache, where the Lq new queries follow Lk - Lq cached positions).
        The two agree when Lq == Lk.

    Returns
    -------
    mask : ndarray of bool, shape (Lq, Lk)
        True = may attend (attnx / PyTorch SDPA convention). It broadcasts
        against the scores (B, H, Lq, Lk) as it is; combine with a padding mask
        by ``&`` (a Transformer decoder's self-attention mask). ``attn_mask=causal_mask(Lq, Lk)``
        is the same as ``is_causal=True`` (and ``lower_right=True`` as
        ``is_causal="lower_right"``), which needs no mask in memory.
        With lower-right alignment and Lq > Lk the first Lq - Lk rows allow
        no key at all (attnx gives zeros for such rows, never NaN).

    Examples
    --------
    >>> from attnx import causal_mask
    >>> causal_mask(3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    >>> causal_mask(2, 4).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0]])
    >>> causal_mask(2, 4, lower_right=True).astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    Lq = nonnegative_int(Lq, "Lq")
    Lk = Lq if Lk is None else nonnegative_int(Lk, "Lk")
    offset = Lk - Lq if check_flag(lower_right, "lower_right") else 0
    return np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + offset


def padding_mask(lengths: ArrayLike, L: SupportsIndex) -> NDArray[np.bool_]:
    """The padding mask: bool (B, L), True where a position holds a real token.

    ``mask[b, j] = j < lengths[b]``: sequence b has ``lengths[b]`` real tokens
    followed by padding up to ``L``.

    Parameters
    ----------
    lengths : array_like of int, shape (B,)
        Number of real (non-padding) tokens of each sequence, each in [0, L].
        Any shape works: the result has shape ``lengths.shape + (L,)``.
    L : int
        Padded sequence length, >= 0.

    Returns
    -------
    mask : ndarray of bool, shape (B, L)
        True = real token (may be attended to).

    Notes
    -----
    To make a Transformer tutorial's (B, 1, Lq, Lk) attention masks (True = may attend),
    with ``pm_q = padding_mask(query_lengths, Lq)`` and
    ``pm_k = padding_mask(key_lengths, Lk)``:

    * keys only (cross attention, or self-attention ignoring padded keys)::

          mask = pm_k[:, None, None, :]                         # (B, 1, 1, Lk)

    * queries and keys (encoder self-attention: (i, j) is True only if both
      tokens are real)::

          mask = pm_q[:, None, :, None] & pm_k[:, None, None, :]  # (B, 1, Lq, Lk)

    * decoder causal attention, causal AND padding::

          mask = pm_q[:, None, :, None] & pm_k[:, None, None, :] & causal_mask(Lq, Lk)

    Rows of padded queries are then fully masked; attnx gives zeros for them
    (PyTorch's ``nn.MultiheadAttention`` gives NaN). Passing
    ``key_lengths=`` / ``query_lengths=`` (and ``is_causal=True``) to
    :func:`attnx.scaled_dot_product_attention` or
    :class:`attnx.MultiHeadAttention` gives the same result without building
    the mask. For PyTorch's ``key_padding_mask`` (True = pad) pass ``~pm_k``.

    Examples
    --------
    >>> from attnx import padding_mask
    >>> pm = padding_mask([3, 1], 4)
    >>> pm.astype(int)
    array([[1, 1, 1, 0],
           [1, 0, 0, 0]])
    >>> (pm[:, None, :, None] & pm[:, None, None, :]).shape
    (2, 1, 4, 4)
    """
    L = nonnegative_int(L, "L")
    a = integer_array(lengths, "lengths")   # tensors, __array__, DLPack; TypeError naming lengths
    check_range(a, "lengths", L, "L=")
    return np.arange(L) < a[..., None]
