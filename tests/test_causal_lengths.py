"""The masks attnx applies without building them: ``is_causal`` (upper-left
and lower-right, alone and with a mask) and ``key_lengths``/``query_lengths``
in every integer form, against ``attnx.reference`` and the independent
``naive`` oracle (conftest), on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import (assert_close, check_against_reference, make_qkv, naive, randn,
                      random_bool_mask, random_mask)

sdpa = attnx.scaled_dot_product_attention


# ---------------------------------------------------------------- causal

LQ_LK = [(1, 1), (1, 9), (9, 1), (3, 7), (7, 7), (7, 3), (16, 16), (17, 33), (33, 17), (40, 70)]


@pytest.mark.parametrize("is_causal", [True, "upper_left", "lower_right"])
@pytest.mark.parametrize("lq_lk", LQ_LK, ids=str)
def test_causal(isa, rng, is_causal, lq_lk):
    Lq, Lk = lq_lk
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=Lq, Lk=Lk, E=17, Ev=9)
    out, w = check_against_reference(q, k, v, is_causal=is_causal, need_weights=True)
    offset = Lk - Lq if is_causal == "lower_right" else 0
    tri = np.tril(np.ones((Lq, Lk), dtype=bool), k=offset)
    o_n, w_n = naive(q, k, v, allowed=tri)
    assert_close(out, o_n)
    assert_close(w, w_n)
    # the same as passing the triangle as an explicit bool mask
    assert_close(sdpa(q, k, v, attn_mask=tri), o_n)
    assert not np.any(w[..., ~tri]), "weights above the causal diagonal must be 0"
    if is_causal == "lower_right" and Lq > Lk:
        # the first Lq - Lk queries see no key: zeros, never NaN
        assert not np.any(out[..., : Lq - Lk, :])
        assert not np.any(w[..., : Lq - Lk, :])


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("is_causal", [True, "lower_right"])
@pytest.mark.parametrize("lq_lk", [(5, 8), (8, 8), (8, 5)], ids=str)
def test_causal_and_mask(isa, rng, kind, is_causal, lq_lk):
    Lq, Lk = lq_lk
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=Lq, Lk=Lk, E=16)
    mask = random_mask(rng, kind, (2, 1, Lq, Lk))
    kl = np.array([Lk, Lk - 2])
    out, w = check_against_reference(q, k, v, attn_mask=mask, is_causal=is_causal,
                                     key_lengths=kl, need_weights=True)
    offset = Lk - Lq if is_causal == "lower_right" else 0
    allowed = np.tril(np.ones((Lq, Lk), dtype=bool), k=offset) & (np.arange(Lk) < kl[:, None, None, None])
    if kind == "bool":
        allowed = allowed & mask
        o_n, w_n = naive(q, k, v, allowed=allowed)
    else:
        o_n, w_n = naive(q, k, v, allowed=allowed, add=mask)
    assert_close(out, o_n)
    assert_close(w, w_n)


# --------------------------------------------------------------- lengths

LENGTH_FORMS = {
    "int64": lambda a: np.asarray(a, dtype=np.int64),
    "int32": lambda a: np.asarray(a, dtype=np.int32),
    "uint8": lambda a: np.asarray(a, dtype=np.uint8),
    "list": lambda a: [int(x) for x in a],
    "strided": lambda a: np.repeat(np.asarray(a, dtype=np.int64), 2)[::2],
}


@pytest.mark.parametrize("which", ["key", "query", "both"])
@pytest.mark.parametrize("form", list(LENGTH_FORMS))
def test_lengths(isa, rng, form, which):
    Lq, Lk = 6, 11
    q, k, v = make_qkv(rng, B=(4,), Hq=3, Lq=Lq, Lk=Lk, E=9, Ev=5)
    kl = np.array([0, 1, Lk, 5])
    ql = np.array([Lq, 0, 3, 1])
    kw = {}
    if which in ("key", "both"):
        kw["key_lengths"] = LENGTH_FORMS[form](kl)
    if which in ("query", "both"):
        kw["query_lengths"] = LENGTH_FORMS[form](ql)
    out, w = check_against_reference(q, k, v, need_weights=True, **kw)
    allowed = np.arange(Lk) < (kl if "key_lengths" in kw else np.full(4, Lk))[:, None, None, None]
    row_ok = (np.arange(Lq)[:, None] < (ql if "query_lengths" in kw else np.full(4, Lq))[:, None, None, None])
    o_n, w_n = naive(q, k, v, allowed=allowed, row_ok=row_ok)
    assert_close(out, o_n)
    assert_close(w, w_n)
    if "key_lengths" in kw:
        assert not out[0].any() and not w[0].any()       # key length 0 -> zeros
    if "query_lengths" in kw:
        assert not out[1].any() and not w[1].any()       # query length 0 -> zeros
        assert not out[2, :, 3:].any()                   # padded query rows -> zeros


def test_lengths_3d_and_2d(isa, rng):
    # 3-D (N, L, E): one length per leading row
    q, k, v = randn(rng, (3, 4, 8)), randn(rng, (3, 6, 8)), randn(rng, (3, 6, 8))
    kl, ql = np.array([6, 2, 0]), np.array([4, 1, 3])
    out = check_against_reference(q, k, v, key_lengths=kl, query_lengths=ql)
    allowed = (np.arange(6) < kl[:, None, None])[:, None]
    row_ok = (np.arange(4)[:, None] < ql[:, None, None])[:, None]
    o_n, _ = naive(q[:, None], k[:, None], v[:, None], allowed=allowed, row_ok=row_ok)
    assert_close(out, o_n[:, 0])
    # 2-D (L, E): a scalar length
    out2 = check_against_reference(q[0], k[0], v[0], key_lengths=2, query_lengths=3)
    o_n, _ = naive(q[None, None, 0], k[None, None, 0], v[None, None, 0],
                   allowed=np.arange(6) < 2, row_ok=(np.arange(4) < 3)[:, None])
    assert_close(out2, o_n[0, 0])


def test_lengths_combined_with_mask_and_causal(isa, rng):
    q, k, v = make_qkv(rng, B=(3,), Hq=2, Lq=7, Lk=7, E=16)
    mask = random_bool_mask(rng, (3, 1, 7, 7), p=0.8)
    kl, ql = np.array([7, 3, 0]), np.array([5, 7, 7])
    check_against_reference(q, k, v, attn_mask=mask, is_causal=True, key_lengths=kl,
                            query_lengths=ql, need_weights=True)
