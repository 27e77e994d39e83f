"""``scaled_dot_product_attention``: argument normalisation around the C core.

Everything here is cheap NumPy bookkeeping on views: dtype conversion (only
when needed), layout and batch-dimension reshapes, mask broadcasting as
strides, lengths checks. The arithmetic runs in ``attnx._attnx`` (C).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterator, List, Literal, NamedTuple, Optional, Protocol, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attnx

__all__ = ["scaled_dot_product_attention", "ArrayInput", "Causal", "Layout"]


class SupportsDLPack(Protocol):
    """An object exporting its memory through DLPack (``numpy.from_dlpack`` reads it)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Any: ...


#: What the array arguments accept: NumPy arrays, nested sequences, anything
#: with ``__array__`` (PyTorch CPU tensors, pandas, xarray, ...) or DLPack.
ArrayInput = Union[ArrayLike, SupportsDLPack]
#: ``is_causal``: False, True (= "upper_left"), "upper_left", "top_left" or "lower_right".
Causal = Union[bool, Literal["upper_left", "top_left", "lower_right"]]
#: ``layout``: (B..., H, L, E) or (B..., L, H, E).
Layout = Literal["bhld", "blhd"]

_FLOAT_KINDS = (np.float16, np.float32, np.float64)
_F32 = np.dtype(np.float32)
# is_causal -> the core's code (csrc/attnx.h's attnx_causal, exported by the extension)
_CAUSAL = {False: _attnx.CAUSAL_NONE, True: _attnx.CAUSAL_UPPER_LEFT,
           "upper_left": _attnx.CAUSAL_UPPER_LEFT, "top_left": _attnx.CAUSAL_UPPER_LEFT,
           "lower_right": _attnx.CAUSAL_LOWER_RIGHT}
#: the core's code -> the is_causal value that means it (for attnx.reference)
_CAUSAL_ARG: Dict[int, "Causal"] = {_attnx.CAUSAL_NONE: False, _attnx.CAUSAL_UPPER_LEFT: True,
                                    _attnx.CAUSAL_LOWER_RIGHT: "lower_right"}


def _default_scale(E: int) -> float:
    """1/sqrt(E), PyTorch's default; 1 for an empty head dimension."""
    return 1.0 / math.sqrt(E) if E > 0 else 1.0


def _shape(a: NDArray[Any]) -> str:
    return "(" + ", ".join(str(n) for n in a.shape) + ("," if a.ndim == 1 else "") + ")"


def _asarray(x: object, name: str, float32_range: bool = True) -> NDArray[Any]:
    """``x`` as an ndarray, sharing its memory whenever NumPy can (no copy).

    Accepts NumPy arrays, sequences, objects with ``__array__`` (a PyTorch CPU
    tensor gives a view of its memory) and objects with only ``__dlpack__``
    (read with ``np.from_dlpack``, also without a copy). A tensor that
    requires grad is read through ``x.detach()``, a new tensor sharing the
    same memory: the caller's tensor is never modified. A tensor with its
    negative or conjugate bit set (``is_neg()``/``is_conj()``, lazy views
    such as ``z.conj().imag``) is read through ``resolve_neg()`` /
    ``resolve_conj()`` (a copy holding the values it shows). torch is never
    imported here.

    Refused with TypeError naming ``name``: masked arrays (their mask would
    be dropped), objects whose own ``__array__`` fails (sparse, quantized,
    bfloat16, non-CPU tensors...: DLPack is not tried then, as it may drop
    what made the conversion fail). With ``float32_range``, a float64 array
    holding finite values beyond float32's range raises ValueError (see
    :func:`_check_float32_range`). MemoryError propagates.
    """
    if type(x) is np.ndarray:
        a: Optional[NDArray[Any]] = x
    elif isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array (numpy.ma): attnx would ignore its mask. Pass padding "
            f"as key_lengths/query_lengths or as attn_mask (bool, True = may attend), or fill "
            f"the masked entries explicitly: {name}.filled(value), e.g. {name}.filled(0)")
    elif isinstance(x, np.ndarray):  # a subclass (np.matrix, ...): its data, as a view
        a = np.asarray(x)
    else:
        a = _asarray_foreign(x, name)
    assert a is not None
    if float32_range:
        _check_float32_range(a, name)
    return a


