"""Argument conversion and checks shared by every public function of attnx.

* :func:`as_array` turns any array argument into an ndarray (tensors,
  ``__array__``, DLPack, lazy torch bits resolved, masked arrays refused,
  float64 beyond float32's range refused); :func:`float_array` and
  :func:`as_float` add the float check (float16/32/64 and bfloat16) and the conversion.
* :func:`check_flag`, :func:`positive_int`, :func:`nonnegative_int`,
  :func:`check_layout`, :func:`check_dropout`, :func:`causal_code`,
  :func:`scale_value` check the scalar arguments.
* :func:`attention_args` checks the arguments that every attention function
  (forward, reference, gradients) shares, and returns them as
  :class:`AttentionArgs`: (batch..., H, L, E) views the C core or the float64
  reference read after :meth:`AttentionArgs.astype`.

Every error names the argument at fault and the shapes involved. Nothing here
computes attention; everything is cheap NumPy bookkeeping on views.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
import sys
from typing import Any, Dict, List, Literal, NamedTuple, Optional, Protocol, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attnx


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
#: is_causal -> the core's code (csrc/attnx.h's attnx_causal, exported by the extension)
CAUSAL = {False: _attnx.CAUSAL_NONE, True: _attnx.CAUSAL_UPPER_LEFT,
          "upper_left": _attnx.CAUSAL_UPPER_LEFT, "top_left": _attnx.CAUSAL_UPPER_LEFT,
          "lower_right": _attnx.CAUSAL_LOWER_RIGHT}
#: the core's code -> the is_causal value that means it (for attnx.reference)
CAUSAL_ARG: Dict[int, Causal] = {_attnx.CAUSAL_NONE: False, _attnx.CAUSAL_UPPER_LEFT: True,
                                 _attnx.CAUSAL_LOWER_RIGHT: "lower_right"}


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


# ----------------------------------------------------------------- scalars

def check_flag(value: object, name: str) -> bool:
    """``value`` as a Python bool; TypeError naming ``name`` unless it is a bool or
    a NumPy bool (a truthy string such as ``"no"`` is not taken as True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False); got {type(value).__name__} {value!r}")


def integer(value: Any, name: str, what: str, minimum: Optional[int] = None) -> int:
    """``value`` as a Python int (Python and NumPy integers, 0-d integer arrays;
    bools refused); TypeError, or ValueError below ``minimum``, saying
    "``name`` must be ``what``"."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {what}; got bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {what}; got {type(value).__name__} {value!r}") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{name} must be {what}; got {n}")
    return int(n)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1 (a size that cannot be zero: features, heads)."""
    return integer(value, name, "a positive integer", 1)


def nonnegative_int(value: Any, name: str) -> int:
    """``value`` as an int >= 0 (a length)."""
    return integer(value, name, "a non-negative integer", 0)


def check_layout(layout: object) -> None:
    if layout not in ("bhld", "blhd"):
        raise ValueError(f'layout must be "bhld" or "blhd"; got {layout!r}')


def check_dropout(dropout_p: object) -> None:
    if dropout_p != 0.0 or not isinstance(dropout_p, (float, int, np.floating, np.integer)):
        raise ValueError(f"dropout_p must be 0.0 (attnx computes inference attention); got {dropout_p!r}")


def causal_code(is_causal: object) -> int:
    """``is_causal`` as the core's code (CAUSAL_NONE, CAUSAL_UPPER_LEFT, CAUSAL_LOWER_RIGHT)."""
    if isinstance(is_causal, (bool, np.bool_)):
        return CAUSAL[bool(is_causal)]
    if isinstance(is_causal, str) and is_causal in CAUSAL:
        return CAUSAL[is_causal]
    raise ValueError(f'is_causal must be False, True, "upper_left" or "lower_right"; got {is_causal!r}')


def default_scale(E: int) -> float:
    """1/sqrt(E), PyTorch's default; 1 for an empty head dimension."""
    return 1.0 / math.sqrt(E) if E > 0 else 1.0


