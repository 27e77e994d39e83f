"""A preallocated key/value cache for decoding: append in place, attend over it."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, Tuple, Union, overload

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._args import (AttentionArgs, as_array, attention_args, check_flag, float_array, is_bfloat16,
                    nonnegative_int, positive_int, shape_str)
from ._functional import OPTIONS, forward, scaled_dot_product_attention
from ._int8 import fit_center, quantize_rotated, recenter, rotate, rotate_back, shared_rotation
from ._options import check_names
from ._variants import NO_VARIANTS

__all__ = ["KVCache"]

#: The cache dtypes by name, int8 first (transformers' AttnxCache and
#: ``python -m attnx kv-divergence`` read this list; the CLI checks ``--dtypes``
#: against it before it imports torch).
CACHE_DTYPES = ("int8", "bfloat16", "float16", "float32")


def _cache_dtype(dtype: object) -> np.dtype[Any]:
    """The cache's dtype: float32, float16, bfloat16 (ml_dtypes', also as
    "bfloat16") or int8."""
    want = "float32, float16, bfloat16 or int8"
    if dtype is None:           # np.dtype(None) would be float64
        raise TypeError(f"dtype must be {want}; got None")
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError('dtype="bfloat16" needs ml_dtypes (pip install ml_dtypes, or '
                            'attnx[bfloat16]), whose bfloat16 is NumPy\'s') from None
        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    try:
        dt: np.dtype[Any] = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"dtype must be {want}; got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8)) \
            and not is_bfloat16(dt):
        raise TypeError(f"dtype must be {want}; got {dt}")
    return dt



def _without_sinks(p: AttentionArgs) -> AttentionArgs:
    """p with no sinks (they join the softmax after the centre's shift is undone)."""
    va = p.variants._replace(sinks=None)
    if va.alibi is None and va == NO_VARIANTS:
        va = NO_VARIANTS
    return p._replace(variants=va)


class KVCache:
    """Keys and values of ``batch`` sequences, preallocated for ``max_len`` tokens.

    ``k`` (batch, heads, max_len, head_dim) and ``v`` (batch, heads, max_len,
    value_dim) are allocated once and never reallocated; ``lengths`` (batch,)
    int64 says how many tokens each sequence holds. ``dtype`` float32,
    float16, bfloat16 (``ml_dtypes.bfloat16`` or ``"bfloat16"``; needs
    ml_dtypes) or int8 (``np.int8`` or ``"int8"``): 16-bit caches take half the
    memory and are read in place; attention is computed in float32 on the
    stored values, and appended values are rounded to nearest, ties to even.

    An int8 cache takes a quarter of float32's memory and a float32 scale a
    (token, head) row: ``k_scale`` (batch, heads, max_len) and ``v_scale``
    beside ``k`` and ``v``. Keys are first centred: each sequence's
    ``k_center`` (batch, heads, 1, head_dim) float32, the mean of the keys
    appended with its token 0 (the prompt; fixed then, kept until token 0 is
    appended again after ``lengths`` went back to 0), is subtracted from
    every key row of it (``center_keys=False``: no centre, k_center None).
    Each row x (a key minus its centre, or a value) is then rotated by a
    fixed orthogonal matrix, ``y = R @ x`` with ``R = k_rotation`` (head_dim,
    head_dim), ``attnx.int8_rotation(head_dim)`` (``v_rotation`` for values;
    both read-only, shared by every int8 cache of the same widths), which
    spreads outlier channels over the whole row; then quantized
    symmetrically, ``scale = max|y| / 127``, rounded to nearest. Row ``k[b,
    h, t]`` stands for ``R.T @ (k_scale[b, h, t] * k[b, h, t]) + k_center[b,
    h, 0]`` (:func:`attnx.dequantize_int8`, plus the centre), within Euclidean
    distance ``sqrt(E) * max|y| / 254 <= sqrt(E) * ||x|| / 254`` of what was
    appended (plus ``sqrt(E) * 2**-150`` when ``max|y|`` is below 127 times
    the smallest normal, ~1.5e-36, where the scale is subnormal). Attention
    reads the int8 values and scales in place, in float32 arithmetic, with
    the queries rotated once before and the output rotated back once after
    (``q · R.T y = (R q) · y``). The centre shifts each query row's scores by
    one amount, ``scale · q · k_center``, which the softmax cancels: the
    output and weights are those of the keys; the lse gets the shift back,
    and sinks join after it. ``softcap`` (tanh does not cancel it) needs
    ``center_keys=False``. For the other dtypes ``k_scale``, ``v_scale``,
    ``k_center``, ``k_rotation`` and ``v_rotation`` are None.

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
                 dtype: DTypeLike = np.float32, center_keys: bool = True):
        self.batch = positive_int(batch, "batch")
        self.heads = positive_int(heads, "heads")
        self.max_len = nonnegative_int(max_len, "max_len")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.value_dim = self.head_dim if value_dim is None else positive_int(value_dim, "value_dim")
        dt = _cache_dtype(dtype)
        center = check_flag(center_keys, "center_keys")
        try:
            self.k: NDArray[Any] = np.zeros((self.batch, self.heads, self.max_len, self.head_dim), dt)
            self.v: NDArray[Any] = np.zeros((self.batch, self.heads, self.max_len, self.value_dim), dt)
        except ValueError:      # NumPy's "array is too big": the sizes' product overflows
            raise ValueError(f"KVCache too big: batch={self.batch} x heads={self.heads} x "
                             f"max_len={self.max_len} x (head_dim={self.head_dim} + value_dim="
                             f"{self.value_dim}) elements of {dt}") from None
        self.lengths: NDArray[np.int64] = np.zeros(self.batch, np.int64)
        self.k_scale: Optional[NDArray[np.float32]] = None
        self.v_scale: Optional[NDArray[np.float32]] = None
        self.k_rotation: Optional[NDArray[np.float64]] = None
        self.v_rotation: Optional[NDArray[np.float64]] = None
        self.k_center: Optional[NDArray[np.float32]] = None
        if dt == np.int8:
            if center:
                self.k_center = np.zeros((self.batch, self.heads, 1, self.head_dim), np.float32)
            self.k_scale = np.zeros((self.batch, self.heads, self.max_len), np.float32)
            self.v_scale = np.zeros((self.batch, self.heads, self.max_len), np.float32)
            # read-only, shared by every int8 cache of the same widths
            self.k_rotation = shared_rotation(self.head_dim)[0]
            self.v_rotation = shared_rotation(self.value_dim)[0]

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, heads={self.heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.k.dtype}, "
                f"lengths={self.lengths.tolist()})")

    def _lengths(self) -> NDArray[np.int64]:
        """``lengths`` as the cache can use it: (batch,) integers in [0, max_len]
        (it is a public attribute: a caller may have set it)."""
        n = np.asarray(self.lengths)
        if n.shape != (self.batch,) or n.dtype.kind not in "iu" or \
                (n.size and (n.min() < 0 or n.max() > self.max_len)):
            raise ValueError(f"KVCache.lengths must be {self.batch} integers in [0, max_len="
                             f"{self.max_len}]; got {n.tolist()!r} ({n.dtype})")
        n = n.astype(np.int64, copy=False)
        return n if n.flags.writeable else n.copy()     # append updates it in place

    def _new(self, x: object, name: str, width: int, starts: Optional[NDArray[np.bool_]] = None,
             ) -> Tuple[NDArray[Any], Optional[NDArray[Any]], Optional[NDArray[np.float32]]]:
        """x as an array of the cache's dtype, (batch, heads, n, width), its
        scales (batch, heads, n) for an int8 cache (else None), and for keys
        of a centring int8 cache the centres (batch, heads, 1, width): those
        of k_center, but for the sequences that ``starts`` (batch,) (they
        append their token 0 now), whose centre is fixed here (else None)."""
        a = float_array(x, name)
        if a.ndim != 4 or a.shape[:2] != (self.batch, self.heads) or a.shape[3] != width:
            raise ValueError(f"{name} must be (batch, heads, n, {width}) = ({self.batch}, "
                             f"{self.heads}, n, {width}); got {shape_str(a)}")
        if self.k.dtype == np.int8:
            rotation = self.k_rotation if name == "k_new" else self.v_rotation
            assert rotation is not None
            if name != "k_new" or self.k_center is None or starts is None:
                return quantize_rotated(a, name, rotation) + (None,)
            return _quantize_centred(a, name, rotation, self.k_center, starts)
        if self.k.dtype == a.dtype:
            return a, None, None
        with np.errstate(over="ignore"):
            stored = a.astype(self.k.dtype)
        overflow = np.isinf(stored) & np.isfinite(a)
        if overflow.any():
            biggest = float(np.max(np.abs(a[overflow].astype(np.float64))))
            name_dt = "bfloat16" if is_bfloat16(self.k.dtype) else "float16"
            limit = 3.3895314e38 if is_bfloat16(self.k.dtype) else 65504
            raise ValueError(f"{name} holds finite values beyond {name_dt}'s range (|x| up to "
                             f"{biggest:g} > {limit:g}), which a {name_dt} cache would store as "
                             f"inf; scale them or use dtype=np.float32")
        return stored, None, None

    def append(self, k_new: object, v_new: object) -> None:
        """Write n new tokens of every sequence after its last one, in place.

        k_new (batch, heads, n, head_dim), v_new (batch, heads, n, value_dim).
        Raises ValueError, writing nothing, when a sequence would pass max_len,
        when a float16 or bfloat16 cache would turn a finite value into inf, or
        when an int8 cache is given NaN or inf.
        """
        lengths = self._lengths()
        k, ks, centre = self._new(k_new, "k_new", self.head_dim, lengths == 0)
        v, vs, _ = self._new(v_new, "v_new", self.value_dim)
        n = k.shape[2]
        if v.shape[2] != n:
            raise ValueError(f"k_new and v_new must hold the same number of tokens; got "
                             f"{shape_str(k)} and {shape_str(v)}")
        if self.batch and int(lengths.max()) + n > self.max_len:
            raise ValueError(f"the cache is full: appending {n} token(s) to lengths "
                             f"{lengths.tolist()} would pass max_len={self.max_len}")
        for b in range(self.batch):
            at = int(lengths[b])
            self.k[b, :, at:at + n] = k[b]
            self.v[b, :, at:at + n] = v[b]
            if self.k_scale is not None and self.v_scale is not None \
                    and ks is not None and vs is not None:
                self.k_scale[b, :, at:at + n] = ks[b]
                self.v_scale[b, :, at:at + n] = vs[b]
        if centre is not None and self.k_center is not None:
            self.k_center[...] = centre
        lengths += n             # in place: the cache's own array, unless a caller replaced it
        self.lengths = lengths

    @overload
    def attend(self, q: object, *, need_weights: Literal[False] = False,
               return_lse: Literal[False] = False, **options: Any,
               ) -> NDArray[np.float32]: ...

    @overload
    def attend(self, q: object, *, need_weights: Literal[True],
               return_lse: Literal[False] = False, **options: Any,
               ) -> Tuple[NDArray[np.float32], NDArray[np.float32]]: ...

    @overload
    def attend(self, q: object, *, need_weights: Literal[False] = False,
               return_lse: Literal[True], **options: Any,
               ) -> Tuple[NDArray[np.float32], NDArray[np.float32]]: ...

    @overload
    def attend(self, q: object, *, need_weights: Literal[True],
               return_lse: Literal[True], **options: Any,
               ) -> Tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]: ...

    @overload
    def attend(self, q: object, *, need_weights: bool = False,
               return_lse: bool = False, **options: Any,
               ) -> Union[NDArray[np.float32], Tuple[NDArray[np.float32], NDArray[np.float32]],
                        Tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]]: ...

    def attend(self, q: object, **options: Any) -> Any:
        """Attention of n new queries over the cache, causal from the bottom right.

        q (batch, Hq, n, head_dim), Hq a multiple of heads (grouped-query
        attention); query i of sequence b sees keys j <= lengths[b] - n + i.
        options: any keyword of :func:`attnx.scaled_dot_product_attention` but
        ``is_causal`` and the layout (scale, window, sinks, softcap,
        alibi_slopes, precision, return_lse, need_weights). Returns what that
        function returns.

        ``attn_mask`` (bool, True = may attend, or additive float),
        broadcastable to (batch, Hq, n, length), is combined with the causal
        mask by AND, as a left-padded batch's padding mask is: the sequences
        must then have one length.

        When the sequences' ``lengths`` differ (set through ``lengths``), each is
        computed over its own keys, with its own row of a per-sequence ``sinks``,
        ``alibi_slopes`` (batch, Hq) or ``query_lengths`` (batch,); the weights
        are then (batch, Hq, n, max(lengths)), zero past a sequence's length.
        """
        for bad in ("is_causal", "key_lengths", "layout", "enable_gqa"):
            if bad in options:
                raise TypeError(f"KVCache.attend sets {bad} itself; got {bad}={options[bad]!r}")
        qa = float_array(q, "q")
        if qa.ndim != 4 or qa.shape[0] != self.batch or qa.shape[3] != self.head_dim:
            raise ValueError(f"q must be (batch, Hq, n, head_dim) = ({self.batch}, Hq, n, "
                             f"{self.head_dim}); got {shape_str(qa)}")
        kw = dict(options, is_causal="lower_right", enable_gqa=True)
        lengths = self._lengths()
        if options.get("attn_mask") is not None and not (lengths == lengths[:1]).all():
            raise ValueError(f"KVCache.attend: attn_mask needs sequences of one length; "
                             f"lengths are {lengths.tolist()}")
        if self.batch and (lengths == lengths[0]).all():
            L = int(lengths[0])       # one call over the filled part: views, no copy
            return self._attend(qa, slice(None), L, kw)
        parts = [self._attend(qa[b:b + 1], slice(b, b + 1), int(n), self._row(kw, b))
                 for b, n in enumerate(lengths)]
        if not isinstance(parts[0], tuple):
            return np.concatenate(parts)
        if options.get("need_weights"):      # (1, Hq, n, lengths[b]): zeros up to the longest
            L = int(lengths.max())
            parts = [(p[0], np.pad(p[1], [(0, 0)] * 3 + [(0, L - p[1].shape[3])])) + p[2:]
                     for p in parts]
        return tuple(np.concatenate(x) for x in zip(*parts))

    def _attend(self, q: NDArray[Any], rows: slice, L: int, kw: dict[str, Any]) -> Any:
        """Attention of q over the first L tokens of sequences ``rows``, read in place."""
        k, v = self.k[rows, :, :L], self.v[rows, :, :L]
        if self.k_scale is None or self.v_scale is None:
            return scaled_dot_product_attention(q, k, v, **kw)
        return _int8_attend(self, q, rows, L, kw)

    def _row(self, kw: dict[str, Any], b: int) -> dict[str, Any]:
        """Sequence b's options: row b of a per-sequence sinks/alibi_slopes
        (batch, Hq) or query_lengths (batch,); the others as they are."""
        row = dict(kw)
        for name, ndim in (("sinks", 2), ("alibi_slopes", 2), ("query_lengths", 1)):
            if kw.get(name) is not None:
                a = as_array(kw[name], name)
                if a.ndim == ndim and a.shape[0] == self.batch:
                    row[name] = a[b:b + 1]
        return row


def _int8_attend(cache: KVCache, q: NDArray[Any], rows: slice, L: int,
                 kw: dict[str, Any]) -> Any:
    """KVCache._attend over an int8 cache: the rows read in place, the queries
    rotated before and the output after, the lse given the centre's shift."""
    k, v = cache.k[rows, :, :L], cache.v[rows, :, :L]
    assert cache.k_scale is not None and cache.v_scale is not None
    opts = dict(kw)
    need_weights = check_flag(opts.pop("need_weights", False), "need_weights")
    return_lse = check_flag(opts.pop("return_lse", False), "return_lse")
    check_names(opts, OPTIONS | {"is_causal", "enable_gqa", "scale", "dropout_p", "attn_mask"},
                "KVCache.attend")
    is_causal, enable_gqa = opts.pop("is_causal"), opts.pop("enable_gqa")
    scale, dropout_p = opts.pop("scale", None), opts.pop("dropout_p", 0.0)
    attn_mask = opts.pop("attn_mask", None)

    def shape_only(a: NDArray[Any]) -> NDArray[np.float32]:   # float32 zeros, no memory
        return np.broadcast_to(np.zeros(a.shape[-1], np.float32), a.shape)
    qr = rotate(q, cache.k_rotation)      # q · Rᵀy = (R q) · y: the stored rows as they are
    p = attention_args(qr, shape_only(k), shape_only(v), attn_mask, dropout_p, is_causal, scale,
                       enable_gqa, **opts).astype(np.float32, half_kv=True)
    int8_kv = ((k, cache.k_scale[rows, :, :L, None]), (v, cache.v_scale[rows, :, :L, None]))
    if cache.k_center is None or (p.variants.sinks is None and not return_lse
                                 and not p.variants.softcap):
        # the centre's shift cancels in the output and weights: only the lse
        # and the sinks see it
        return rotate_back(forward(p, need_weights, return_lse, int8_kv), cache.v_rotation)
    if p.variants.softcap:
        raise ValueError("softcap needs the scores themselves, and this int8 cache stores keys "
                         "minus a centre (their shift cancels in a softmax, not under tanh): "
                         "use KVCache(..., center_keys=False) with softcap")
    sinks = p.variants.sinks         # joined after the shift back: computed without them
    res = forward(_without_sinks(p), need_weights, True, int8_kv)
    return recenter(rotate_back(res, cache.v_rotation), q, cache.k_center[rows], p.scale, sinks,
                    need_weights, return_lse)


def _quantize_centred(a: NDArray[Any], name: str, rotation: NDArray[np.float64],
                      centers: NDArray[np.float32], starts: NDArray[np.bool_],
                      ) -> Tuple[NDArray[np.int8], NDArray[np.float32], NDArray[np.float32]]:
    """Keys (batch, heads, n, E) minus their sequence's centre, rotated and
    quantized; the centres (batch, heads, 1, E) are ``centers`` but for the
    sequences that ``starts`` (batch,), fixed here from these keys."""
    centre = centers.copy()
    if a.shape[2]:       # (non-finite keys: quantize_rotated refuses them, writing nothing)
        centre[starts] = fit_center(a[starts].astype(np.float64))
    stored, scales = quantize_rotated(a, name, rotation, centre)
    return stored, scales, centre
