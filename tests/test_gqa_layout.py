"""Grouped-query attention (``enable_gqa``) and the (B..., L, H, E) layout
(``layout="blhd"``), against ``attnx.reference`` and the independent ``naive``
oracle (conftest), on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import assert_close, check_against_reference, make_qkv, naive, randn, random_bool_mask

sdpa = attnx.scaled_dot_product_attention
ref = attnx.reference


# ------------------------------------------------------------------- GQA

@pytest.mark.parametrize("heads", [(8, 2), (1, 1), (4, 1), (6, 3), (8, 8)], ids=str)
def test_gqa(isa, rng, heads):
    Hq, Hk = heads
    q, k, v = make_qkv(rng, B=(2,), Hq=Hq, Hk=Hk, Lq=5, Lk=9, E=16, Ev=8)
    mask = random_bool_mask(rng, (2, Hq, 5, 9))     # different per query head
    kl = np.array([9, 4])
    out, w = check_against_reference(q, k, v, attn_mask=mask, key_lengths=kl,
                                     enable_gqa=True, need_weights=True)
    assert out.shape == (2, Hq, 5, 8) and w.shape == (2, Hq, 5, 9)
    g = Hq // Hk
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)   # head h uses kv head h // g
    allowed = mask & (np.arange(9) < kl[:, None, None, None])
    o_n, w_n = naive(q, kr, vr, allowed=allowed)
    assert_close(out, o_n)
    assert_close(w, w_n)


def test_gqa_blhd(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=8, Hk=2, Lq=5, Lk=6, E=8)
    t = lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2))
    out = sdpa(t(q), t(k), t(v), enable_gqa=True, layout="blhd", is_causal=True)
    o_n, _ = naive(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1),
                   allowed=np.tril(np.ones((5, 6), dtype=bool)))
    assert_close(np.swapaxes(out, 1, 2), o_n)


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("nd", [3, 4, 5])
def test_layout_blhd(isa, rng, nd):
    lead = {3: (), 4: (2,), 5: (2, 2)}[nd]
    H, Lq, Lk, E, Ev = 3, 5, 7, 16, 8
    q = randn(rng, lead + (H, Lq, E))
    k = randn(rng, lead + (H, Lk, E))
    v = randn(rng, lead + (H, Lk, Ev))
    mask = random_bool_mask(rng, (H, Lq, Lk), p=0.8)
    kw = dict(attn_mask=mask, is_causal="lower_right")
    if lead:
        kw["key_lengths"] = np.full(lead, Lk - 1)
    # transpose explicitly here: (B..., H, L, E) -> (B..., L, H, E)
    t = lambda a: np.ascontiguousarray(np.swapaxes(a, -2, -3))
    out, w = sdpa(t(q), t(k), t(v), layout="blhd", need_weights=True, **kw)
    assert out.shape == lead + (Lq, H, Ev)
    assert w.shape == lead + (H, Lq, Lk)
    ref_out, ref_w = ref(q, k, v, need_weights=True, **kw)
    assert_close(np.swapaxes(out, -2, -3), ref_out)
    assert_close(w, ref_w)
    # and independently of the reference
    n = int(np.prod(lead))
    allowed = mask & np.tril(np.ones((Lq, Lk), dtype=bool), k=Lk - Lq)
    if lead:
        allowed = allowed & (np.arange(Lk) < Lk - 1)
    o_n, w_n = naive(q.reshape(n, H, Lq, E), k.reshape(n, H, Lk, E), v.reshape(n, H, Lk, Ev),
                     allowed=allowed)
    assert_close(np.swapaxes(out, -2, -3).reshape(o_n.shape), o_n)


def test_layout_blhd_from_projection(isa, rng):
    # what x @ W reshaped gives: (B, L, H, E), no transpose copy by the caller
    B, L, D, H, E = 2, 9, 12, 4, 8
    x = randn(rng, (B, L, D))
    Wq, Wk, Wv = (randn(rng, (D, H * E), scale=0.3) for _ in range(3))
    q, k, v = ((x @ W).reshape(B, L, H, E) for W in (Wq, Wk, Wv))
    out = sdpa(q, k, v, layout="blhd", is_causal=True)
    assert out.shape == (B, L, H, E)
    t = lambda a: np.swapaxes(a, 1, 2).copy()
    o_n, _ = naive(t(q), t(k), t(v), allowed=np.tril(np.ones((L, L), dtype=bool)))
    assert_close(t(out), o_n)
