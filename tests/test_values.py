"""What comes out: the scale, the weights (``need_weights``), NaN and inf in
the inputs, large scores, and float16/float64 inputs (computed in float32), on
every ISA."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnx
from conftest import (assert_close, check_against_reference, make_qkv, naive, randn,
                      random_bool_mask, random_float_mask)

sdpa = attnx.scaled_dot_product_attention
ref = attnx.reference


# ----------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.125, 1.0, 2.5, -1.0, -0.3])
def test_scale(isa, rng, scale):
    q, k, v = make_qkv(rng, Lq=5, Lk=8, E=16, Ev=6)
    out = check_against_reference(q, k, v, scale=scale)
    assert_close(out, naive(q, k, v, scale=scale)[0])
    if scale == 0.0:   # uniform weights: the mean of the values
        assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=2, keepdims=True), out.shape))


def test_default_scale_is_one_over_sqrt_E(isa, rng):
    q, k, v = make_qkv(rng, Lq=5, Lk=8, E=24, Ev=3)     # Ev != E: the scale uses E
    out = sdpa(q, k, v)
    np.testing.assert_array_equal(out, sdpa(q, k, v, scale=1.0 / math.sqrt(24)))
    assert_close(out, naive(q, k, v, scale=1.0 / math.sqrt(24))[0])


# ------------------------------------------------------------ need_weights

def test_need_weights(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=9, Lk=21, E=16, Ev=7)
    mask = random_bool_mask(rng, (2, 3, 9, 21), p=0.5)
    mask[0, 0, 3] = False                                   # one fully masked row
    out, w = sdpa(q, k, v, attn_mask=mask, need_weights=True)
    assert w.dtype == np.float32 and w.shape == (2, 3, 9, 21)
    assert w.flags.c_contiguous and w.flags.writeable
    rows = mask.any(axis=-1)
    sums = w.astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(sums[rows], 1.0, rtol=0, atol=1e-5)
    assert not sums[~rows].any()
    assert not w[~mask].any(), "masked positions must have weight exactly 0"
    assert (w >= 0).all()
    # the output is the weights applied to the values
    assert_close(out, w.astype(np.float64) @ v.astype(np.float64))
    ref_out, ref_w = ref(q, k, v, attn_mask=mask, need_weights=True)
    assert_close(w, ref_w)
    # asking for the weights does not change the output beyond the bar
    out_only = sdpa(q, k, v, attn_mask=mask)
    assert_close(out_only, ref_out)
    assert_close(out_only, out.astype(np.float64))


# ------------------------------------------------------------- NaN and inf

def test_nan_in_query_row(isa, rng):
    q, k, v = make_qkv(rng, Lq=6, Lk=19, E=17)
    q[0, 1, 2, 5] = np.nan
    out, w = check_against_reference(q, k, v, need_weights=True)
    assert np.isnan(out[0, 1, 2]).all() and np.isnan(w[0, 1, 2]).all()
    nan_rows = np.isnan(out).any(-1)
    assert nan_rows.sum() == 1, "NaN must stay in its own query row"


def test_inf_in_key(isa, rng):
    q, k, v = make_qkv(rng, B=(1,), Hq=2, Lq=8, Lk=9, E=16)
    q[..., 0] = np.where(np.arange(8) % 2 == 0, 1.0, -1.0) * (0.5 + np.abs(q[..., 0]))
    k[0, 0, 4, 0] = np.inf
    out, w = check_against_reference(q, k, v, need_weights=True)
    # q·k = +inf for even rows: inf - inf in the softmax -> NaN rows (as the reference)
    assert np.isnan(out[0, 0, 0::2]).all()
    # q·k = -inf for odd rows: that key gets weight 0, the rows stay finite
    assert np.isfinite(out[0, 0, 1::2]).all()
    assert not w[0, 0, 1::2, 4].any()
    assert np.isfinite(out[0, 1]).all()          # the other head is untouched


def test_inf_and_nan_in_values(isa, rng):
    q, k, v = make_qkv(rng, B=(1,), Hq=1, Lq=6, Lk=9, E=8, Ev=4)
    v[0, 0, 3, 1] = np.inf
    v[0, 0, 5, 2] = np.nan
    mask = np.ones((6, 9), dtype=bool)
    mask[4:, 3] = False                   # rows 4, 5 do not see the inf
    mask[5, 5] = False                    # row 5 does not see the NaN
    out = check_against_reference(q, k, v, attn_mask=mask)
    assert np.isposinf(out[0, 0, :4, 1]).all()
    assert np.isfinite(out[0, 0, 4:, 1]).all()
    assert np.isnan(out[0, 0, :5, 2]).all()
    assert np.isfinite(out[0, 0, 5]).all()
    assert np.isfinite(out[..., [0, 3]]).all()


@pytest.mark.parametrize("where", ["bool_mask", "key_lengths", "causal"])
def test_masked_nonfinite_keys_do_not_leak(isa, rng, where):
    Lq, Lk = 5, 8
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=Lq, Lk=Lk, E=16)
    k[..., Lk - 1, 3] = np.nan
    v[..., Lk - 1, 0] = np.inf
    v[..., Lk - 1, 1] = np.nan
    kw = {"bool_mask": dict(attn_mask=np.arange(Lk) < Lk - 1),
          "key_lengths": dict(key_lengths=np.array([Lk - 1, 3])),
          "causal": dict(is_causal=True)}[where]           # Lq < Lk: last key never seen
    out, w = check_against_reference(q, k, v, need_weights=True, **kw)
    assert np.isfinite(out).all() and np.isfinite(w).all()


def test_nan_in_float_mask_and_padded_query(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=1, Lq=5, Lk=7, E=8)
    m = random_float_mask(rng, (2, 1, 5, 7), p_inf=0.0)
    m[0, 0, 1, 3] = np.nan
    q[1, 0, 4, 0] = np.nan                              # a padded query row
    out, w = check_against_reference(q, k, v, attn_mask=m, query_lengths=np.array([5, 4]),
                                     need_weights=True)
    assert np.isnan(out[0, 0, 1]).all()
    assert np.isnan(out).any(-1).sum() == 1
    assert not out[1, 0, 4].any() and not w[1, 0, 4].any()    # padded rows: zeros


# --------------------------------------------------------- large scores

def test_large_scores_integer_inputs(isa, rng):
    # small integers: q·k is exact, so scale=100 gives score gaps >= 100 and
    # exp() of the raw scores would overflow float32 without max-subtraction
    q = rng.integers(-2, 3, (2, 2, 8, 16)).astype(np.float32)
    k = rng.integers(-2, 3, (2, 2, 13, 16)).astype(np.float32)
    v = randn(rng, (2, 2, 13, 8))
    out, w = check_against_reference(q, k, v, scale=100.0, need_weights=True)
    assert np.isfinite(out).all()
    # weights are one-hot, or split exactly between tied keys
    top = w.max(-1)
    assert ((np.abs(top - 1.0) < 1e-6) | (np.abs(1.0 / top - np.round(1.0 / top)) < 1e-5)).all()


def test_large_scores_random(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=9, Lk=31, E=32)
    q *= 30
    out, w = sdpa(q, k, v, scale=100.0, need_weights=True)      # scores ~ 1e4
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_allclose(w.astype(np.float64).sum(-1), 1.0, atol=1e-5, rtol=0)
    # each output is a convex combination of the value rows
    vmin = v.min(axis=2, keepdims=True)
    vmax = v.max(axis=2, keepdims=True)
    assert (out >= vmin - 1e-5).all() and (out <= vmax + 1e-5).all()


# ------------------------------------------------------------ input dtypes

@pytest.mark.parametrize("dtypes", [("f2", "f2", "f2"), ("f8", "f8", "f8"), ("f2", "f8", "f4"),
                                    ("f4", "f4", "f8")], ids=str)
def test_input_dtypes(isa, rng, dtypes):
    q, k, v = make_qkv(rng, Lq=5, Lk=11, E=16, Ev=8)
    q, k, v = (a.astype(dt) for a, dt in zip((q, k, v), dtypes))
    out, w = sdpa(q, k, v, is_causal=True, need_weights=True)
    assert out.dtype == np.float32 and w.dtype == np.float32
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    out32, w32 = sdpa(q32, k32, v32, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(out, out32)       # converted, then computed in float32
    np.testing.assert_array_equal(w, w32)
    ref_out, ref_w = ref(q32, k32, v32, is_causal=True, need_weights=True)
    assert_close(out, ref_out)
    assert_close(w, ref_w)