def scale_value(scale: object, E: int) -> float:
    """The scale as a finite float (default 1/sqrt(E))."""
    if scale is None:
        return default_scale(E)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number; got {type(scale).__name__}")
    try:
        scale_f = float(scale)
    except OverflowError:        # an int beyond float range
        scale_f = math.inf
    if not math.isfinite(scale_f):
        raise ValueError(f"scale must be finite; got {scale_f}")
    return scale_f


# ------------------------------------------------------- attention arguments

Window = Optional[Tuple[Optional[int], Optional[int]]]
Alignment = Optional[Literal["upper_left", "lower_right"]]


class Variants(NamedTuple):
    """The checked variant arguments (window, alignment, softcap, ALiBi, sinks)."""

    window: Optional[Tuple[int, int]] = None  # (left, right), -1 = unbounded side
    align: int = _attnx.ALIGN_UPPER_LEFT      # the diagonal without causal
    softcap: float = 0.0                      # 0: none
    alibi: Optional[NDArray[Any]] = None      # (B, Hq), B = prod(batch)
    sinks: Optional[NDArray[Any]] = None      # (B, Hq)

    def core(self, alibi: Optional[NDArray[Any]], sinks: Optional[NDArray[Any]]) -> Optional[Tuple[Any, ...]]:
        """The core's ``variant`` argument for one call (with that call's
        (B, Hq) views of the slopes and sinks), or None for plain attention."""
        if self is NO_VARIANTS:
            return None
        left, right = self.window if self.window is not None else (-1, -1)
        return (self.window is not None, left, right, self.align, self.softcap, alibi, sinks)

    def astype(self, dtype: type[np.floating[Any]]) -> Variants:
        if self.alibi is None and self.sinks is None:
            return self

        def conv(a: Optional[NDArray[Any]]) -> Optional[NDArray[Any]]:
            return None if a is None else np.ascontiguousarray(a, dtype=dtype)
        return self._replace(alibi=conv(self.alibi), sinks=conv(self.sinks))


NO_VARIANTS = Variants()
_ALIGN = {"upper_left": _attnx.ALIGN_UPPER_LEFT, "lower_right": _attnx.ALIGN_LOWER_RIGHT}


#: The widest bounded window side: wider is the whole sequence (pass None or -1).
WINDOW_MAX = 2 ** 62


def _window_side(x: object, window: object) -> int:
    if x is None:
        return -1
    n = integer(x, "window", "(left, right) with each side an integer >= 0, or -1 / None "
                "for an unbounded side", -1)
    if n > WINDOW_MAX:
        raise ValueError(f"window sides must be at most 2**62 (None or -1: unbounded); got "
                         f"window={window!r}")
    return n


def window_value(window: object) -> Optional[Tuple[int, int]]:
    """``window`` as (left, right) with -1 for an unbounded side, or None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right); got {window!r}")
    return _window_side(window[0], window), _window_side(window[1], window)


def align_code(alignment: object, causal: int) -> int:
    """The diagonal's alignment: ``alignment`` if given (it must agree with a causal
    mode), else the causal mode's (upper-left without one)."""
    if alignment is not None and alignment not in _ALIGN:
        raise ValueError(f'alignment must be None, "upper_left" or "lower_right"; got {alignment!r}')
    implied = "lower_right" if causal == _attnx.CAUSAL_LOWER_RIGHT else "upper_left"
    if alignment is None:
        return int(_ALIGN[implied])
    if causal != _attnx.CAUSAL_NONE and alignment != implied:
        raise ValueError(f"alignment={alignment!r} contradicts is_causal={CAUSAL_ARG[causal]!r}, "
                         f"whose diagonal is {implied!r}")
    return int(_ALIGN[str(alignment)])