def _bit_set(x: object, method: str) -> bool:
    """Whether ``x.method()`` (``is_neg``, ``is_conj``: torch's lazy negation
    and conjugation bits, which ``__dlpack__`` does not export) returns True."""
    f = getattr(x, method, None)
    if not callable(f):
        return False
    try:
        return f() is True
    except Exception:  # not torch's method: an unrelated attribute of that name
        return False


def _asarray_foreign(x: object, name: str) -> NDArray[Any]:
    """:func:`_asarray` for objects that are not ndarrays."""
    if getattr(x, "requires_grad", False) is True:
        detach = getattr(x, "detach", None)
        if callable(detach):
            x = detach()
    for bit, resolve, what in (("is_neg", "resolve_neg", "negative"),
                               ("is_conj", "resolve_conj", "conjugate")):
        if _bit_set(x, bit):
            f = getattr(x, resolve, None)
            if not callable(f):
                raise TypeError(f"{name} has its {what} bit set ({bit}() is True) and no "
                                f"{resolve}(): its memory does not hold its values")
            x = f()
            if _bit_set(x, bit):
                raise TypeError(f"{name} still has its {what} bit set after {resolve}()")
    error: Optional[Exception] = None
    a: Optional[NDArray[Any]] = None
    try:
        a = np.asarray(x)
    except MemoryError:
        raise
    except Exception as exc:  # e.g. a ragged list, a GPU, sparse or bfloat16 tensor
        error = exc
    # DLPack only for objects NumPy did not recognise (an object array): when
    # the object's own conversion refused it, DLPack may export memory without
    # what made it refuse (a lazy bit, a zero tensor's missing storage)
    if a is not None and a.dtype == object and hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except MemoryError:
            raise
        except Exception as exc:
            error = exc
            a = None
    if a is None:
        dtype = getattr(x, "dtype", None)
        what = type(x).__name__ + (f" of dtype {dtype}" if dtype is not None else "")
        raise TypeError(f"{name} must be array-like (a NumPy array, a CPU tensor, anything with "
                        f"__array__ or __dlpack__); got {what}: {error}") from None
    return a


_F32_MAX = float(np.finfo(np.float32).max)


def _check_float32_range(a: NDArray[Any], name: str) -> None:
    """ValueError naming ``name`` when a float64 array holds finite values
    beyond float32's range (|x| > 3.4028235e38): attnx computes in float32,
    where they would overflow to +-inf (the kernels and ``attnx.reference``,
    which computes in float64, would disagree). inf and NaN pass. Two
    reductions without temporaries in the common case."""
    if a.dtype.kind != "f" or a.dtype.itemsize <= 4 or a.size == 0:
        return
    lo, hi = np.fmin.reduce(a, axis=None), np.fmax.reduce(a, axis=None)   # NaN ignored
    if -_F32_MAX <= lo and hi <= _F32_MAX:
        return
    with np.errstate(invalid="ignore"):
        out = (a > _F32_MAX) | (a < -_F32_MAX)
    out &= np.isfinite(a)
    if not out.any():          # only inf (or NaN) beyond the range
        return
    bad = a[out]
    hint = (" To block keys use -np.inf or a bool mask (True = may attend), not "
            "np.finfo(np.float64).min or -1e300; np.finfo(np.float32).min also fits."
            if "mask" in name else " Rescale it, or convert it to float32 yourself.")
    raise ValueError(
        f"{name} (float64) holds {bad.size} finite value(s) beyond float32's range, e.g. "
        f"{bad.flat[0]:g} (|x| > {_F32_MAX:g}); attnx computes in float32, where they would "
        f"overflow to inf.{hint}")


