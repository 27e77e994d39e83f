"""Scalar arguments: flags, integers, layout, dropout, is_causal and scale.

:func:`check_flag`, :func:`positive_int`, :func:`nonnegative_int`,
:func:`check_layout`, :func:`check_dropout`, :func:`causal_code` and
:func:`scale_value` check them; :data:`CAUSAL` and :data:`CAUSAL_ARG` map
``is_causal`` to the core's codes and back.

Part of :mod:`attnx._args`, which re-exports every public name here.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Dict, Literal, Optional, Union

import numpy as np

from . import _attnx


#: ``is_causal``: False, True (= "upper_left"), "upper_left", "top_left" or "lower_right".
Causal = Union[bool, Literal["upper_left", "top_left", "lower_right"]]
#: ``layout``: (B..., H, L, E) or (B..., L, H, E).
Layout = Literal["bhld", "blhd"]
#: is_causal -> the core's code (csrc/attnx.h's attnx_causal, exported by the extension)
CAUSAL = {False: _attnx.CAUSAL_NONE, True: _attnx.CAUSAL_UPPER_LEFT,
          "upper_left": _attnx.CAUSAL_UPPER_LEFT, "top_left": _attnx.CAUSAL_UPPER_LEFT,
          "lower_right": _attnx.CAUSAL_LOWER_RIGHT}
#: the core's code -> the is_causal value that means it (for attnx.reference)
CAUSAL_ARG: Dict[int, Causal] = {_attnx.CAUSAL_NONE: False, _attnx.CAUSAL_UPPER_LEFT: True,
                                 _attnx.CAUSAL_LOWER_RIGHT: "lower_right"}


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


def real_number(value: object, name: str, what: str) -> float:
    """``value`` (a real number, bools refused) as a float, inf for an int beyond
    float's range; TypeError otherwise, saying "``name`` must be ``what``"."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:        # an int beyond float range
        return math.inf


def scale_value(scale: object, E: int) -> float:
    """The scale as a finite float (default 1/sqrt(E))."""
    if scale is None:
        return default_scale(E)
    scale_f = real_number(scale, "scale", "a real number")
    if not math.isfinite(scale_f):
        raise ValueError(f"scale must be finite; got {scale_f}")
    return scale_f