def softcap_value(softcap: object) -> float:
    """``softcap`` as a float > 0 (0.0 for None): finite in float32, with a finite
    float32 reciprocal (the kernels compute score · (1/softcap): an infinite
    reciprocal times a zero score is NaN), i.e. 2.9387359e-39 <= softcap <=
    3.4028235e38."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a real number > 0; got {type(softcap).__name__}")
    try:
        c = float(softcap)
    except OverflowError:            # an int beyond float range
        c = math.inf
    with np.errstate(over="ignore", divide="ignore"):
        c32 = np.float32(c)
        inv = np.float32(1) / c32 if c32 > 0 else np.float32(np.inf)
    if not (c > 0 and math.isfinite(c32) and math.isfinite(inv)):
        raise ValueError(f"softcap must be > 0 and finite in float32, with a finite reciprocal "
                         f"(2.9387359e-39 <= softcap <= 3.4028235e38); got {reprlib.repr(softcap)}")
    return c


def per_head(x: object, name: str, target: Tuple[int, ...], B: int, H: int) -> NDArray[Any]:
    """A per-head float array broadcast to ``target`` = (batch..., Hq), as (B, H)."""
    a = small_float_array(x, name)
    try:
        b = np.broadcast_to(a, target)
    except ValueError:
        raise ValueError(f"{name} with shape {shape_str(a)} does not broadcast to (batch..., heads) "
                         f"= {target}") from None
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite")
    return np.ascontiguousarray(b).reshape(B, H)


def check_alibi_range(slopes: NDArray[Any], align: int, Lq: int, Lk: int) -> None:
    """ValueError unless every ALiBi bias slope · |d(i) - j| stays within half of
    float32's range for these lengths: the kernels compute the bias and score -
    bias in float32, where a larger bias overflows to inf (and inf - inf is NaN;
    float64 would still be finite). The largest distance from the diagonal d(i)
    = i + offset is max(Lq - 1 + offset, Lk - 1 - offset)."""
    if slopes.size == 0 or Lq == 0 or Lk == 0:
        return
    offset = Lk - Lq if align == _attnx.ALIGN_LOWER_RIGHT else 0
    dist = max(Lq - 1 + offset, Lk - 1 - offset, 0)
    biggest = float(np.max(np.abs(slopes.astype(np.float64))))
    if biggest * dist > _F32_MAX / 2:
        raise ValueError(
            f"alibi_slopes: a slope of magnitude {biggest:g} over distances up to {dist} (Lq={Lq}, "
            f"Lk={Lk}) gives biases beyond float32's range (|slope| * distance must be at most "
            f"{_F32_MAX / 2:g}), where attnx computes them")


def variant_args(window: object, sinks: object, softcap: object, alibi_slopes: object,
                 alignment: object, causal: int, target: Tuple[int, ...], B: int, H: int,
                 Lq: int, Lk: int) -> Variants:
    """The variant arguments, checked; per-head arrays as (B, H) float arrays."""
    if window is None and sinks is None and softcap is None and alibi_slopes is None \
            and alignment is None:
        return NO_VARIANTS
    align = align_code(alignment, causal)
    alibi = None if alibi_slopes is None else per_head(alibi_slopes, "alibi_slopes", target, B, H)
    if alibi is not None:
        check_alibi_range(alibi, align, Lq, Lk)
    return Variants(
        window=window_value(window), align=align, softcap=softcap_value(softcap), alibi=alibi,
        sinks=None if sinks is None else per_head(sinks, "sinks", target, B, H))


class AttentionArgs(NamedTuple):
    """The checked arguments of an attention function: views of the inputs
    with every batch axis kept (the core's (B, H, L, E) views come from
    ``attnx._functional._core_calls``), and the scalar arguments as codes."""

    q: NDArray[Any]                         # (batch..., Hq, Lq, E)
    k: NDArray[Any]                         # (batch..., Hk, Lk, E)
    v: NDArray[Any]                         # (batch..., Hk, Lk, Ev)
    mask: Optional[NDArray[Any]]            # (batch..., Hq, Lq, Lk), bool or float, any strides
    key_lengths: Optional[NDArray[np.int64]]    # (B, Hq), B = prod(batch), C-contiguous rows
    query_lengths: Optional[NDArray[np.int64]]  # (B, Hq)
    causal: int                             # CAUSAL_NONE, CAUSAL_UPPER_LEFT or CAUSAL_LOWER_RIGHT
    scale: float
    batch_shape: Tuple[int, ...]
    layout: str
    ndim: int                               # of query as passed (2: a leading axis was added)
    variants: Variants = NO_VARIANTS
    q_bfloat16: bool = False                # q holds bfloat16 values (converted by astype)

    def astype(self, dtype: type[np.floating[Any]], half_kv: bool = False) -> AttentionArgs:
        """q, k, v and a float mask converted to ``dtype`` (float32 for the C
        core, float64 for the reference; no copy where they already are), each
        with a contiguous, aligned last axis; a broadcast mask stays a view.
        ``half_kv``: float16 keys and values stay float16, bfloat16 ones are
        viewed as uint16 (the forward reads either as such, with no float32
        copy; the core takes uint16 as bfloat16 bits). A bfloat16 q sets
        ``q_bfloat16``, which the forward passes on to the core (its values are
        bfloat16: with bfloat16 keys and values the core may use bfloat16 dot
        products)."""
        k, v = self.k, self.v
        if half_kv and k.dtype == v.dtype and is_bfloat16(k.dtype):
            k, v = k.view(np.uint16), v.view(np.uint16)
        elif not (half_kv and k.dtype == v.dtype == np.float16):
            k, v = k.astype(dtype, copy=False), v.astype(dtype, copy=False)
        q = unit_last_stride(self.q.astype(dtype, copy=False))
        k, v = unit_last_stride(k), unit_last_stride(v)
        mask = self.mask
        if mask is not None and mask.dtype != np.bool_ and mask.dtype != dtype:
            mask = astype_broadcast(mask, dtype)
        variants = self.variants.astype(dtype)
        if q is self.q and k is self.k and v is self.v and mask is self.mask \
                and self.variants is NO_VARIANTS:
            return self          # the common case, float32 inputs for the core
        return self._replace(q=q, k=k, v=v, mask=mask, variants=variants,
                             q_bfloat16=self.q_bfloat16 or is_bfloat16(self.q.dtype))

    def per_head(self) -> List[Optional[NDArray[Any]]]:
        """The (B, Hq) arrays of a core call: lengths, ALiBi slopes, sinks."""
        return [self.key_lengths, self.query_lengths, self.variants.alibi, self.variants.sinks]

    @property
    def scores_shape(self) -> Tuple[int, ...]:
        """(batch..., Hq, Lq, Lk): the shape of the weights (and of the mask's view)."""
        return self.batch_shape + self.q.shape[-3:-1] + self.k.shape[-2:-1]

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """(batch..., Hq, Lq, Ev): the output as the core writes it."""
        return self.batch_shape + self.q.shape[-3:-1] + self.v.shape[-1:]

    def caller_shape(self, core: Tuple[int, ...]) -> Tuple[int, ...]:
        """The shape, in the caller's layout, of a (batch..., H, L, X) array."""
        if self.layout == "blhd":
            core = core[:-3] + (core[-2], core[-3], core[-1])
        return core[1:] if self.ndim == 2 else core

    def core_view(self, a: NDArray[Any]) -> NDArray[Any]:
        """The (batch..., H, L, X) view of an array in the caller's layout."""
        if self.layout == "blhd":
            a = np.swapaxes(a, -2, -3)
        return a[None] if self.ndim == 2 else a

    def as_passed(self, a: NDArray[Any]) -> NDArray[Any]:
        """A (batch..., H, Lq, ...) result (weights, lse) without the leading
        axis added to 2-D inputs."""
        return a[0] if self.ndim == 2 else a

    def results(self, out: NDArray[Any], *extras: Optional[NDArray[Any]]) -> Any:
        """``out``, or the tuple of ``out`` and the extras that are not None
        (weights, lse: (batch..., Hq, Lq, ...) arrays, given back without the
        leading axis added to 2-D inputs)."""
        given = [a[0] if self.ndim == 2 else a for a in extras if a is not None]
        return (out, *given) if given else out

    def folded(self) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any], Optional[NDArray[Any]]]:
        """q, k, v and mask with the batch axes folded into one (copies where a view cannot)."""
        B = math.prod(self.batch_shape)
        q, k, v = (a.reshape((B,) + a.shape[-3:]) for a in (self.q, self.k, self.v))
        m = None if self.mask is None else self.mask.reshape((B,) + self.mask.shape[-3:])
        return q, k, v, m


