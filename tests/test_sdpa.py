"""attnx.scaled_dot_product_attention against the float64 reference, on every ISA.

Most tests compare with ``attnx.reference`` (float64 NumPy, same signature).
Because the reference shares the argument normalisation of ``_functional``
(layout, broadcasting, lengths), the tests that exercise that normalisation
also check against ``naive`` below: an independent float64 implementation on
explicit, fully materialised 4-D arrays built in the test itself.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import (assert_close, check_against_reference, make_qkv, randn,
                      random_bool_mask, random_float_mask)

sdpa = attnx.scaled_dot_product_attention
ref = attnx.reference


def naive(q, k, v, allowed=None, add=None, scale=None, row_ok=None):
    """Independent float64 attention on explicit 4-D arrays with finite inputs.

    q (B, H, Lq, E), k (B, H, Lk, E), v (B, H, Lk, Ev) (same heads);
    ``allowed``: bool broadcastable to the scores; ``add``: float added to
    them; ``row_ok``: bool (B, H, Lq, 1), rows that are False give zeros.
    A row with nothing allowed (or only -inf scores) gives zeros.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    E = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    s = np.einsum("bhie,bhje->bhij", q, k) * scale
    if add is not None:
        s = s + np.asarray(add, dtype=np.float64)
    ok = np.ones(s.shape, dtype=bool)
    if allowed is not None:
        ok &= np.broadcast_to(allowed, s.shape)
    ok &= s > -np.inf
    s = np.where(ok, s, -np.inf)
    if s.shape[-1]:
        m = s.max(axis=-1, keepdims=True)
    else:
        m = np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(ok, np.exp(s - m), 0.0)
    tot = p.sum(axis=-1, keepdims=True)
    w = np.divide(p, tot, out=np.zeros_like(p), where=tot > 0)
    if row_ok is not None:
        w = w * row_ok
    return np.einsum("bhij,bhjd->bhid", w, v), w


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


# ----------------------------------------------------------------- masks

B_, H_, LQ, LK = 2, 3, 5, 7
MASK_SHAPES = [
    (), (LK,), (1, LK), (LQ, 1), (LQ, LK), (1, 1, LQ, LK), (B_, 1, 1, LK),
    (B_, H_, LQ, 1), (H_, 1, 1), (H_, LQ, LK), (1, H_, 1, LK), (B_, 1, LQ, LK),
    (1, 1, 1, 1), (B_, H_, LQ, LK),
]


def _make_mask(rng, kind, shape):
    if kind == "bool":
        m = random_bool_mask(rng, shape)
        if shape == ():
            m = np.array(True)
        return m
    return random_float_mask(rng, shape, p_inf=0.0 if shape == () else 0.2)


