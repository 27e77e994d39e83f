"""Bad input gets a clear exception, never a crash or a silent wrong answer.

Public API: TypeError for types, ValueError for values, with the argument's
name (and the shapes involved, where shapes are the problem) in the message.
Private ``attnx._attnx.forward``: every malformed call raises TypeError or
ValueError, leaves ``out`` untouched and leaks no reference.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import assert_close

sdpa = attnx.scaled_dot_product_attention


def f32(*shape):
    return np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)


Q, K, V = f32(2, 3, 5, 8), f32(2, 3, 7, 8), f32(2, 3, 7, 4)


# ---------------------------------------------------------------- public API

def case(exc, *needles, q=None, k=None, v=None, **kw):
    return (exc, needles, dict(query=Q if q is None else q, key=K if k is None else k,
                               value=V if v is None else v, **kw))


PUBLIC = {
    # ndim and shapes
    "1d": case(ValueError, "query", "(8,)", q=f32(8), k=f32(8), v=f32(8)),
    "ndim_mismatch": case(ValueError, "query", "(2, 3, 5, 8)", "(3, 7, 8)", k=f32(3, 7, 8)),
    "batch_mismatch": case(ValueError, "batch", "(2, 3, 5, 8)", "(1, 3, 7, 8)",
                           k=f32(1, 3, 7, 8), v=f32(1, 3, 7, 4)),
    "heads_mismatch": case(ValueError, "enable_gqa", "(2, 3, 5, 8)", "(2, 2, 7, 8)",
                           k=f32(2, 2, 7, 8), v=f32(2, 2, 7, 4)),
    "E_mismatch": case(ValueError, "query", "key", "(2, 3, 5, 8)", "(2, 3, 7, 6)", k=f32(2, 3, 7, 6)),
    "Lk_mismatch": case(ValueError, "value", "(2, 3, 7, 8)", "(2, 3, 6, 4)", v=f32(2, 3, 6, 4)),
    "v_heads_mismatch": case(ValueError, "value", "(2, 3, 7, 8)", "(2, 1, 7, 4)", v=f32(2, 1, 7, 4)),
    "blhd_2d": case(ValueError, "blhd", "(5, 8)", q=f32(5, 8), k=f32(7, 8), v=f32(7, 8),
                    layout="blhd"),
    # dtypes of query/key/value
    "int_query": case(TypeError, "query", "int64", "(2, 3, 5, 8)", q=np.ones((2, 3, 5, 8), np.int64)),
    "int32_key": case(TypeError, "key", "int32", "(2, 3, 7, 8)", k=np.ones((2, 3, 7, 8), np.int32)),
    "complex_key": case(TypeError, "key", "complex", "(2, 3, 7, 8)", k=K.astype(np.complex64)),
    "object_value": case(TypeError, "value", "object", "(2, 3, 7, 4)", v=V.astype(object)),
    "bool_query": case(TypeError, "query", "bool", "(2, 3, 5, 8)", q=Q > 0),
    "str_value": case(TypeError, "value", v=np.full((2, 3, 7, 4), "a")),
    "none_query": case(TypeError, "query", q=np.asarray(None)),
    "ragged_list": case(TypeError, "query", q=[[1.0, 2.0], [3.0]], k=f32(3, 2), v=f32(3, 2)),
    "uint8_value": case(TypeError, "value", "uint8", v=np.zeros((2, 3, 7, 4), np.uint8)),
    # masks
    "mask_wrong_shape": case(ValueError, "attn_mask", "(4, 7)", "(2, 3, 5, 7)",
                             attn_mask=np.ones((4, 7), bool)),
    "mask_wrong_last": case(ValueError, "attn_mask", "(5, 8)", attn_mask=np.ones((5, 8), bool)),
    "mask_too_many_dims": case(ValueError, "attn_mask", "(1, 2, 3, 5, 7)",
                               attn_mask=np.ones((1, 2, 3, 5, 7), bool)),
    "mask_int": case(TypeError, "attn_mask", "int64", "(5, 7)", attn_mask=np.ones((5, 7), np.int64)),
    "mask_uint8": case(TypeError, "attn_mask", "uint8", attn_mask=np.ones((5, 7), np.uint8)),
    "mask_complex": case(TypeError, "attn_mask", "complex", attn_mask=np.ones((5, 7), complex)),
    "mask_object": case(TypeError, "attn_mask", attn_mask=np.ones((5, 7), object)),
    # lengths
    "key_lengths_negative": case(ValueError, "key_lengths", "7", key_lengths=np.array([-1, 3])),
    "key_lengths_past_L": case(ValueError, "key_lengths", "7", key_lengths=np.array([8, 3])),
    "query_lengths_past_L": case(ValueError, "query_lengths", "5", query_lengths=np.array([5, 6])),
    "query_lengths_negative": case(ValueError, "query_lengths", query_lengths=[0, -2]),
    "key_lengths_float": case(TypeError, "key_lengths", "float64", key_lengths=np.array([7.0, 3.0])),
    "key_lengths_bool": case(TypeError, "key_lengths", "bool", key_lengths=np.array([True, False])),
    "key_lengths_shape": case(ValueError, "key_lengths", "(3,)", "(2,)", key_lengths=np.array([7, 3, 1])),
    "query_lengths_2d": case(ValueError, "query_lengths", "(2, 3)", query_lengths=np.ones((2, 3), int)),
    "key_lengths_str": case(TypeError, "key_lengths", key_lengths=["a", "b"]),
    # GQA
    "gqa_not_dividing": case(ValueError, "6", "4", "(2, 6, 5, 8)", "(2, 4, 7, 8)",
                             q=f32(2, 6, 5, 8), k=f32(2, 4, 7, 8), v=f32(2, 4, 7, 4), enable_gqa=True),
    "gqa_disabled": case(ValueError, "enable_gqa", "(2, 6, 5, 8)", "(2, 3, 7, 8)",
                         q=f32(2, 6, 5, 8)),
    "gqa_zero_kv_heads": case(ValueError, "(2, 2, 5, 8)", "(2, 0, 7, 8)", q=f32(2, 2, 5, 8),
                              k=f32(2, 0, 7, 8), v=f32(2, 0, 7, 4), enable_gqa=True),
    # scalars
    "scale_nan": case(ValueError, "scale", scale=float("nan")),
    "scale_inf": case(ValueError, "scale", scale=float("inf")),
    "scale_neg_inf": case(ValueError, "scale", scale=-np.inf),
    "scale_str": case(TypeError, "scale", scale="0.5"),
    "scale_complex": case(TypeError, "scale", scale=1j),
    "scale_array": case(TypeError, "scale", scale=np.ones(2)),
    "dropout": case(ValueError, "dropout_p", dropout_p=0.1),
    "dropout_str": case(ValueError, "dropout_p", dropout_p="0"),
    "causal_str": case(ValueError, "is_causal", is_causal="yes"),
    "causal_int": case(ValueError, "is_causal", is_causal=2),
    "causal_none": case(ValueError, "is_causal", is_causal=None),
    "layout": case(ValueError, "layout", layout="bhdl"),
    "layout_upper": case(ValueError, "layout", layout="BHLD"),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_api_errors(name):
    exc, needles, kwargs = PUBLIC[name]
    with pytest.raises(exc) as info:
        sdpa(**kwargs)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in the message: {msg!r}"
    # the reference validates the same way
    with pytest.raises(exc):
        attnx.reference(**kwargs)


def test_positional_and_keyword_only():
    # names and order follow torch; layout, lengths and need_weights are keyword-only
    out = sdpa(Q, K, V, None, 0.0, False, None, False)
    assert out.shape == (2, 3, 5, 4)
    with pytest.raises(TypeError):
        sdpa(Q, K, V, None, 0.0, False, None, False, "bhld")
    with pytest.raises(TypeError):
        sdpa(Q, K, V, bogus=1)


def test_errors_leave_inputs_alone():
    q, k, v = Q.copy(), K.copy(), V.copy()
    with pytest.raises(ValueError):
        sdpa(q, k, v, key_lengths=[9, 9])
    for a, b in ((q, Q), (k, K), (v, V)):
        np.testing.assert_array_equal(a, b)


# -------------------------------------------------------- attnx._attnx.forward

def fw_args(**over):
    """A valid forward() argument dict; override entries to break it."""
    B, Hq, Lq, Lk, E, Ev = 2, 3, 5, 7, 8, 4
    args = dict(q=f32(B, Hq, Lq, E), k=f32(B, Hq, Lk, E), v=f32(B, Hq, Lk, Ev),
                out=np.full((B, Hq, Lq, Ev), 7.0, np.float32),
                weights=np.full((B, Hq, Lq, Lk), 7.0, np.float32),
                mask=np.ones((B, Hq, Lq, Lk), bool),
                key_lengths=np.full((B, Hq), Lk, np.int64),
                query_lengths=np.full((B, Hq), Lq, np.int64), causal=0, scale=0.5)
    args.update(over)
    return args


ORDER = ["q", "k", "v", "out", "weights", "mask", "key_lengths", "query_lengths", "causal", "scale"]


def call_forward(args):
    return _attnx.forward(*(args[n] for n in ORDER))


def test_forward_valid_call_matches_reference():
    args = fw_args(mask=np.random.default_rng(1).random((2, 3, 5, 7)) < 0.7,
                   key_lengths=np.array([[7, 3, 0], [1, 7, 5]], np.int64), causal=2)
    assert call_forward(args) is None
    ref_out, ref_w = attnx._reference.reference_attention(
        args["q"], args["k"], args["v"], args["mask"], "lower_right", 0.5,
        args["key_lengths"], args["query_lengths"])
    assert_close(args["out"], ref_out)
    assert_close(args["weights"], ref_w)


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


def _unaligned(shape):
    buf = np.zeros(4 * int(np.prod(shape)) + 1, np.uint8)[1:]
    a = np.ndarray(shape, np.float32, buffer=buf)
    a[...] = 1.0
    return a


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


FORWARD_BAD = {
    # arrays
    "q_3d": dict(q=f32(3, 5, 8)),
    "q_5d": dict(q=f32(1, 2, 3, 5, 8)),
    "q_float64": dict(q=f32(2, 3, 5, 8).astype(np.float64)),
    "q_float16": dict(q=f32(2, 3, 5, 8).astype(np.float16)),
    "q_int": dict(q=np.ones((2, 3, 5, 8), np.int32)),
    "q_list": dict(q=f32(2, 3, 5, 8).tolist()),
    "q_none": dict(q=None),
    "k_none": dict(k=None),
    "v_none": dict(v=None),
    "out_none": dict(out=None),
    "q_last_stride": dict(q=f32(2, 3, 5, 16)[..., ::2]),
    "k_last_stride_neg": dict(k=f32(2, 3, 7, 8)[..., ::-1]),
    "v_last_stride": dict(v=f32(2, 3, 7, 8)[..., ::2]),
    "q_unaligned": dict(q=_unaligned((2, 3, 5, 8))),
    "k_batch": dict(k=f32(1, 3, 7, 8)),
    "k_E": dict(k=f32(2, 3, 7, 9)),
    "v_Lk": dict(v=f32(2, 3, 6, 4)),
    "v_heads": dict(v=f32(2, 1, 7, 4)),
    "gqa_not_dividing": dict(k=f32(2, 2, 7, 8), v=f32(2, 2, 7, 4)),
    "gqa_zero_kv": dict(k=f32(2, 0, 7, 8), v=f32(2, 0, 7, 4)),
    "out_readonly": dict(out=_readonly(np.zeros((2, 3, 5, 4), np.float32))),
    "out_float64": dict(out=np.zeros((2, 3, 5, 4))),
    "out_shape": dict(out=np.zeros((2, 3, 5, 5), np.float32)),
    "out_3d": dict(out=np.zeros((6, 5, 4), np.float32)),
    "out_last_stride": dict(out=np.zeros((2, 3, 5, 8), np.float32)[..., ::2]),
    "weights_shape": dict(weights=np.zeros((2, 3, 5, 6), np.float32)),
    "weights_float64": dict(weights=np.zeros((2, 3, 5, 7))),
    "weights_noncontiguous": dict(weights=np.zeros((2, 3, 7, 5), np.float32).swapaxes(2, 3)),
    "weights_readonly": dict(weights=_readonly(np.zeros((2, 3, 5, 7), np.float32))),
    "weights_list": dict(weights=[0.0]),
    "mask_int32": dict(mask=np.ones((2, 3, 5, 7), np.int32)),
    "mask_uint8": dict(mask=np.ones((2, 3, 5, 7), np.uint8)),
    "mask_float64": dict(mask=np.zeros((2, 3, 5, 7))),
    "mask_shape": dict(mask=np.ones((2, 3, 5, 6), bool)),
    "mask_2d": dict(mask=np.ones((5, 7), bool)),
    "mask_list": dict(mask=[[True]]),
    # lengths
    "kl_int32": dict(key_lengths=np.full((2, 3), 7, np.int32)),
    "kl_float": dict(key_lengths=np.full((2, 3), 7.0)),
    "kl_1d": dict(key_lengths=np.full(2, 7, np.int64)),
    "kl_shape": dict(key_lengths=np.full((2, 2), 7, np.int64)),
    "kl_negative": dict(key_lengths=np.array([[7, 7, -1], [7, 7, 7]], np.int64)),
    "kl_past_L": dict(key_lengths=np.array([[7, 7, 7], [8, 7, 7]], np.int64)),
    "kl_huge": dict(key_lengths=np.full((2, 3), 2**62, np.int64)),
    "ql_negative": dict(query_lengths=np.array([[5, -3, 5], [5, 5, 5]], np.int64)),
    "ql_past_L": dict(query_lengths=np.full((2, 3), 6, np.int64)),
    "kl_list": dict(key_lengths=[[7, 7, 7], [7, 7, 7]]),
    # scalars
    "causal_3": dict(causal=3),
    "causal_negative": dict(causal=-1),
    "causal_str": dict(causal="1"),
    "causal_none": dict(causal=None),
    "scale_nan": dict(scale=float("nan")),
    "scale_inf": dict(scale=float("inf")),
    "scale_overflows_float32": dict(scale=1e39),
    "scale_str": dict(scale="0.5"),
    "scale_none": dict(scale=None),
}


@pytest.mark.parametrize("name", list(FORWARD_BAD))
def test_forward_bad_arguments(name):
    args = fw_args(**FORWARD_BAD[name])
    out = args["out"]
    out_before = out.copy() if isinstance(out, np.ndarray) else None
    with pytest.raises((TypeError, ValueError)):
        call_forward(args)
    if isinstance(out, np.ndarray) and out.flags.writeable:
        np.testing.assert_array_equal(out, out_before, err_msg="out written despite the error")


def test_forward_causal_overflow():
    # a Python int past C int: an exception of some kind, never a crash
    with pytest.raises((TypeError, ValueError, OverflowError)):
        call_forward(fw_args(causal=2**40))


@pytest.mark.parametrize("nargs", [0, 9, 13])
def test_forward_wrong_argument_count(nargs):
    # the 11th and 12th, lse and variant, are optional
    args = [fw_args()[n] for n in ORDER] + [None, None, None]
    with pytest.raises(TypeError):
        _attnx.forward(*args[:nargs])


@pytest.mark.parametrize("which", ["q", "mask", "key_lengths"])
def test_forward_byte_swapped(which):
    """Non-native byte order: rejected, or read correctly; never misread."""
    good = fw_args(mask=np.random.default_rng(2).standard_normal((2, 3, 5, 7)).astype(np.float32),
                   key_lengths=np.array([[7, 3, 1], [7, 7, 2]], np.int64))
    call_forward(good)
    args = fw_args(mask=good["mask"].copy(), key_lengths=good["key_lengths"].copy())
    args[which] = _big_endian(args[which])
    try:
        call_forward(args)
    except (TypeError, ValueError):
        return
    np.testing.assert_array_equal(args["out"], good["out"])


def test_forward_no_leaks_on_errors():
    args = fw_args()
    objs = [args[n] for n in ORDER[:8]]
    before = [sys.getrefcount(o) for o in objs]
    for name in ("kl_past_L", "ql_negative", "mask_shape", "causal_3", "scale_nan"):
        bad = dict(args, **FORWARD_BAD[name])
        for _ in range(20):
            with pytest.raises((TypeError, ValueError)):
                call_forward(bad)
        del bad
    for _ in range(20):
        call_forward(args)
    assert [sys.getrefcount(o) for o in objs] == before


# ------------------------------------------------------- ISA and threads API

def test_set_isa_errors():
    current = _attnx.isa()
    with pytest.raises(ValueError, match=re.escape("'no-such'")):
        _attnx.set_isa("no-such")
    with pytest.raises(ValueError):
        _attnx.set_isa("")
    with pytest.raises(TypeError):
        _attnx.set_isa(3)
    with pytest.raises(TypeError):
        _attnx.set_isa(None)
    assert _attnx.isa() == current


def test_set_num_threads_errors():
    before = _attnx.get_num_threads()
    try:
        with pytest.raises(TypeError):
            _attnx.set_num_threads("2")
        with pytest.raises(TypeError):
            attnx.set_num_threads(None)
        assert _attnx.get_num_threads() == before
        attnx.set_num_threads(0)                    # <= 0: the default
        assert attnx.get_num_threads() >= 1
    finally:
        _attnx.set_num_threads(before)
