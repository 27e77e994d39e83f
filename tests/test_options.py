"""The entry points' keyword options come from one declaration (attnx/_options.py).

The typed overloads read them through ``**options: Unpack[...]`` (checked by
tests/test_typing.py); here: the signatures that ``help()``, editors and
Sphinx show list them as if written by hand, and a keyword that is not one
of them is refused with the entry point's own name.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Optional

import numpy as np
import pytest

import attnx
from attnx._options import DEFAULTS, Options, Padded, Variants, names, plain, takes

ENTRY_POINTS = [
    (attnx.scaled_dot_product_attention, Options, "need_weights"),
    (attnx.scaled_dot_product_attention_vjp, Options, None),
    (attnx.scaled_dot_product_attention_backward, Options, "mask_grad"),
    (attnx.reference_backward, Options, None),
    (attnx.MultiHeadAttention.__call__, Padded, "need_weights"),
    (attnx.MultiHeadAttention.vjp, Padded, None),
    (attnx.varlen_attention, Variants, "return_lse"),
    (attnx.varlen_attention_vjp, Variants, None),
]


@pytest.mark.parametrize("f,options,before", ENTRY_POINTS, ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_signature_spells_the_options_in_place(f: Any, options: type, before: Optional[str]) -> None:
    params = inspect.signature(f).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    order = list(params)
    opts = list(options.__annotations__)
    at = order.index(opts[0])
    assert order[at:at + len(opts)] == opts
    assert (order[at + len(opts)] if at + len(opts) < len(order) else None) == before
    for n in opts:
        assert params[n].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[n].default == DEFAULTS.get(n)
        assert isinstance(params[n].annotation, str)       # as written, like the others
    hints = typing.get_type_hints(f)                        # every name resolves
    assert set(opts) <= set(hints)


def test_the_options_nest() -> None:
    assert list(Options.__annotations__)[:3] == ["layout", "key_lengths", "query_lengths"]
    assert names(Variants) < names(Padded) < names(Options)


def test_the_torch_function_takes_the_same_options() -> None:
    torch_mod = pytest.importorskip("attnx.torch")
    params = inspect.signature(torch_mod.scaled_dot_product_attention).parameters
    assert names(Options) < set(params) and list(params)[-1] == "need_weights"


@pytest.mark.parametrize("call,where", [
    (lambda q: attnx.scaled_dot_product_attention(q, q, q, windw=(1, 1)),
     "scaled_dot_product_attention"),
    (lambda q: attnx.scaled_dot_product_attention(q, q, q, windw=None),   # the plain call's path
     "scaled_dot_product_attention"),
    (lambda q: attnx.scaled_dot_product_attention_vjp(q, q, q, windw=(1, 1)),
     "scaled_dot_product_attention_vjp"),
    (lambda q: attnx.MultiHeadAttention(4, 2)(q[0, 0], layout="blhd"),
     "MultiHeadAttention.__call__"),
    (lambda q: attnx.MultiHeadAttention(4, 2).vjp(q[0, 0], windw=(1, 1)),
     "MultiHeadAttention.vjp"),
    (lambda q: attnx.varlen_attention(q[0], q[0], q[0], [0, 2], [0, 2], key_lengths=[2]),
     "varlen_attention"),
])
def test_an_unknown_keyword_names_the_entry_point(call: Any, where: str) -> None:
    q = np.zeros((1, 2, 2, 4), np.float32)
    with pytest.raises(TypeError, match=rf"^{where}\(\) got an unexpected keyword argument"):
        call(q)


def test_a_misspelled_keyword_is_refused_on_the_torch_fast_path_too() -> None:
    torch = pytest.importorskip("torch")
    import attnx.torch as at
    t = torch.zeros((1, 2, 2, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'key_padding_mask'"):
        at.scaled_dot_product_attention(t, t, t, key_padding_mask=None)


def test_explicit_defaults_keep_the_plain_call() -> None:
    assert not plain({"windw": None})      # not an option: the checked path refuses it
    assert plain({}) and plain({"layout": "bhld", "window": None, "sinks": None})
    assert not plain({"layout": "blhd"}) and not plain({"softcap": 1.0})
    q = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    assert np.array_equal(attnx.scaled_dot_product_attention(q, q, q, layout="bhld", window=None),
                          attnx.scaled_dot_product_attention(q, q, q))


def test_a_new_option_reaches_a_signature_from_its_declaration() -> None:
    """What adding an option (a made-up ``seed=``) to the declaration does."""
    class More(Variants, total=False):
        seed: Optional[str]

    @takes(More, before="flag")
    def f(x: int, *, flag: bool = False, **options: Any) -> None: ...

    params = inspect.signature(f).parameters
    assert list(params) == ["x", *Variants.__annotations__, "seed", "flag"]
    assert params["seed"].default is None and params["seed"].annotation == "Optional[str]"