@pytest.mark.parametrize("how", ["as_is", "broadcast_to"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_broadcast_shapes(isa, rng, shape, kind, how):
    q, k, v = make_qkv(rng, B=(B_,), Hq=H_, Lq=LQ, Lk=LK, E=16, Ev=8)
    mask = _make_mask(rng, kind, shape)
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


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
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
    mask = _make_mask(rng, kind, (2, 1, Lq, Lk))
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


# ------------------------------------------------------ non-contiguous views

def _view(rng, kind, shape):
    """A float32 view of ``shape`` whose memory layout is given by ``kind``."""
    B, H, L, E = shape
    if kind == "step_slice":
        return randn(rng, (B, H * 2, L * 3, E))[:, ::2, ::3, :]
    if kind == "swapped_batch_head":
        return np.swapaxes(randn(rng, (H, B, L, E)), 0, 1)
    if kind == "negative_strides":
        return randn(rng, shape)[::-1, :, ::-1, :]
    if kind == "last_axis_step":
        return randn(rng, (B, H, L, 2 * E))[..., ::2]
    if kind == "last_axis_reversed":
        return randn(rng, shape)[..., ::-1]
    if kind == "fortran":
        return np.asfortranarray(randn(rng, shape))
    if kind == "transposed_L_E":
        return np.swapaxes(randn(rng, (B, H, E, L)), -1, -2)
    if kind == "offset_4_bytes":       # aligned to float, not to any vector width
        base = np.empty(B * H * L * E + 1, dtype=np.float32)
        a = base[1:].reshape(shape)
        a[...] = randn(rng, shape)
        return a
    if kind == "unaligned_bytes":      # not even aligned to 4 bytes
        buf = np.zeros(4 * B * H * L * E + 1, dtype=np.uint8)[1:]
        a = np.ndarray(shape, dtype=np.float32, buffer=buf)
        a[...] = randn(rng, shape)
        return a
    if kind == "big_endian":
        return randn(rng, shape).astype(">f4")
    if kind == "broadcast_batch":      # stride 0 on the batch axis
        return np.broadcast_to(randn(rng, (1, H, L, E)), shape)
    raise AssertionError(kind)


VIEW_KINDS = ["step_slice", "swapped_batch_head", "negative_strides", "last_axis_step",
              "last_axis_reversed", "fortran", "transposed_L_E", "offset_4_bytes",
              "unaligned_bytes", "big_endian", "broadcast_batch"]


@pytest.mark.parametrize("kind", VIEW_KINDS)
def test_non_contiguous_views(isa, rng, kind):
    B, H, Lq, Lk, E, Ev = 2, 3, 5, 19, 17, 9
    q = _view(rng, kind, (B, H, Lq, E))
    k = _view(rng, kind, (B, H, Lk, E))
    v = _view(rng, kind, (B, H, Lk, Ev))
    if kind == "unaligned_bytes":
        assert not q.flags.aligned
    elif kind not in ("big_endian", "fortran", "broadcast_batch", "offset_4_bytes"):
        assert not q.flags.c_contiguous
    mask = random_bool_mask(rng, (Lk, Lq)).T            # a transposed mask view
    fmask = random_float_mask(rng, (B, 1, Lq, 2 * Lk))[..., ::-2]   # negative stride
    for m in (mask, fmask):
        out, w = check_against_reference(q, k, v, attn_mask=m, need_weights=True)
        contiguous = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v)]
        o_n, w_n = (naive(*contiguous, allowed=m.copy()) if m.dtype == bool
                    else naive(*contiguous, add=m.copy()))
        assert_close(out, o_n)
        assert_close(w, w_n)
        # strides change nothing in the arithmetic: bit-identical to contiguous copies
        out_c, w_c = sdpa(*contiguous, attn_mask=np.ascontiguousarray(m), need_weights=True)
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(w, w_c)


def test_query_rows_too_far_apart_for_int32_gathers(isa, rng):
    """Query rows 600 MB apart: the SIMD packer gathers a column of 16 rows
    with int32 element offsets, which cannot reach row 15; the core must fall
    back to the scalar packer, not wrap around (that read out of bounds and
    crashed). The rows live in a lazily mapped 9 GB region: only the touched
    pages take memory."""
    Lq, E, row = 16, 24, 150_000_000                      # 15 * row > 2**31
    region = mmap.mmap(-1, 4 * (row * (Lq - 1) + E))
    base = np.frombuffer(region, dtype=np.float32)
    q = np.lib.stride_tricks.as_strided(base, (1, 1, Lq, E), (0, 0, row * 4, 4))
    q[...] = randn(rng, (1, 1, Lq, E))                    # writes the rows, not the gaps
    k, v = randn(rng, (1, 1, 33, E)), randn(rng, (1, 1, 33, 7))
    out = sdpa(q, k, v)
    np.testing.assert_array_equal(out, sdpa(np.ascontiguousarray(q), k, v))
    check_against_reference(q, k, v)
    del q, base


def test_read_only_inputs(isa, rng):
    q, k, v = make_qkv(rng)
    mask = random_bool_mask(rng, (5, 7))
    kl = np.array([7, 3])
    for a in (q, k, v, mask, kl):
        a.flags.writeable = False
    check_against_reference(q, k, v, attn_mask=mask, key_lengths=kl, need_weights=True)


def test_nested_lists(isa, rng):
    q, k, v = make_qkv(rng, B=(), Hq=4, Lq=3, Lk=5, E=4)
    out = sdpa(q.tolist(), k.tolist(), v.tolist(), attn_mask=np.ones((3, 5), bool).tolist())
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, sdpa(q, k, v))


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


# --------------------------------------------------------- dtypes & purity

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