def attention_args(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                   attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
                   is_causal: Causal = False, scale: Optional[float] = None,
                   enable_gqa: bool = False, *, layout: Layout = "bhld",
                   key_lengths: Optional[ArrayInput] = None,
                   query_lengths: Optional[ArrayInput] = None, window: Window = None,
                   sinks: Optional[ArrayInput] = None, softcap: Optional[float] = None,
                   alibi_slopes: Optional[ArrayInput] = None,
                   alignment: Alignment = None) -> AttentionArgs:
    """The arguments every attention function shares (those of
    ``scaled_dot_product_attention`` but its outputs' flags), checked.

    Their names, order and defaults are spelled here once for the code:
    :func:`attnx.reference` passes its arguments on as they came. q, k, v and
    a float mask keep their float dtypes: :meth:`AttentionArgs.astype` gives
    the computation's.
    """
    enable_gqa = check_flag(enable_gqa, "enable_gqa")
    q, k, v, given = _qkv_views(query, key, value, layout)
    heads_are_batch = given[0].ndim == 3 and layout == "bhld"
    _check_shapes(q, k, v, given, enable_gqa, heads_are_batch)
    check_dropout(dropout_p)
    causal = causal_code(is_causal)
    Hq, Lq, E = q.shape[-3:]
    Lk = k.shape[-2]
    scale_f = scale_value(scale, E)
    batch_shape = q.shape[:-3]
    mask = None if attn_mask is None else _mask_view(attn_mask, batch_shape + (Hq, Lq, Lk))

    B = math.prod(batch_shape)
    lead = (Hq,) if heads_are_batch else batch_shape
    kl = ql = None
    if key_lengths is not None:
        kl = _lengths(key_lengths, "key_lengths", lead, Lk, B, Hq, heads_are_batch)
    if query_lengths is not None:
        ql = _lengths(query_lengths, "query_lengths", lead, Lq, B, Hq, heads_are_batch)
    variants = variant_args(window, sinks, softcap, alibi_slopes, alignment, causal,
                            batch_shape + (Hq,), B, Hq, Lq, Lk)
    return AttentionArgs(q, k, v, mask, kl, ql, causal, scale_f, batch_shape, str(layout),
                         given[0].ndim, variants)


