"""Array arguments: any array-like as an ndarray, and the checks on its dtype.

* :func:`as_array` turns any array argument into an ndarray (tensors,
  ``__array__``, DLPack, lazy torch bits resolved, masked arrays refused,
  float64 beyond float32's range refused); :func:`float_array` and
  :func:`as_float` add the float check (float16/32/64 and bfloat16) and the conversion.
* bfloat16: recognised by its name (``ml_dtypes.bfloat16``), read from torch
  tensors through their bits (:func:`torch_bfloat16`).

Part of :mod:`attnx._args`, which re-exports every public name here.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Protocol, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray


class SupportsDLPack(Protocol):
    """An object exporting its memory through DLPack (``numpy.from_dlpack`` reads it)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Any: ...


#: What the array arguments accept: NumPy arrays, nested sequences, anything
#: with ``__array__`` (PyTorch CPU tensors, pandas, xarray, ...) or DLPack.
ArrayInput = Union[ArrayLike, SupportsDLPack]
F32 = NDArray[np.float32]

_FLOAT_KINDS = (np.float16, np.float32, np.float64)


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is bfloat16: ``ml_dtypes.bfloat16``, the NumPy dtype that
    JAX, ONNX and TensorFlow use, recognised by its name and size (attnx never
    imports ml_dtypes: an array of that dtype means the caller already did)."""
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


#: ml_dtypes' bfloat16 dtype once imported (looked up again while it is missing)
_ML_BFLOAT16: Any = None


def bfloat16_arrays() -> bool:
    """Whether bfloat16 tensors become bfloat16 arrays (ml_dtypes is installed:
    imported here, at the first bfloat16 tensor, never by ``import attnx``).
    Without it they become float32 arrays of the same values, which the core
    computes with float32 products, never its bfloat16 dot products."""
    global _ML_BFLOAT16
    if not isinstance(_ML_BFLOAT16, np.dtype) or sys.modules.get("ml_dtypes") is None:
        try:
            import ml_dtypes
            _ML_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            _ML_BFLOAT16 = False
    return _ML_BFLOAT16 is not False


def bfloat16_view(bits: NDArray[np.uint16]) -> NDArray[Any]:
    """bfloat16 values given as their uint16 bits: a view of dtype
    ``ml_dtypes.bfloat16`` when ml_dtypes is installed (:func:`bfloat16_arrays`),
    else their float32 values (exact: the bits are the top half of the float's)."""
    if not bfloat16_arrays():
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(_ML_BFLOAT16)


def torch_bfloat16(x: object) -> Optional[NDArray[Any]]:
    """A torch bfloat16 CPU tensor's memory as a bfloat16 array (no copy, see
    :func:`bfloat16_view`), or None for anything else (NumPy cannot read
    torch's bfloat16 through ``__array__`` or DLPack). torch is not imported:
    a torch tensor means the caller already did."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 \
            or x.device.type != "cpu":
        return None
    return bfloat16_view(x.view(torch.int16).numpy().view(np.uint16))


def is_float_dtype(dtype: np.dtype[Any]) -> bool:
    """float16, float32, float64 or bfloat16: what attnx computes with (in float32)."""
    return dtype.type in _FLOAT_KINDS or is_bfloat16(dtype)


_F32_MAX = float(np.finfo(np.float32).max)


def shape_str(a: NDArray[Any]) -> str:
    """The shape of ``a`` as Python writes a tuple: "(2, 3)", "(5,)", "()"."""
    return "(" + ", ".join(str(n) for n in a.shape) + ("," if a.ndim == 1 else "") + ")"


# ------------------------------------------------------------------ arrays

def as_array(x: object, name: str, float32_range: bool = True) -> NDArray[Any]:
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

    A torch bfloat16 CPU tensor, which NumPy cannot read, is read through its
    bits (:func:`torch_bfloat16`).

    Refused with TypeError naming ``name``: masked arrays (their mask would
    be dropped), objects whose own ``__array__`` fails (sparse, quantized,
    non-CPU tensors...: DLPack is not tried then, as it may drop what made
    the conversion fail). With ``float32_range``, a float64 array
    holding finite values beyond float32's range raises ValueError (see
    :func:`check_float32_range`). MemoryError propagates.
    """
    if type(x) is np.ndarray:
        a: NDArray[Any] = x
    elif isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array (numpy.ma): attnx would ignore its mask. Pass padding "
            f"as key_lengths/query_lengths or as attn_mask (bool, True = may attend), or fill "
            f"the masked entries explicitly: {name}.filled(value), e.g. {name}.filled(0)")
    elif isinstance(x, np.ndarray):  # a subclass (np.matrix, ...): its data, as a view
        a = np.asarray(x)
    else:
        a = _asarray_foreign(x, name)
    if float32_range:
        check_float32_range(a, name)
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


def _resolve_lazy_bits(x: object, name: str) -> object:
    """``x`` detached from autograd and with torch's lazy negative/conjugate bits resolved."""
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
    return x


def _asarray_foreign(x: object, name: str) -> NDArray[Any]:
    """:func:`as_array` for objects that are not ndarrays."""
    x = _resolve_lazy_bits(x, name)
    bf16 = torch_bfloat16(x)
    if bf16 is not None:
        return bf16
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


def check_float32_range(a: NDArray[Any], name: str) -> None:
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


def float_array(x: object, name: str) -> NDArray[Any]:
    """``x`` as an ndarray of float16, float32, float64 or bfloat16 (kept as it is);
    other kinds raise."""
    a = as_array(x, name)
    if not is_float_dtype(a.dtype):
        raise TypeError(
            f"{name} must be float16, float32, float64 or bfloat16 (computed in float32); "
            f"got dtype {a.dtype} with shape {shape_str(a)}")
    return a


def small_float_array(x: object, name: str) -> NDArray[Any]:
    """A small float parameter array (sinks, slopes): float arrays kept, integer
    ones (``[0, 1, 2]``) taken as float64; other kinds raise TypeError."""
    a = as_array(x, name)
    if a.dtype != np.bool_ and np.issubdtype(a.dtype, np.integer):
        return a.astype(np.float64)
    return float_array(a, name)


def as_float(x: object, name: str) -> NDArray[np.float32]:
    """``x`` as a float32 ndarray; float16/64 and bfloat16 are converted, other kinds raise."""
    a = float_array(x, name)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def unit_last_stride(a: NDArray[Any]) -> NDArray[Any]:
    """A view of ``a`` whose last axis is contiguous and aligned (copies only if not)."""
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    if not a.flags.aligned:
        return a.copy()
    return a


def astype_broadcast(a: NDArray[Any], dtype: type[np.floating[Any]]) -> NDArray[Any]:
    """``a.astype(dtype)`` that converts each element once: axes along which
    ``a`` is broadcast (stride 0) stay broadcast, never expanded."""
    single = a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.strides)]
    return np.broadcast_to(single.astype(dtype), a.shape)


def integer_array(x: object, name: str) -> NDArray[np.integer[Any]]:
    """``x`` as an ndarray of integers (bool refused), TypeError naming it otherwise.
    An empty list or tuple (which NumPy reads as float64) is an empty int64 array."""
    a = as_array(x, name)
    if a.size == 0 and isinstance(x, (list, tuple)):
        return a.astype(np.int64)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array; got dtype {a.dtype} with shape {shape_str(a)}")
    return a


def check_range(a: NDArray[np.integer[Any]], name: str, limit: int, limit_name: str = "") -> None:
    """ValueError naming ``name`` unless every value lies in [0, limit]."""
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} must lie in [0, {limit_name}{limit}]; "
                         f"got values from {a.min()} to {a.max()}")