def _check_flag(value: object, name: str) -> bool:
    """``value`` as a Python bool; TypeError naming ``name`` unless it is a bool or
    a NumPy bool (a truthy string such as ``"no"`` is not taken as True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False); got {type(value).__name__} {value!r}")


def _as_float(x: object, name: str, dtype: type[np.floating[Any]] = np.float32) -> NDArray[Any]:
    """x as an ndarray of ``dtype``; float16/32/64 are converted, other kinds raise."""
    a = _asarray(x, name)
    if a.dtype.type not in _FLOAT_KINDS:
        raise TypeError(
            f"{name} must be float16, float32 or float64 (computed in float32); "
            f"got dtype {a.dtype} with shape {_shape(a)}")
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a


def _unit_last_stride(a: NDArray[Any]) -> NDArray[Any]:
    """A view of ``a`` whose last axis is contiguous and aligned (copies only if not)."""
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    if not a.flags.aligned:
        return a.copy()
    return a


def _lengths(x: object, name: str, batch_shape: Tuple[int, ...], limit: int, B: int, H: int,
             heads_are_batch: bool) -> NDArray[np.int64]:
    """Lengths as an int64 (B, H) array (a broadcast view), checked in [0, limit]."""
    a = _asarray(x, name)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array; got dtype {a.dtype} with shape {_shape(a)}")
    target = batch_shape
    try:
        a = np.broadcast_to(a, target)
    except ValueError:
        raise ValueError(
            f"{name} with shape {_shape(a)} does not broadcast to the batch shape "
            f"{tuple(target)}") from None
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} must lie in [0, {limit}]; got values from {a.min()} to {a.max()}")
    a = np.require(a, dtype=np.int64, requirements=["C", "A"]).reshape(-1)   # contiguous, aligned
    if heads_are_batch:           # no head axis: one length per leading row
        return a.reshape(B, H)
    return np.broadcast_to(a.reshape(B, 1), (B, H))


class _Prepared(NamedTuple):
    """The checked arguments: views with every batch axis kept (the core's
    (B, H, L, E) views come from :func:`_core_calls`), and flags."""

    q: NDArray[Any]                         # (batch..., Hq, Lq, E)
    k: NDArray[Any]                         # (batch..., Hk, Lk, E)
    v: NDArray[Any]                         # (batch..., Hk, Lk, Ev)
    mask: Optional[NDArray[Any]]            # (batch..., Hq, Lq, Lk), bool or float, any strides
    key_lengths: Optional[NDArray[np.int64]]    # (B, Hq), B = prod(batch), C-contiguous rows
    query_lengths: Optional[NDArray[np.int64]]  # (B, Hq)
    causal: int                             # 0 none, 1 upper-left, 2 lower-right
    scale: float
    batch_shape: Tuple[int, ...]
    layout: str
    ndim: int

    def folded(self) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any], Optional[NDArray[Any]]]:
        """q, k, v and mask with the batch axes folded into one (copies where a view cannot)."""
        B = math.prod(self.batch_shape)
        q, k, v = (a.reshape((B,) + a.shape[-3:]) for a in (self.q, self.k, self.v))
        m = None if self.mask is None else self.mask.reshape((B,) + self.mask.shape[-3:])
        return q, k, v, m


class _CoreCall(NamedTuple):
    """One call of the core: (B, H, L, .) views of the inputs and outputs."""

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any]
    mask: Optional[NDArray[Any]]
    key_lengths: Optional[NDArray[np.int64]]
    query_lengths: Optional[NDArray[np.int64]]
    out: NDArray[Any]
    weights: Optional[NDArray[Any]]
    lse: Optional[NDArray[Any]]


def _fold_batch(a: NDArray[Any], nb: int) -> Optional[NDArray[Any]]:
    """A view of ``a`` with its first ``nb`` axes folded into one, or None when
    that needs a copy (e.g. a mask broadcast along one batch axis but not
    another). ``nb = 0`` adds an axis of size 1."""
    B = math.prod(a.shape[:nb])
    if a.size == 0:
        return a.reshape((B,) + a.shape[nb:])
    axes = [(n, st) for n, st in zip(a.shape[:nb], a.strides[:nb]) if n != 1]
    for (_, st0), (n1, st1) in zip(axes, axes[1:]):
        if st0 != st1 * n1:
            return None
    stride = axes[-1][1] if axes else 0
    return np.lib.stride_tricks.as_strided(a, (B,) + a.shape[nb:], (stride,) + a.strides[nb:],
                                           writeable=a.flags.writeable)


Arrays = List[Optional[NDArray[Any]]]


def _fold_calls(batch_shape: Tuple[int, ...], arrays: Arrays,
                lengths: Arrays) -> Iterator[Tuple[Arrays, Arrays]]:
    """Views for the core calls over ``arrays`` (each (batch..., rest) or None)
    and ``lengths`` (each (B, H) with B = prod(batch), or None): one call with
    the batch axes folded into one, or, where folding an array would copy it
    (a broadcast or strided batch axis), one per index of the first batch
    axis, recursively. Nothing is ever expanded or copied."""
    nb = len(batch_shape)
    folded = [None if a is None else _fold_batch(a, nb) for a in arrays]
    if all(f is not None for f, a in zip(folded, arrays) if a is not None):
        yield folded, lengths
        return
    n0 = batch_shape[0]
    for i in range(n0):
        yield from _fold_calls(
            batch_shape[1:], [None if a is None else a[i] for a in arrays],
            [None if a is None else a.reshape((n0, -1) + a.shape[1:])[i] for a in lengths])


def _core_calls(p: _Prepared, out: NDArray[Any], weights: Optional[NDArray[Any]],
                lse: Optional[NDArray[Any]] = None) -> Iterator[_CoreCall]:
    """The forward's core calls into ``out`` (batch..., Hq, Lq, Ev), ``weights``
    (batch..., Hq, Lq, Lk) and ``lse`` (batch..., Hq, Lq, 1): see _fold_calls."""
    for (q, k, v, m, o, w, l4), (kl, ql) in _fold_calls(
            p.batch_shape, [p.q, p.k, p.v, p.mask, out, weights, lse],
            [p.key_lengths, p.query_lengths]):
        assert q is not None and k is not None and v is not None and o is not None
        yield _CoreCall(q, k, v, m, kl, ql, o, w, l4)


def _core_layout(query: object, key: object, value: object, layout: object,
                 dtype: type[np.floating[Any]]) -> Tuple[NDArray[Any], ...]:
    """The inputs converted to ``dtype`` as (lead..., H, L, E) views (blhd swapped,
    2-D given a leading axis), and the converted inputs as passed (for messages)."""
    q = q0 = _as_float(query, "query", dtype)
    k = k0 = _as_float(key, "key", dtype)
    v = v0 = _as_float(value, "value", dtype)
    if layout not in ("bhld", "blhd"):
        raise ValueError(f'layout must be "bhld" or "blhd"; got {layout!r}')
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions; got "
            f"query {_shape(q)}, key {_shape(k)}, value {_shape(v)}")
    if q.ndim < 2:
        raise ValueError(f"query, key and value must be at least 2-D (L, E); got query {_shape(q)}")
    if layout == "blhd":
        if q.ndim < 3:
            raise ValueError(f'layout="blhd" needs (B..., L, H, E) inputs, at least 3-D; got query {_shape(q)}')
        q, k, v = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    if q.ndim == 2:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, q0, k0, v0


def _check_shapes(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], originals: Tuple[NDArray[Any], ...],
                  enable_gqa: bool, three_d: bool) -> None:
    """q (lead..., Hq, Lq, E), k (lead..., Hk, Lk, E), v (lead..., Hk, Lk, Ev) agree."""
    Hq, E = q.shape[-3], q.shape[-1]
    Hk, Lk, Ek = k.shape[-3:]
    Hv, Lv = v.shape[-3:-1]
    shapes = "query {}, key {}, value {}".format(*(_shape(a) for a in originals))
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        raise ValueError(f"query, key and value must have the same batch dimensions; got {shapes}")
    if Ek != E:
        raise ValueError(f"query and key must have the same last dimension E; got {shapes}")
    if Lv != Lk or Hv != Hk:
        raise ValueError(f"key and value must have the same heads and length; got {shapes}")
    if Hq != Hk:
        if not enable_gqa:
            raise ValueError(
                f"query has N={Hq} but key/value have N={Hk}: for 3-D (N, L, E) inputs the first "
                f"axis N (the batch, or the heads) must match; grouped-query attention "
                f"(enable_gqa=True) is for 4-D (B, H, L, E) inputs; got {shapes}"
                if three_d else
                f"query has {Hq} heads but key/value have {Hk}; pass enable_gqa=True for "
                f"grouped-query attention; got {shapes}")
        if Hk == 0 or Hq % Hk:
            raise ValueError(
                f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads ({Hk}); got {shapes}")


def _causal_code(is_causal: object) -> int:
    """is_causal as the core's code: 0 none, 1 upper-left, 2 lower-right."""
    if isinstance(is_causal, (bool, np.bool_)):
        return _CAUSAL[bool(is_causal)]
    if isinstance(is_causal, str) and is_causal in _CAUSAL:
        return _CAUSAL[is_causal]
    raise ValueError(f'is_causal must be False, True, "upper_left" or "lower_right"; got {is_causal!r}')


