"""The shortcut for the common call: (B, H, L, E) float32 arrays, no options.

``scaled_dot_product_attention`` skips its general argument handling
(``attention_args``) when the call is plain; these tests make sure the shortcut is
taken exactly when it may be, gives bit-identical results to the general
path, and never lets an unusual argument through unchecked.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import _functional
from conftest import check_against_reference, make_qkv, randn

sdpa = attnx.scaled_dot_product_attention


@pytest.fixture
def no_general_path(monkeypatch):
    """Make the general path fail loudly: a call that reaches it raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("took the general path")
    monkeypatch.setattr(_functional, "attention_args", refuse)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3}, {"dropout_p": 0.0},
                                {"is_causal": False, "scale": None}], ids=str)
def test_plain_calls_take_the_shortcut(isa, rng, no_general_path, kw):
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=17, Lk=19, E=8, Ev=5)
    out = sdpa(q, k, v, **kw)
    assert out.shape == (2, 3, 17, 5) and out.dtype == np.float32


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3}], ids=str)
def test_shortcut_matches_general_path_bit_for_bit(isa, rng, kw):
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=70, Lk=19, E=24, Ev=9)
    fast = sdpa(q, k, v, **kw)
    # an explicit layout and lengths of "everything" force the general path
    general = sdpa(q, k, v, key_lengths=np.full(2, 19), layout="bhld", **kw)
    np.testing.assert_array_equal(fast, general)
    check_against_reference(q, k, v, **kw)


def _odd_cases(rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=7, E=8, Ev=8)
    yield "float64", (q.astype(np.float64), k, v), {}
    yield "big_endian", (q.astype(">f4"), k, v), {}
    yield "3-D", (q[0], k[0], v[0]), {}
    yield "last_axis_step", (randn(rng, (2, 3, 5, 16))[..., ::2], k, v), {}
    yield "list", (q.tolist(), k, v), {}
    yield "subclass", (q.view(type("Sub", (np.ndarray,), {})), k, v), {}
    yield "int_dropout", (q, k, v), {"dropout_p": 0}
    yield "np_scale", (q, k, v), {"scale": np.float64(0.5)}
    yield "lower_right", (q, k, v), {"is_causal": "lower_right"}
    yield "mask", (q, k, v), {"attn_mask": np.ones((5, 7), bool)}
    yield "need_weights", (q, k, v), {"need_weights": True}
    yield "gqa", (q, k[:, :1], v[:, :1]), {"enable_gqa": True}


@pytest.mark.parametrize("case", [c[0] for c in _odd_cases(np.random.default_rng(0))])
def test_anything_unusual_takes_the_general_path(rng, monkeypatch, case):
    args, kw = {c[0]: c[1:] for c in _odd_cases(rng)}[case]
    calls = []
    real = _functional.attention_args

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_functional, "attention_args", spy)
    sdpa(*args, **kw)
    assert calls, f"{case} skipped the general argument handling"


@pytest.mark.parametrize("bad", ["batch", "heads", "E", "Lk", "nan_scale", "inf_scale",
                                 "dropout", "causal_str"])
def test_errors_are_the_general_paths_errors(rng, bad):
    """A plain-looking call with a wrong argument gets the same worded error."""
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=7, E=8, Ev=8)
    kw = {}
    if bad == "batch":
        k = randn(rng, (1, 3, 7, 8))
    elif bad == "heads":
        v = randn(rng, (2, 2, 7, 8))
    elif bad == "E":
        k = randn(rng, (2, 3, 7, 6))
    elif bad == "Lk":
        v = randn(rng, (2, 3, 6, 8))
    elif bad == "nan_scale":
        kw["scale"] = float("nan")
    elif bad == "inf_scale":
        kw["scale"] = float("inf")
    elif bad == "dropout":
        kw["dropout_p"] = 0.1
    elif bad == "causal_str":
        kw["is_causal"] = "sideways"
    with pytest.raises((ValueError, TypeError)) as excinfo:
        sdpa(q, k, v, **kw)
    msg = str(excinfo.value)
    assert any(word in msg for word in ("query", "key", "value", "scale", "dropout_p", "is_causal")), msg
