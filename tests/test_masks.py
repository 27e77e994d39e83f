"""Masks: bool and float masks of every broadcastable shape (as given or as
stride-0 views), float16/float64 masks, and rows that allow no key (zeros,
never NaN), against ``attnx.reference`` and the independent ``naive`` oracle
(conftest), on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import (LOW_FLOATS, assert_close, check_against_reference, make_qkv, naive,
                      random_bool_mask, random_float_mask, random_mask)

sdpa = attnx.scaled_dot_product_attention


# ----------------------------------------------------------------- masks

B_, H_, LQ, LK = 2, 3, 5, 7
MASK_SHAPES = [
    (), (LK,), (1, LK), (LQ, 1), (LQ, LK), (1, 1, LQ, LK), (B_, 1, 1, LK),
    (B_, H_, LQ, 1), (H_, 1, 1), (H_, LQ, LK), (1, H_, 1, LK), (B_, 1, LQ, LK),
    (1, 1, 1, 1), (B_, H_, LQ, LK),
]



@pytest.mark.parametrize("how", ["as_is", "broadcast_to"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_broadcast_shapes(isa, rng, shape, kind, how):
    q, k, v = make_qkv(rng, B=(B_,), Hq=H_, Lq=LQ, Lk=LK, E=16, Ev=8)
    mask = random_mask(rng, kind, shape)
    full = np.broadcast_to(mask, (B_, H_, LQ, LK))
    arg = full if how == "broadcast_to" else mask
    if how == "broadcast_to" and shape != (B_, H_, LQ, LK):
        assert 0 in full.strides            # really a stride-0 view
    out, w = check_against_reference(q, k, v, attn_mask=arg, need_weights=True)
    full = full.copy()
    if kind == "bool":
        o_n, w_n = naive(q, k, v, allowed=full)
    else:
        o_n, w_n = naive(q, k, v, add=full)
    assert_close(out, o_n)
    assert_close(w, w_n)


@pytest.mark.parametrize("dtype", LOW_FLOATS + [np.float64])
def test_float_mask_dtypes(isa, rng, dtype):
    q, k, v = make_qkv(rng, Lq=6, Lk=9, E=8)
    mask = random_float_mask(rng, (6, 9)).astype(dtype)
    out = sdpa(q, k, v, attn_mask=mask)
    assert out.dtype == np.float32
    # the mask is used as float32
    np.testing.assert_array_equal(out, sdpa(q, k, v, attn_mask=mask.astype(np.float32)))
    assert_close(out, naive(q, k, v, add=mask.astype(np.float32))[0])


def test_scalar_false_mask_gives_zeros(isa, rng):
    q, k, v = make_qkv(rng)
    out, w = sdpa(q, k, v, attn_mask=np.array(False), need_weights=True)
    assert not out.any() and not w.any()


# ------------------------------------------------------- fully masked rows

def _fully_masked_case(rng, how):
    """Inputs and the (B, H, Lq) rows expected to be fully masked."""
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=6, Lk=5, E=16)
    dead = np.zeros((2, 2, 6), dtype=bool)
    kw = {}
    if how == "bool_rows_false":
        m = random_bool_mask(rng, (2, 2, 6, 5), p=0.9)
        m[0, 1, 2] = False
        m[1, :, 5] = False
        kw["attn_mask"] = m
        dead = ~m.any(-1)
    elif how == "float_rows_neginf":
        m = random_float_mask(rng, (2, 2, 6, 5), p_inf=0.1)
        m[0, 1, 2] = -np.inf
        m[1, :, 0] = -np.inf
        kw["attn_mask"] = m
        dead = np.isneginf(m).all(-1)
    elif how == "float_neginf_and_lengths":
        # row 4: the only keys inside key_lengths get -inf from the float mask
        f = random_float_mask(rng, (6, 5), p_inf=0.0)
        f[4, :2] = -np.inf
        kw["attn_mask"] = f
        kw["key_lengths"] = np.array([2, 2])
        dead[:, :, 4] = True
    elif how == "causal_and_float_neginf":
        f = np.zeros((6, 5), dtype=np.float32)
        f[:, 0] = -np.inf                     # row 0 only sees key 0 causally
        kw["attn_mask"] = f
        kw["is_causal"] = True
        dead[:, :, 0] = True
    elif how == "lower_right_Lq_gt_Lk":
        kw["is_causal"] = "lower_right"
        dead[:, :, :1] = True
    elif how == "causal_and_mask":
        m = np.ones((6, 5), dtype=bool)
        m[:, 0] = False                       # row 0 only sees key 0 causally
        kw["attn_mask"] = m
        kw["is_causal"] = True
        dead[:, :, 0] = True
    elif how == "key_lengths_zero":
        kw["key_lengths"] = np.array([0, 5])
        dead[0] = True
    elif how == "query_lengths":
        kw["query_lengths"] = np.array([6, 2])
        dead[1, :, 2:] = True
    return q, k, v, kw, dead


FULLY_MASKED = ["bool_rows_false", "float_rows_neginf", "float_neginf_and_lengths",
                "lower_right_Lq_gt_Lk", "causal_and_mask", "causal_and_float_neginf",
                "key_lengths_zero", "query_lengths"]


@pytest.mark.parametrize("how", FULLY_MASKED)
def test_fully_masked_rows_give_zeros(isa, rng, how):
    q, k, v, kw, dead = _fully_masked_case(rng, how)
    assert dead.any()
    out, w = check_against_reference(q, k, v, need_weights=True, **kw)
    assert not np.isnan(out).any() and not np.isnan(w).any()
    assert not out[dead].any(), "fully masked rows must give zeros"
    assert not w[dead].any(), "fully masked rows must have zero weights"
    assert out[~dead].any()
    np.testing.assert_allclose(w[~dead].astype(np.float64).sum(-1), 1.0, atol=1e-5, rtol=0)