def _scale_value(scale: object, E: int) -> float:
    """The scale as a finite float (default 1/sqrt(E))."""
    if scale is None:
        return _default_scale(E)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
    try:
        scale_f = float(scale)
    except OverflowError:        # an int beyond float range
        scale_f = math.inf
    if not math.isfinite(scale_f):
        raise ValueError(f"scale must be finite; got {scale_f}")
    return scale_f


def _mask_view(attn_mask: object, full: Tuple[int, ...],
               dtype: type[np.floating[Any]]) -> NDArray[Any]:
    """The mask, bool or ``dtype``, as a broadcast view of shape ``full`` (never expanded)."""
    m = m0 = _asarray(attn_mask, "attn_mask")
    if m.dtype != np.bool_:
        if m.dtype.type not in _FLOAT_KINDS:
            raise TypeError(
                f"attn_mask must be bool (True = attend) or float (added to the scores); got dtype "
                f"{m.dtype} with shape {_shape(m)}. For a 0/1 integer mask pass mask.astype(bool) "
                f"if 1 means attend, or mask == 0 if 1 means blocked")
        if m.dtype != dtype:
            m = m.astype(dtype)
    if not m.flags.aligned:      # before broadcasting: never copy an expanded view
        m = m.copy()
    if m.ndim > len(full):
        raise ValueError(f"attn_mask with shape {_shape(m)} has more dimensions than the scores {full}")
    try:
        return np.broadcast_to(m, full)
    except ValueError:
        raise ValueError(
            f"attn_mask with shape {_shape(m0)} does not broadcast to the "
            f"scores' shape (B..., Hq, Lq, Lk) = {full}") from None