def _qkv_views(query: object, key: object, value: object, layout: object) -> Tuple[
        NDArray[Any], NDArray[Any], NDArray[Any], Tuple[NDArray[Any], ...]]:
    """The inputs as (lead..., H, L, E) views (blhd swapped, 2-D given a leading
    axis), and the inputs as passed (for messages)."""
    given = (float_array(query, "query"), float_array(key, "key"), float_array(value, "value"))
    q, k, v = given
    check_layout(layout)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions; got "
            f"query {shape_str(q)}, key {shape_str(k)}, value {shape_str(v)}")
    if q.ndim < 2:
        raise ValueError(f"query, key and value must be at least 2-D (L, E); got query {shape_str(q)}")
    if layout == "blhd":
        if q.ndim < 3:
            raise ValueError(f'layout="blhd" needs (B..., L, H, E) inputs, at least 3-D; got query {shape_str(q)}')
        q, k, v = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    if q.ndim == 2:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, given


def _check_shapes(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], given: Tuple[NDArray[Any], ...],
                  enable_gqa: bool, three_d: bool) -> None:
    """q (lead..., Hq, Lq, E), k (lead..., Hk, Lk, E), v (lead..., Hk, Lk, Ev) agree."""
    Hq, E = q.shape[-3], q.shape[-1]
    Hk, Lk, Ek = k.shape[-3:]
    Hv, Lv = v.shape[-3:-1]
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        problem = "query, key and value must have the same batch dimensions"
    elif Ek != E:
        problem = "query and key must have the same last dimension E"
    elif Lv != Lk or Hv != Hk:
        problem = "key and value must have the same heads and length"
    elif Hq != Hk and not enable_gqa:
        problem = (f"query has N={Hq} but key/value have N={Hk}: for 3-D (N, L, E) inputs the "
                   f"first axis N (the batch, or the heads) must match; grouped-query attention "
                   f"(enable_gqa=True) is for 4-D (B, H, L, E) inputs"
                   if three_d else
                   f"query has {Hq} heads but key/value have {Hk}; pass enable_gqa=True for "
                   f"grouped-query attention")
    elif Hq != Hk and (Hk == 0 or Hq % Hk):
        problem = (f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads "
                   f"({Hk})")
    else:
        return
    shapes = "query {}, key {}, value {}".format(*(shape_str(a) for a in given))
    raise ValueError(f"{problem}; got {shapes}")


