"""The variant arguments: window, alignment, softcap, ALiBi slopes, sinks and precision.

:func:`variant_args` checks them all and returns them as :class:`Variants`
(per-head arrays as (B, H) views); :data:`NO_VARIANTS` is plain attention.

Part of :mod:`attnx._args`, which re-exports every public name here.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Literal, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

from . import _attnx
from ._arrays import _F32_MAX, shape_str, small_float_array
from ._scalars import CAUSAL_ARG, integer, real_number

Window = Optional[Tuple[Optional[int], Optional[int]]]
Alignment = Optional[Literal["upper_left", "lower_right"]]
Precision = Literal["highest", "medium"]

#: ``precision`` -> the core's code (csrc/attnx.h's attnx_precision, exported by
#: the extension); its keys are the choices, in the order the errors name them.
PRECISION = {"highest": _attnx.PRECISION_HIGHEST, "medium": _attnx.PRECISION_MEDIUM}


class Variants(NamedTuple):
    """The checked variant arguments (window, alignment, softcap, ALiBi, sinks,
    precision)."""

    window: Optional[Tuple[int, int]] = None  # (left, right), -1 = unbounded side
    align: int = _attnx.ALIGN_UPPER_LEFT      # the diagonal without causal
    softcap: float = 0.0                      # 0: none
    alibi: Optional[NDArray[Any]] = None      # (B, Hq), B = prod(batch)
    sinks: Optional[NDArray[Any]] = None      # (B, Hq)
    precision: int = _attnx.PRECISION_HIGHEST

    def core(self, alibi: Optional[NDArray[Any]], sinks: Optional[NDArray[Any]]) -> Optional[Tuple[Any, ...]]:
        """The core's ``variant`` argument for one call (with that call's
        (B, Hq) views of the slopes and sinks), or None for plain attention."""
        if self is NO_VARIANTS:
            return None
        left, right = self.window if self.window is not None else (-1, -1)
        return (self.window is not None, left, right, self.align, self.softcap, alibi, sinks,
                self.precision)

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
    c = real_number(softcap, "softcap", "None or a real number > 0")
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


def precision_code(precision: object) -> int:
    """``precision`` ("highest" or "medium") as the core's code."""
    if isinstance(precision, str) and precision in PRECISION:
        return PRECISION[precision]
    choices = " or ".join(f'"{c}"' for c in PRECISION)
    raise ValueError(f"precision must be {choices}; got {reprlib.repr(precision)}")


def variant_args(window: object, sinks: object, softcap: object, alibi_slopes: object,
                 alignment: object, causal: int, target: Tuple[int, ...], B: int, H: int,
                 Lq: int, Lk: int, precision: object = "highest") -> Variants:
    """The variant arguments, checked; per-head arrays as (B, H) float arrays."""
    prec = precision_code(precision)
    if window is None and sinks is None and softcap is None and alibi_slopes is None \
            and alignment is None and prec == _attnx.PRECISION_HIGHEST:
        return NO_VARIANTS
    align = align_code(alignment, causal)
    alibi = None if alibi_slopes is None else per_head(alibi_slopes, "alibi_slopes", target, B, H)
    if alibi is not None:
        check_alibi_range(alibi, align, Lq, Lk)
    return Variants(
        window=window_value(window), align=align, softcap=softcap_value(softcap), alibi=alibi,
        sinks=None if sinks is None else per_head(sinks, "sinks", target, B, H), precision=prec)