def _prepare(query: object, key: object, value: object, attn_mask: object, dropout_p: object,
             is_causal: object, scale: object, enable_gqa: bool, layout: object,
             key_lengths: object, query_lengths: object,
             dtype: type[np.floating[Any]]) -> _Prepared:
    """Check and normalise the public arguments (see scaled_dot_product_attention);
    ``dtype`` is float32 for the core, float64 for the reference."""
    enable_gqa = _check_flag(enable_gqa, "enable_gqa")
    q, k, v, *originals = _core_layout(query, key, value, layout, dtype)
    nd = originals[0].ndim
    heads_are_batch = nd == 3 and layout == "bhld"
    _check_shapes(q, k, v, tuple(originals), enable_gqa, heads_are_batch)
    if dropout_p != 0.0 or not isinstance(dropout_p, (float, int, np.floating, np.integer)):
        raise ValueError(f"dropout_p must be 0.0 (attnx computes inference attention); got {dropout_p!r}")
    causal = _causal_code(is_causal)
    Hq, Lq, E = q.shape[-3:]
    Lk = k.shape[-2]
    scale_f = _scale_value(scale, E)
    batch_shape = q.shape[:-3]
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    mask = None if attn_mask is None else _mask_view(attn_mask, batch_shape + (Hq, Lq, Lk), dtype)

    B = math.prod(batch_shape)
    lead = (Hq,) if heads_are_batch else batch_shape
    kl = ql = None
    if key_lengths is not None:
        kl = _lengths(key_lengths, "key_lengths", lead, Lk, B, Hq, heads_are_batch)
    if query_lengths is not None:
        ql = _lengths(query_lengths, "query_lengths", lead, Lq, B, Hq, heads_are_batch)
    return _Prepared(q, k, v, mask, kl, ql, causal, scale_f, batch_shape, str(layout), nd)


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: Literal[False] = False, return_lse: Literal[False] = False) -> NDArray[np.float32]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: Literal[True], return_lse: Literal[False] = False) -> Tuple[NDArray[np.float32], NDArray[np.float32]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: Literal[False] = False, return_lse: Literal[True]) -> Tuple[NDArray[np.float32], NDArray[np.float32]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: Literal[True], return_lse: Literal[True]) -> Tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: bool = False, return_lse: Literal[False] = False,
) -> Union[NDArray[np.float32], Tuple[NDArray[np.float32], NDArray[np.float32]]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: bool = False, return_lse: bool = False,
) -> Union[NDArray[np.float32], Tuple[NDArray[np.float32], NDArray[np.float32]], Tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]]: ...