def _mask_view(attn_mask: object, full: Tuple[int, ...]) -> NDArray[Any]:
    """The mask, bool or float, as a broadcast view of shape ``full`` (never expanded)."""
    m = as_array(attn_mask, "attn_mask")
    if m.dtype != np.bool_ and not is_float_dtype(m.dtype):
        raise TypeError(
            f"attn_mask must be bool (True = attend) or float (added to the scores); got dtype "
            f"{m.dtype} with shape {shape_str(m)}. For a 0/1 integer mask pass mask.astype(bool) "
            f"if 1 means attend, or mask == 0 if 1 means blocked")
    if not m.flags.aligned:      # before broadcasting: never copy an expanded view
        m = m.copy()
    if m.ndim > len(full):
        raise ValueError(f"attn_mask with shape {shape_str(m)} has more dimensions than the scores {full}")
    try:
        return np.broadcast_to(m, full)
    except ValueError:
        raise ValueError(
            f"attn_mask with shape {shape_str(m)} does not broadcast to the "
            f"scores' shape (B..., Hq, Lq, Lk) = {full}") from None


def _lengths(x: object, name: str, lead: Tuple[int, ...], limit: int, B: int, H: int,
             heads_are_batch: bool) -> NDArray[np.int64]:
    """Lengths as an int64 (B, H) array (a broadcast view), checked in [0, limit]."""
    a = integer_array(x, name)
    try:
        a = np.broadcast_to(a, lead)
    except ValueError:
        raise ValueError(
            f"{name} with shape {shape_str(a)} does not broadcast to the batch shape "
            f"{tuple(lead)}") from None
    check_range(a, name, limit)
    flat: NDArray[np.int64] = np.require(a, dtype=np.int64, requirements=["C", "A"]).reshape(-1)
    if heads_are_batch:           # no head axis: one length per leading row
        return flat.reshape(B, H)
    return np.broadcast_to(flat.reshape(B, 1), (B, H))


# ------------------------------------------- arrays shaped like the output

def output_like(x: object, name: str, p: AttentionArgs,
                dtype: type[np.floating[Any]] = np.float32) -> NDArray[Any]:
    """``out`` or ``dout`` of a backward pass: shaped like the forward's output
    in the caller's layout, returned in ``dtype`` as a (batch..., Hq, Lq, Ev) view."""
    a = float_array(x, name)
    want = p.caller_shape(p.out_shape)
    if a.shape != want:
        raise ValueError(f"{name} must have the shape of the attention output {want}; "
                         f"got {shape_str(a)}")
    return unit_last_stride(p.core_view(a.astype(dtype, copy=False)))


def lse_like(x: object, p: AttentionArgs) -> NDArray[np.float32]:
    """``lse`` of a backward pass, (batch..., Hq, Lq), as a float32 (batch..., Hq, Lq, 1) view."""
    a = as_float(x, "lse")
    want = p.out_shape[:-1]
    want = want[1:] if p.ndim == 2 else want
    if a.shape != want:
        raise ValueError(f"lse must have shape (B..., Hq, Lq) = {want}; got {shape_str(a)}")
    a = a[None] if p.ndim == 2 else a
    if not a.flags.aligned:
        a = a.copy()
    return a[..., None]
