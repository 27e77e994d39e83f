"""The keyword options that attnx's attention entry points share, declared once.

Each ``TypedDict`` below is the one declaration of a set of keyword-only
options. The entry points take them as ``**options: Unpack[Options]``, so

* a type checker sees every option with its type, in the typed overloads too
  (each overload spells only what it varies: ``need_weights``, ``return_lse``
  and the return type);
* :func:`takes` gives each entry point the signature that ``help()``, editors
  and Sphinx show (``inspect.signature``): its own parameters with the
  options spelled out in their place, names, defaults and annotations as if
  written by hand.

Adding an option to every entry point is one line in :class:`Variants` (and
its default in :data:`DEFAULTS` when that is not None), and its check in
:func:`attnx._args.attention_args`, which every entry point's options reach.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, TypedDict, TypeVar

from ._args import Alignment, ArrayInput, Layout, Precision, Window

# The modules that take them import ``Unpack`` for type checkers only (``if
# TYPE_CHECKING: from typing_extensions import Unpack``: type checkers ship
# typing_extensions' stubs for every Python version; attnx's only run-time
# dependency stays NumPy).

__all__ = ["Variants", "Padded", "Options", "DEFAULTS", "names", "takes", "check_names", "plain"]


class Variants(TypedDict, total=False):
    """The attention variants: every entry point takes them (keyword-only)."""

    window: Window
    sinks: Optional[ArrayInput]
    softcap: Optional[float]
    alibi_slopes: Optional[ArrayInput]
    alignment: Alignment
    precision: Precision


class _Lengths(TypedDict, total=False):
    key_lengths: Optional[ArrayInput]
    query_lengths: Optional[ArrayInput]


class _Layout(TypedDict, total=False):
    layout: Layout


class Padded(_Lengths, Variants, total=False):
    """The lengths and the variants: ``MultiHeadAttention``'s options."""


class Options(_Layout, _Lengths, Variants, total=False):
    """Every option of ``scaled_dot_product_attention`` but its outputs' flags
    (the bases' keys in order: layout, the lengths, the variants)."""


#: Every option's name (Options is the widest set).
_OPTION_NAMES = frozenset(Options.__annotations__)

#: The options' defaults where they are not None.
DEFAULTS: Dict[str, object] = {"layout": "bhld", "precision": "highest"}

_F = TypeVar("_F", bound=Callable[..., Any])


def _annotation(t: object) -> object:
    """An option's annotation as written (a string, as ``from __future__ import
    annotations`` leaves every other annotation of attnx)."""
    return getattr(t, "__forward_arg__", t)


def names(options: type) -> FrozenSet[str]:
    """The option names a TypedDict above declares."""
    return frozenset(options.__annotations__)


def takes(options: type, before: Optional[str] = None) -> Callable[[_F], _F]:
    """Gives a function taking ``**options: Unpack[options]`` the signature it
    would have with the options written out: its ``**options`` replaced by the
    keyword-only parameters of ``options`` (default None, or ``DEFAULTS``'),
    placed before its parameter ``before`` (last without). Sets
    ``__signature__`` and ``__annotations__``; the function itself is returned
    as it is (no wrapper, nothing added to a call)."""
    def decorate(f: _F) -> _F:
        sig = inspect.signature(f)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS.get(n),
                                   annotation=_annotation(t))
                 for n, t in options.__annotations__.items()]
        at = len(own) if before is None else [p.name for p in own].index(before)
        params = own[:at] + added + own[at:]
        f.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        f.__annotations__ = {**{p.name: p.annotation for p in params
                                if p.annotation is not p.empty},
                             "return": f.__annotations__.get("return", sig.return_annotation)}
        return f
    return decorate


def check_names(options: Mapping[str, object], allowed: FrozenSet[str], where: str) -> None:
    """TypeError for a keyword that is none of ``allowed``, worded as Python's own."""
    for name in options:
        if name not in allowed:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


def plain(options: Mapping[str, object]) -> bool:
    """Whether ``options`` asks for nothing but the defaults (the plain call).
    A name that is no option is not plain: the checked path refuses it by name,
    even with the value None (``windw=None``)."""
    for n, v in options.items():
        if n not in _OPTION_NAMES:
            return False
        d = DEFAULTS.get(n)
        if not (v is d or (type(v) is type(d) and v == d)):
            return False
    return True