def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput,
        attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        layout: Layout = "bhld", key_lengths: Optional[ArrayInput] = None,
        query_lengths: Optional[ArrayInput] = None,
        need_weights: bool = False, return_lse: bool = False,
) -> Union[NDArray[np.float32], Tuple[NDArray[np.float32], NDArray[np.float32]], Tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]]:
    """Masked multi-head scaled dot-product attention, ``softmax(Q Kᵀ · scale + mask) V``.

    Names and argument order follow ``torch.nn.functional.scaled_dot_product_attention``,
    so code ports by changing the import. Computed in float32 by the C core.

    Parameters
    ----------
    query : array_like, (B..., Hq, Lq, E)
        With ``layout="blhd"``: (B..., Lq, Hq, E). 2-D (Lq, E) and 3-D (N, Lq, E)
        inputs work as in the tutorials: no head axis is needed.
    key : array_like, (B..., Hk, Lk, E)   (``"blhd"``: (B..., Lk, Hk, E))
    value : array_like, (B..., Hk, Lk, Ev)   (``"blhd"``: (B..., Lk, Hk, Ev))
    attn_mask : array_like, optional
        bool: True = may attend (PyTorch SDPA convention). float: added to the
        scores (use -inf to block). Broadcastable to (B..., Hq, Lq, Lk); a
        broadcast mask is read through strides, never expanded.
    dropout_p : float
        Must be 0.0: attnx computes inference attention.
    is_causal : bool or str
        True or "upper_left": query i sees keys j <= i (PyTorch). "lower_right":
        query i sees keys j <= i + Lk - Lq (the last query sees every key, as
        when decoding with a KV cache). Combined with ``attn_mask`` and the
        lengths by AND.
    scale : float, optional
        Defaults to 1/sqrt(E). Must be finite.
    enable_gqa : bool
        Allow Hq to be a multiple of Hk (grouped-query attention): query head h
        uses key/value head h // (Hq // Hk).
    layout : {"bhld", "blhd"}
        Axis order of query, key, value and the output.
    key_lengths, query_lengths : array_like of int, optional
        Shape (B...) (for 3-D inputs, (N,)). Keys at positions >= key_lengths
        are ignored; query rows at positions >= query_lengths give zeros. This
        is the padding mask without building it.
    need_weights : bool
        Also return the attention weights, (B..., Hq, Lq, Lk), float32.
    return_lse : bool
        Also return ``lse``, (B..., Hq, Lq) float32 (whatever the layout): the
        natural log of each row's softmax denominator, ``log sum_j exp(s_ij)``
        over the row's allowed scaled, masked scores; ``-inf`` for a row with
        no allowed key (and rows past ``query_lengths``). What the backward
        pass and :func:`attnx.merge_attention` take.

    Returns
    -------
    out : ndarray, float32, (B..., Hq, Lq, Ev)   (``"blhd"``: (B..., Lq, Hq, Ev))
    weights : ndarray, float32, (B..., Hq, Lq, Lk); only when ``need_weights``.
    lse : ndarray, float32, (B..., Hq, Lq); only when ``return_lse`` (last).

    A row with no allowed key gives zeros (output and weights), never NaN;
    NaN and inf in the inputs propagate. The inputs are never modified.

    Every array argument may be a NumPy array, a nested sequence, a PyTorch
    CPU tensor (also one that requires grad: it is read through
    ``.detach()``, and no gradient flows back), or any object with
    ``__array__`` or ``__dlpack__``. float32 inputs are read in place, without
    a copy, whenever their last axis is contiguous (a transposed or sliced
    tensor is read through its strides); float16/float64 are converted. The
    result is always a NumPy array.

    Masks from other conventions (True/1 = *blocked*, as in PyTorch tutorials'
    ``scores.masked_fill(mask == 1, -inf)`` or ``torch.nn.MultiheadAttention``;
    0 = blocked, as in NumPy tutorials' ``np.where(mask == 0, -1e9, scores)``): pass
    ``attn_mask=(m == 0)``, ``attn_mask=~m`` or ``attn_mask=(m != 0)``; see
    :func:`attnx.causal_mask` and :func:`attnx.padding_mask` for building them.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 16), dtype=np.float32) for _ in range(3))
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 10, 16)

    Padding (the second sequence has 6 real keys) with the weights:

    >>> out, w = attnx.scaled_dot_product_attention(q, k, v, key_lengths=[10, 6],
    ...                                             need_weights=True)
    >>> out.shape, w.shape, float(w[1, :, :, 6:].sum())
    ((2, 4, 10, 16), (2, 4, 10, 10), 0.0)

    A bool mask, True = may attend, broadcast over batch and heads:

    >>> mask = attnx.causal_mask(10)                      # (Lq, Lk)
    >>> np.allclose(attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    ...             attnx.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
    """
    need_weights = _check_flag(need_weights, "need_weights")
    return_lse = _check_flag(return_lse, "return_lse")
    if (attn_mask is None and key_lengths is None and query_lengths is None and need_weights is False
            and return_lse is False and layout == "bhld" and enable_gqa is False):
        out_fast = _fast_path(query, key, value, dropout_p, is_causal, scale)
        if out_fast is not None:
            return out_fast
    p = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 layout, key_lengths, query_lengths, np.float32)
    out, out_v, weights = _allocate(p, need_weights, np.float32)
    lse = np.empty(p.batch_shape + p.q.shape[-3:-1], np.float32) if return_lse else None
    for c in _core_calls(p, out_v, weights, None if lse is None else lse[..., None]):
        _attnx.forward(c.q, c.k, c.v, c.out, c.weights, c.mask, c.key_lengths, c.query_lengths,
                       p.causal, p.scale, c.lse)
    result = _finish(p, out, weights, need_weights)
    if lse is None:
        return result
    lse_out = lse[0] if p.ndim == 2 else lse
    return (*result, lse_out) if isinstance(result, tuple) else (result, lse_out)