def test_inputs_not_modified(isa, rng):
    q = _view(rng, "negative_strides", (2, 3, 6, 16))
    k, v = randn(rng, (2, 3, 9, 16)), randn(rng, (2, 3, 9, 7)).astype(np.float64)
    q[0, 0, 0, 0] = np.nan
    mask = random_float_mask(rng, (3, 6, 9))
    kl, ql = np.array([9, 2]), np.array([6, 3], dtype=np.int32)
    args = [q, k, v, mask, kl, ql]
    copies = [a.copy() for a in args]
    for _ in range(2):
        for nw in (False, True):
            sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", key_lengths=kl,
                 query_lengths=ql, need_weights=nw)
    qb = np.ascontiguousarray(np.swapaxes(q, 1, 2))
    qb_copy = qb.copy()
    sdpa(qb, np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2), layout="blhd")
    for a, c in zip(args + [qb], copies + [qb_copy]):
        assert a.dtype == c.dtype
        assert np.array_equal(a, c, equal_nan=a.dtype.kind == "f"), "an input was modified"


def test_output_is_fresh(isa, rng):
    q, k, v = make_qkv(rng)
    out, w = sdpa(q, k, v, need_weights=True)
    for a in (q, k, v):
        assert not np.shares_memory(out, a) and not np.shares_memory(w, a)
    assert out.flags.writeable and w.flags.writeable
    out2 = sdpa(q, k, v)
    assert not np.shares_memory(out, out2)


def test_repeated_calls_bit_identical(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=67, Lk=131, E=33, Ev=17)
    mask = random_float_mask(rng, (67, 131), p_inf=0.1)
    first = sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", need_weights=True)
    for _ in range(3):
        again = sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", need_weights=True)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


def test_thread_count_does_not_change_results(isa, rng):
    q, k, v = make_qkv(rng, B=(3,), Hq=3, Lq=70, Lk=90, E=32)
    before = _attnx.get_num_threads()
    assert before >= 1
    try:
        results = []
        for n in (1, 2, 3):
            _attnx.set_num_threads(n)
            assert _attnx.get_num_threads() == n
            results.append(sdpa(q, k, v, is_causal=True, need_weights=True))
    finally:
        _attnx.set_num_threads(before)
    assert _attnx.get_num_threads() == before
    for out, w in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(w, results[0][1])


def test_python_threads_agree(rng):
    problems = [make_qkv(rng, B=(2,), Hq=2, Lq=33 + i, Lk=40 + 3 * i, E=16 + i) for i in range(6)]
    serial = [sdpa(q, k, v, is_causal=True) for q, k, v in problems]
    barrier = threading.Barrier(6)

    def run(i):
        barrier.wait()
        q, k, v = problems[i]
        return [sdpa(q, k, v, is_causal=True) for _ in range(5)]

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(run, range(6)))
    for i, outs in enumerate(results):
        for out in outs:
            np.testing.assert_array_equal(out, serial[i])


def test_no_reference_leaks(rng):
    q, k, v = make_qkv(rng, Lq=4, Lk=6, E=8)
    q = q[:, :, ::-1]                          # a view: the glue handles its base
    mask = random_bool_mask(rng, (4, 6))
    kl, ql = np.array([6, 2]), np.array([4, 1])
    objs = [q, q.base, k, v, mask, kl, ql]
    sdpa(q, k, v, attn_mask=mask, key_lengths=kl, query_lengths=ql, need_weights=True)
    before = [sys.getrefcount(o) for o in objs]
    for _ in range(50):
        out, w = sdpa(q, k, v, attn_mask=mask, key_lengths=kl, query_lengths=ql, need_weights=True)
    del out, w
    assert [sys.getrefcount(o) for o in objs] == before
    out = sdpa(q, k, v)
    rc = sys.getrefcount(out)
    assert rc == 2, f"the result holds {rc - 2} extra reference(s)"


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


# ------------------------------------------------------------------ ISAs

def test_isa_api():
    avail = _attnx.available_isas()
    assert isinstance(avail, list) and "scalar" in avail
    assert set(avail) <= {"scalar", "avx2", "avx512"}
    assert _attnx.isa() in avail
    assert attnx.isa() == _attnx.isa()
    current = _attnx.isa()
    with pytest.raises(ValueError):
        _attnx.set_isa("no-such-isa")
    assert _attnx.isa() == current


def test_isas_agree(rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=19, Lk=37, E=33, Ev=17)
    mask = random_float_mask(rng, (19, 37))
    expected = ref(q, k, v, attn_mask=mask, is_causal="lower_right")
    previous = _attnx.isa()
    try:
        for name in _attnx.available_isas():
            _attnx.set_isa(name)
            assert_close(sdpa(q, k, v, attn_mask=mask, is_causal="lower_right"), expected,
                         err_msg=name)
    finally:
        _attnx.set_isa(previous)
