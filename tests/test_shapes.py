"""Shapes: 2-D to 6-D inputs, odd sizes around every vector width, and
zero-size dimensions, on every ISA.

Each problem is compared with ``attnx.reference`` and, where the reference's
shared argument handling could hide a mistake, with ``naive`` (conftest): an
independent float64 implementation on explicit 4-D arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import (assert_close, check_against_reference, make_qkv, naive, randn,
                      random_bool_mask, random_float_mask)

sdpa = attnx.scaled_dot_product_attention


# ---------------------------------------------------------------- shapes

SHAPES = {
    "2d": ((5, 16), (7, 16), (7, 16)),
    "2d-1x1": ((1, 1), (1, 1), (1, 1)),
    "2d-Ev": ((6, 8), (3, 8), (3, 5)),
    "3d": ((3, 5, 16), (3, 7, 16), (3, 7, 9)),
    "4d": ((2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 12)),
    "4d-Lq>Lk": ((2, 2, 9, 8), (2, 2, 4, 8), (2, 2, 4, 8)),
    "5d": ((2, 2, 3, 5, 8), (2, 2, 3, 7, 8), (2, 2, 3, 7, 8)),
    "6d": ((1, 2, 2, 2, 4, 4), (1, 2, 2, 2, 6, 4), (1, 2, 2, 2, 6, 3)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_ndim_shapes(isa, rng, name):
    qs, ks, vs = SHAPES[name]
    q, k, v = randn(rng, qs), randn(rng, ks), randn(rng, vs)
    out, w = check_against_reference(q, k, v, need_weights=True)
    assert out.shape == qs[:-1] + vs[-1:]
    assert w.shape == qs[:-1] + ks[-2:-1]
    # Independently of the reference: every leading index is its own problem.
    lead = qs[:-2]
    q4 = q.reshape((-1, 1) + qs[-2:])
    k4 = k.reshape((-1, 1) + ks[-2:])
    v4 = v.reshape((-1, 1) + vs[-2:])
    o_naive, w_naive = naive(q4, k4, v4)
    assert_close(out, o_naive.reshape(lead + o_naive.shape[-2:]))
    assert_close(w, w_naive.reshape(lead + w_naive.shape[-2:]))


def test_5d_with_mask_and_lengths(isa, rng):
    q, k, v = make_qkv(rng, B=(2, 3), Hq=2, Lq=4, Lk=6, E=8)
    mask = random_bool_mask(rng, (3, 1, 1, 6))
    kl = np.array([[6, 0, 3], [1, 6, 5]])
    out, w = check_against_reference(q, k, v, attn_mask=mask, key_lengths=kl, need_weights=True)
    allowed = np.broadcast_to(mask, (2, 3, 2, 4, 6)) & (np.arange(6) < kl[:, :, None, None, None])
    o_n, w_n = naive(q.reshape(6, 2, 4, 8), k.reshape(6, 2, 6, 8), v.reshape(6, 2, 6, 8),
                     allowed=allowed.reshape(6, 2, 4, 6))
    assert_close(out, o_n.reshape(out.shape))
    assert_close(w, w_n.reshape(w.shape))


# --------------------------------------------- odd sizes around vector widths

E_SET = [1, 3, 8, 15, 16, 17, 31, 32, 33, 64, 65, 128]
ODD_L = list(range(1, 34)) + [47, 63, 64, 65, 127, 129, 267, 514]


@pytest.mark.parametrize("Lk", ODD_L)
def test_odd_key_lengths(isa, rng, Lk):
    for j, E in enumerate((E_SET[Lk % 12], E_SET[(5 * Lk + 7) % 12])):
        Ev = E_SET[(Lk + 3 * j) % 12]
        q, k, v = make_qkv(rng, B=(1,), Hq=2, Lq=3, Lk=Lk, E=E, Ev=Ev)
        check_against_reference(q, k, v, need_weights=True)
        mask = random_bool_mask(rng, (3, Lk))
        mask[:, Lk - 1] = True        # the tail of the row must count too
        check_against_reference(q, k, v, attn_mask=mask, need_weights=(j == 0))


@pytest.mark.parametrize("Ev", [1, 7, 16, 17, 33, 128])
@pytest.mark.parametrize("E", E_SET)
def test_head_dims(isa, rng, E, Ev):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=4, Lk=19, E=E, Ev=Ev)
    check_against_reference(q, k, v, need_weights=True)


@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("Lq", [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 267])
def test_odd_query_lengths(isa, rng, Lq, causal):
    Lk = (2 * Lq) // 3 + 1
    q, k, v = make_qkv(rng, B=(1,), Hq=2, Lq=Lq, Lk=Lk, E=33, Ev=17)
    check_against_reference(q, k, v, is_causal=causal, need_weights=True)


@pytest.mark.parametrize("causal", [False, "lower_right"])
def test_long_sequences(isa, rng, causal):
    q, k, v = make_qkv(rng, B=(1,), Hq=2, Lq=267, Lk=514, E=65, Ev=64)
    mask = random_float_mask(rng, (267, 514), p_inf=0.1)
    check_against_reference(q, k, v, attn_mask=mask, is_causal=causal, need_weights=True)


# ------------------------------------------------------------- zero sizes

ZERO_CASES = {
    "B=0": dict(B=(0,)),
    "H=0": dict(Hq=0),
    "Lq=0": dict(Lq=0),
    "Lk=0": dict(Lk=0),
    "Lq=Lk=0": dict(Lq=0, Lk=0),
    "E=0": dict(E=0),
    "Ev=0": dict(Ev=0),
    "5d-B=0": dict(B=(2, 0)),
}


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_zero_size(isa, rng, name):
    kw = dict(B=(2,), Hq=3, Lq=4, Lk=6, E=8, Ev=5)
    kw.update(ZERO_CASES[name])
    q, k, v = make_qkv(rng, **kw)
    B, Hq, Lq, Lk, Ev = kw["B"], kw["Hq"], kw["Lq"], kw["Lk"], kw["Ev"]
    mask = random_bool_mask(rng, (Lq, Lk))
    for extra in ({}, {"attn_mask": mask}, {"is_causal": "lower_right"},
                  {"key_lengths": np.zeros(B, dtype=np.int64)}):
        out, w = check_against_reference(q, k, v, need_weights=True, **extra)
        assert out.shape == B + (Hq, Lq, Ev)
        assert w.shape == B + (Hq, Lq, Lk)
        assert not np.isnan(out).any() and not np.isnan(w).any()
    if name in ("Lk=0",):
        out, w = sdpa(q, k, v, need_weights=True)
        assert not out.any()            # every row fully masked: zeros
    if name == "E=0":
        # all scores are 0: uniform weights, the mean of the values
        out, w = sdpa(q, k, v, need_weights=True)
        assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True), out.shape))
        assert_close(w, np.full(w.shape, 1.0 / Lk))


def test_zero_size_2d(isa, rng):
    out = sdpa(np.zeros((0, 4), np.float32), randn(rng, (3, 4)), randn(rng, (3, 2)))
    assert out.shape == (0, 2) and out.dtype == np.float32
    out = sdpa(randn(rng, (3, 4)), np.zeros((0, 4), np.float32), np.zeros((0, 2), np.float32))
    assert out.shape == (3, 2) and not out.any()