def _fast_path(q: object, k: object, v: object, dropout_p: object, is_causal: object,
               scale: object) -> Optional[NDArray[np.float32]]:
    """The common call, (B, H, L, E) float32 arrays and no options, with only
    the checks it needs (a few microseconds less per call, which is most of
    the overhead of a small problem). None: take the general path, which
    also words every error message."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    if not (q.dtype == _F32 and k.dtype == _F32 and v.dtype == _F32
            and q.ndim == 4 and k.ndim == 4 and v.ndim == 4):
        return None
    B, H, Lq, E = q.shape
    if not (k.shape[:2] == (B, H) and v.shape[:3] == k.shape[:3] and k.shape[3] == E):
        return None
    if not (q.strides[3] == 4 and k.strides[3] == 4 and v.strides[3] == 4
            and q.flags.aligned and k.flags.aligned and v.flags.aligned):
        return None
    if not (type(dropout_p) is float and dropout_p == 0.0 and (is_causal is False or is_causal is True)):
        return None
    if scale is None:
        scale_f = _default_scale(E)
    elif type(scale) is float and math.isfinite(scale):
        scale_f = scale
    else:
        return None
    out = np.empty((B, H, Lq, v.shape[3]), dtype=np.float32)
    _attnx.forward(q, k, v, out, None, None, None, None, _CAUSAL[is_causal], scale_f)
    return out


def _allocate(p: _Prepared, need_weights: bool, dtype: type[np.floating[Any]]) -> Tuple[
        NDArray[Any], NDArray[Any], Optional[NDArray[Any]]]:
    """The output in the caller's layout, its (batch..., Hq, Lq, Ev) view, and
    the weights (batch..., Hq, Lq, Lk) or None."""
    Hq, Lq = p.q.shape[-3:-1]
    Lk, Ev = p.k.shape[-2], p.v.shape[-1]
    if p.layout == "blhd":
        out = np.empty(p.batch_shape + (Lq, Hq, Ev), dtype=dtype)
        out_v = np.swapaxes(out, -2, -3)
    else:
        out = out_v = np.empty(p.batch_shape + (Hq, Lq, Ev), dtype=dtype)
    weights = np.empty(p.batch_shape + (Hq, Lq, Lk), dtype=dtype) if need_weights else None
    return out, out_v, weights


def _finish(p: _Prepared, out: NDArray[Any], weights: Optional[NDArray[Any]],
            need_weights: bool) -> Union[NDArray[Any], Tuple[NDArray[Any], NDArray[Any]]]:
    if p.ndim == 2:  # no head axis was given: drop the one added
        out = out[0]
        weights = weights[0] if weights is not None else None
    if need_weights:
        assert weights is not None
        return out, weights
    return out
