"""The int8 format of attnx's caches: each (token, head) row rotated by a fixed
orthogonal matrix, then int8 values and one float32 scale.

Keys of real models have outlier channels (a few dimensions large for every
token): a scale a row set by them leaves the other dimensions a handful of
levels. A fixed orthogonal rotation ``R`` (``int8_rotation(E)``: a Hadamard
matrix with random signs where E is a power of two, else a DCT with random
signs) spreads every row's energy over all E dimensions before it is
quantized, and attention needs no dequantized copy to undo it: scores are dot
products, ``q · Rᵀy = (R q) · y``, and outputs are sums of value rows,
``Σ p Rᵀy = Rᵀ Σ p y``. So the kernels read the stored rows as they are, with
the query rotated once before and the output rotated back once after.

Keys are centred first, on the mean of their sequence's prompt
(:func:`fit_center`): what every key shares then costs no int8 levels, and
the scores of a query row all move by one amount, which the softmax cancels;
:func:`recenter` gives the lse (and the sinks, which join after) the shift back.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._args import float_array, positive_int, shape_str

__all__ = ["int8_rotation", "quantize_int8", "dequantize_int8"]

_F32_MAX = float(np.finfo(np.float32).max)
#: the largest float32 scale s with 127 · s finite in float32
_SCALE_MAX = np.uint32(2080440835).view(np.float32)
#: rows whose largest |x| is below this (127 times float32's smallest normal,
#: about 1.49e-36) get a subnormal scale, a multiple of 2**-149: their bound
#: gains INT8_SUBNORMAL_SLACK
INT8_SUBNORMAL_ROWS = 127 * 2.0 ** -126
#: what a subnormal scale adds to the bound: half float32's smallest subnormal
#: (2**-150, about 7.0e-46; the scale rounds up by at most 2**-149)
INT8_SUBNORMAL_SLACK = 2.0 ** -150


def _refuse_nonfinite(x: NDArray[np.float64], a: NDArray[Any], name: str) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} holds {a[at]} at {at}, which an int8 cache cannot store "
                         f"(its values must be finite); nothing was written")


def quantize_rows(a: NDArray[Any], name: str) -> Tuple[NDArray[np.int8], NDArray[np.float32]]:
    """Rows (..., E) of a finite float array as int8 values and a float32 scale
    a row, symmetric, rounded to nearest (ties to even): ``scale = max|x| / 127``
    (rounded up to float32) and ``x ≈ scale * q``, within ``scale / 2`` before
    the product's own float32 rounding, so within ``max|x| / 254`` of the row
    (to a relative 2e-5 of that bound). Rows whose largest |x| is below
    ``INT8_SUBNORMAL_ROWS`` (127 times float32's smallest normal, ~1.5e-36)
    get a subnormal scale, which rounds up by as much as 2**-149: their bound
    is ``max|x| / 254 + 2**-150`` (no single scale on the subnormal grid can
    do better for every such row). A row of zeros has scale 0. NaN or inf
    raise ValueError naming ``name`` and where. (Unrotated: the format of
    ``(pages, scales)`` pools; caches rotate first, :func:`quantize_int8`.)"""
    x = a.astype(np.float64)
    _refuse_nonfinite(x, a, name)
    big = np.abs(x) > _F32_MAX                 # float64 input past float32's range
    if big.any():
        at = tuple(int(i) for i in np.argwhere(big)[0])
        raise ValueError(f"{name} holds {a[at]} at {at}, beyond float32's range (|x| up to "
                         f"{_F32_MAX:g}), which an int8 cache's float32 scale cannot reach; "
                         f"scale the values; nothing was written")
    return _quantize(x)


def _quantize(x: NDArray[np.float64]) -> Tuple[NDArray[np.int8], NDArray[np.float32]]:
    top = np.abs(x).max(axis=-1) / 127.0 if x.shape[-1] else np.zeros(x.shape[:-1])
    scale = top.astype(np.float32)
    low = scale.astype(np.float64) < top       # rounded down: |x| / scale could pass 127
    scale[low] = np.nextafter(scale[low], np.float32(np.inf))
    # near float32's largest, 127 · scale must stay finite: the values a hair past
    # 127 · scale then round (clip) to 127, a few float32 steps off
    np.minimum(scale, _SCALE_MAX, out=scale)
    s = scale.astype(np.float64)[..., None]
    q = np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0))
    return np.clip(q, -127, 127).astype(np.int8), scale


def _signs(n: int) -> NDArray[np.float64]:
    """n fixed random signs (xorshift64 seeded by n: the same on every platform
    and NumPy release, since they define what stored rows mean)."""
    x, out = 0x9E3779B97F4A7C15 ^ n, []
    for _ in range(n):
        x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 7
        x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
        out.append(1.0 if x >> 63 else -1.0)
    return np.array(out)


@functools.lru_cache(maxsize=None)
def shared_rotation(dim: int) -> Tuple[NDArray[np.float64], NDArray[np.float32]]:
    """int8_rotation(dim) and its float32 rounding, read-only, one pair per dim
    for the process: every int8 cache of that width (an AttnxCache has one a
    layer) shares them instead of holding its own (E, E) matrices."""
    r64 = int8_rotation(dim)
    r32 = r64.astype(np.float32)
    r64.flags.writeable = False
    r32.flags.writeable = False
    return r64, r32


def int8_rotation(dim: int) -> NDArray[np.float64]:
    """The fixed orthogonal matrix R (E, E) float64, E = dim, that int8 caches
    rotate rows by: a row x (E,) is stored as the int8 values and scale of
    ``y = R @ x`` and stands for ``R.T @ (scale * q)``.

    For dim a power of two, the normalised Hadamard matrix (entries
    ``±1 / sqrt(dim)``) times fixed random signs on its columns; otherwise the
    orthonormal DCT-II matrix times the same kind of signs. Both spread a
    row's outliers over all its values. A new array each call, the same
    numbers every time.

    Example
    -------
    >>> import numpy as np, attnx
    >>> R = attnx.int8_rotation(8)
    >>> R.shape, bool(np.allclose(R @ R.T, np.eye(8)))
    ((8, 8), True)
    """
    n = positive_int(dim, "dim")       # 2.5, "8" and True are no size: TypeError
    if n & (n - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        m = h / np.sqrt(n)
    else:
        i = np.arange(n)
        m = np.cos(np.pi * (i[None, :] + 0.5) * i[:, None] / n) * np.sqrt(2.0 / n)
        m[0] /= np.sqrt(2.0)
    out: NDArray[np.float64] = m * _signs(n)[None, :]
    return out


def quantize_rotated(a: NDArray[Any], name: str, rotation: NDArray[np.float64],
                     centre: Optional[NDArray[Any]] = None,
                     ) -> Tuple[NDArray[np.int8], NDArray[np.float32]]:
    """Rows (..., E), minus ``centre`` (broadcast to them) when given, rotated
    by ``rotation`` (E, E) and quantized (:func:`quantize_rows` on ``y = (x -
    centre) @ rotation.T``, in float64). NaN, inf (in x) and rows too long for
    float32 once rotated raise ValueError naming ``name`` and where."""
    x = a.astype(np.float64)
    _refuse_nonfinite(x, a, name)
    if centre is not None:
        x -= centre
    y = x @ rotation.T
    top = np.abs(y).max(axis=-1) if y.shape[-1] else np.zeros(y.shape[:-1])
    if (top > _F32_MAX).any():
        at = tuple(int(i) for i in np.argwhere(top > _F32_MAX)[0])
        norm = float(np.linalg.norm(x[at]))
        raise ValueError(f"{name}'s row at {at} is too large for an int8 cache: rotated, its "
                         f"largest value is {float(top[at]):g} (the row's Euclidean norm is "
                         f"{norm:g}), beyond float32's range ({_F32_MAX:g}); scale the values; "
                         f"nothing was written")
    return _quantize(y)


def quantize_int8(x: ArrayLike) -> Tuple[NDArray[np.int8], NDArray[np.float32]]:
    """Rows in the format of attnx's int8 caches: x (B..., E) floats gives
    ``(q, scale)``, q (B..., E) int8 and scale (B...,) float32, where each row
    stands for ``int8_rotation(E).T @ (scale * q)``.

    The row is rotated, ``y = int8_rotation(E) @ x``, then quantized
    symmetrically, ``scale = max|y| / 127`` (rounded up to float32) and ``q``
    rounded to nearest, ties to even. Each ``y`` value is within ``max|y| /
    254`` (plus ``2**-150`` when ``max|y| < 127 * 2**-126``, the scale then
    subnormal), so the row it stands for is within Euclidean distance
    ``sqrt(E) * max|y| / 254 <= sqrt(E) * ||x|| / 254`` of ``x``. NaN, inf and
    rows whose rotated values pass float32's largest raise ValueError. Use it
    to fill int8 pages for :func:`attnx.varlen_attention`, passed as
    ``(pages, scales, attnx.int8_rotation(E))``. (An int8 cache's key rows
    are this of the keys minus their sequence's centre, ``k_center``, which
    key pages then take as a fourth item.)

    Example
    -------
    >>> import numpy as np, attnx
    >>> x = np.random.default_rng(0).standard_normal((3, 64))
    >>> q, scale = attnx.quantize_int8(x)
    >>> q.dtype, scale.shape
    (dtype('int8'), (3,))
    >>> err = np.linalg.norm(attnx.dequantize_int8(q, scale) - x, axis=-1)
    >>> bool((err <= 8 * np.linalg.norm(x, axis=-1) / 254).all())
    True
    """
    a = float_array(x, "x")
    if a.ndim < 1 or a.shape[-1] < 1:
        raise ValueError(f"x must be rows (..., E) with E >= 1; got shape {shape_str(a)}")
    return quantize_rotated(a, "x", shared_rotation(a.shape[-1])[0])


def dequantize_int8(q: ArrayLike, scale: ArrayLike) -> NDArray[np.float32]:
    """The rows int8 values stand for: q (B..., E) int8 and scale (B...,)
    float32 (as :func:`quantize_int8` and an int8 :class:`attnx.KVCache` store
    them; a cache's keys add their ``k_center``) give ``(scale * q) @
    int8_rotation(E)`` (B..., E) float32, computed in
    float64 and rounded once (a value within the bound of float32's largest
    may round to inf; the caches' attention never forms these rows).

    Example
    -------
    >>> import numpy as np, attnx
    >>> q, s = attnx.quantize_int8(np.ones((2, 4)))
    >>> attnx.dequantize_int8(q, s).round(2).tolist()
    [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    """
    qa, sa = np.asarray(q), np.asarray(scale)
    if qa.dtype != np.int8 or qa.ndim < 1 or sa.shape != qa.shape[:-1]:
        raise ValueError(f"q must be int8 (..., E) and scale (...) its rows' scales; got q "
                         f"{qa.dtype} {shape_str(qa)}, scale {sa.dtype} {shape_str(sa)}")
    y = sa.astype(np.float64)[..., None] * qa.astype(np.float64)
    with np.errstate(over="ignore"):
        return (y @ shared_rotation(qa.shape[-1])[0]).astype(np.float32)


def _float32(rotation: NDArray[Any]) -> NDArray[np.float32]:
    """A rotation in float32: the shared copy for int8_rotation's own matrix,
    a conversion for a caller's (a page pool's)."""
    shared = shared_rotation(rotation.shape[0])
    if rotation is shared[0]:
        return shared[1]
    return rotation.astype(np.float32, copy=False)


def rotate(q: NDArray[Any], rotation: Any) -> NDArray[Any]:
    """Queries (..., E) rotated as the int8 rows they meet were, ``q @ R.T`` in
    float32 (q as it is when there is no rotation)."""
    if rotation is None:
        return q
    r = _float32(rotation)
    # a stack of small products (np.matmul's own loop for 1-row items): a 2-D np.dot
    # would wake BLAS threads that then spin beside attnx's
    out: NDArray[Any] = np.matmul(q.astype(np.float32, copy=False)[..., None, :], r.T)
    return out[..., 0, :]


def rotate_back(result: Any, rotation: Any) -> Any:
    """An attention result over rotated value rows, its output (..., Ev) (alone
    or first of a tuple) rotated back, ``out @ R``, in float32."""
    if rotation is None:
        return result
    r = _float32(rotation)
    out = result[0] if isinstance(result, tuple) else result
    back = np.matmul(out[..., None, :], r)[..., 0, :]
    return (back,) + result[1:] if isinstance(result, tuple) else back


def fit_center(x: NDArray[np.float64]) -> NDArray[np.float32]:
    """The centre an int8 cache subtracts from a sequence's keys before it
    rotates them: the mean of the keys that come with its token 0 (the
    prompt), per (head, channel), rounded to float32. x (B, H, n, E), n >= 1
    -> (B, H, 1, E). Keys of real models share a large part (the outlier
    channels, nearly constant across tokens): without it the rows spend
    their int8 levels on what every row holds."""
    out: NDArray[np.float32] = x.mean(axis=2, keepdims=True).astype(np.float32)
    return out


def recenter(result: Any, q: NDArray[Any], centre: NDArray[np.float32], scale: float,
             sinks: Any, need_weights: bool, return_lse: bool) -> Any:
    """Attention over keys stored minus ``centre`` (B, Hk, 1, E), computed
    without sinks with the lse last in ``result``, as over the keys
    themselves: each score of query row i was short by ``o_i = scale · q_i ·
    centre``, the same for every key of the row, so the softmax, the output
    and the weights are those of the keys and only the lse moves, ``lse + o``;
    then the sinks (B, Hq) join the row's denominator (:func:`shift_lse`),
    which scales the output and the weights. q (B, Hq, n, E); returns
    ``out[, weights][, lse]``."""
    out, lse = result[0], result[-1]
    B, Hq, n, E = q.shape
    Hk = centre.shape[1]
    g = centre.reshape(B, Hk, 1, E).repeat(Hq // Hk, axis=1)   # (B, Hq, 1, E): h takes h // (Hq/Hk)
    shift = scale * np.matmul(q.astype(np.float64), g.astype(np.float64).swapaxes(-1, -2))[..., 0]
    row_sinks = None if sinks is None else np.asarray(sinks, np.float64).reshape(B, Hq, 1)
    lse64, w = shift_lse(lse, shift, row_sinks)                       # (B, Hq, n)
    parts: Tuple[Any, ...] = (out if w is None else (out * w[..., None]).astype(np.float32),)
    if need_weights:
        parts += (result[1] if w is None else (result[1] * w[..., None]).astype(np.float32),)
    if return_lse:
        parts += (lse64.astype(np.float32),)
    return parts[0] if len(parts) == 1 else parts


def shift_lse(lse: NDArray[Any], shift: NDArray[np.float64], sinks: Optional[NDArray[Any]],
              ) -> Tuple[NDArray[np.float64], Optional[NDArray[np.float64]]]:
    """The lse of rows computed over keys minus a centre, computed without
    sinks, given back what the softmax cancelled: ``lse + shift`` (rows with
    no allowed key, -inf, stay so); then the sinks' logits (broadcast to
    lse) join each row's denominator. Returns the lse (float64, lse's shape)
    and the factor that scales the row's output and weights,
    ``exp(lse + shift - joined)`` (None without sinks)."""
    with np.errstate(invalid="ignore", over="ignore"):
        lse64 = np.where(np.isneginf(lse), -np.inf, lse + shift)
        if sinks is None:
            return lse64, None
        joined = np.logaddexp(lse64, sinks)
        w = np.where(np.isneginf(lse64), 0.0, np.exp(lse64 - joined))
        return np.where(np.isneginf(lse64), -np.inf, joined), w
