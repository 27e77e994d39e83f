"""Tests of attnx.MultiHeadAttention and of the mask helpers causal_mask / padding_mask.

The oracle is a float64 composition: the projections in float64 NumPy and the
attention by ``attnx.reference`` (float64). The layer computes its projections
in float32 (NumPy/BLAS) before and after the C attention, so it carries
float32 rounding of dot products over d_model (up to 300) and H*d_head
features on top of the attention's own 1e-5 bar: relative error ~ 6e-8 *
sqrt(n) per dot product, amplified by the softmax's sensitivity to the
scores. Hence the layer's tolerance is atol 1e-4, rtol 1e-5 on outputs of
order 1 (observed maximum errors: 0.6e-6 to 2.5e-6 for d_model 50 to 300).
"""

import doctest

import numpy as np
import pytest

import attnx
import attnx._masks
import attnx._mha
from attnx import MultiHeadAttention, causal_mask, padding_mask
from conftest import LOW_FLOATS

ATOL, RTOL = 1e-4, 1e-5          # layer vs float64 composition (see the module docstring)
W_ATOL = 1e-5                    # attention weights are in [0, 1] and need no projection out


def rng_of(seed):
    return np.random.default_rng(seed)


def make_layer(d_model, num_heads, d_head=None, *, bias=True, kdim=None, vdim=None, seed=0):
    """A layer with random (nonzero) biases, so that a missing bias shows up."""
    mha = MultiHeadAttention(d_model, num_heads, d_head, bias=bias, kdim=kdim, vdim=vdim, seed=seed)
    if bias:
        r = rng_of(seed + 1000)
        for name in ("b_q", "b_k", "b_v", "b_o"):
            b = getattr(mha, name)
            b[...] = r.uniform(-0.5, 0.5, b.shape)
    return mha


def randn(r, *shape):
    return r.standard_normal(shape, dtype=np.float32)


def composed(mha, query, key=None, value=None, **kw):
    """The layer computed in float64: projections in NumPy, attention by attnx.reference."""
    key = query if key is None else key
    value = key if value is None else value
    f = lambda a: None if a is None else np.asarray(a, dtype=np.float64)
    x_q, x_k, x_v = f(query), f(key), f(value)
    H, D = mha.num_heads, mha.d_head
    q = x_q @ f(mha.W_q) + (0 if mha.b_q is None else f(mha.b_q))
    k = x_k @ f(mha.W_k) + (0 if mha.b_k is None else f(mha.b_k))
    v = x_v @ f(mha.W_v) + (0 if mha.b_v is None else f(mha.b_v))
    B, Lq, Lk = x_q.shape[0], x_q.shape[1], x_k.shape[1]
    out, w = attnx.reference(q.reshape(B, Lq, H, D), k.reshape(B, Lk, H, D),
                             v.reshape(B, Lk, H, D), layout="blhd", need_weights=True, **kw)
    out = out.reshape(B, Lq, H * D) @ f(mha.W_o) + (0 if mha.b_o is None else f(mha.b_o))
    return out, w


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- masks


class TestCausalMask:
    @pytest.mark.parametrize("L", [0, 1, 2, 5, 17])
    def test_square_is_lower_triangle(self, L):
        m = causal_mask(L)
        assert m.dtype == np.bool_ and m.shape == (L, L)
        np.testing.assert_array_equal(m, np.tril(np.ones((L, L), bool)))
        np.testing.assert_array_equal(causal_mask(L, lower_right=True), m)

    @pytest.mark.parametrize("Lq,Lk", [(2, 5), (5, 2), (3, 3), (0, 4), (4, 0), (1, 7)])
    def test_rectangular_alignments(self, Lq, Lk):
        ul = causal_mask(Lq, Lk)
        lr = causal_mask(Lq, Lk, lower_right=True)
        assert ul.shape == lr.shape == (Lq, Lk)
        for i in range(Lq):
            for j in range(Lk):
                assert ul[i, j] == (j <= i)
                assert lr[i, j] == (j <= i + Lk - Lq)

    def test_examples(self):
        np.testing.assert_array_equal(causal_mask(2, 4).astype(int), [[1, 0, 0, 0], [1, 1, 0, 0]])
        np.testing.assert_array_equal(causal_mask(2, 4, lower_right=True).astype(int),
                                      [[1, 1, 1, 0], [1, 1, 1, 1]])
        np.testing.assert_array_equal(causal_mask(3, 2).astype(int), [[1, 0], [1, 1], [1, 1]])

    def test_numpy_integers_accepted(self):
        np.testing.assert_array_equal(causal_mask(np.int64(3), np.int32(4)), causal_mask(3, 4))

    @pytest.mark.parametrize("lower_right", [False, True])
    def test_same_as_is_causal(self, lower_right):
        r = rng_of(1)
        q, k, v = randn(r, 2, 3, 4, 8), randn(r, 2, 3, 6, 8), randn(r, 2, 3, 6, 5)
        flag = "lower_right" if lower_right else True
        want = attnx.reference(q, k, v, is_causal=flag)
        got = attnx.reference(q, k, v, attn_mask=causal_mask(4, 6, lower_right=lower_right))
        np.testing.assert_array_equal(got, want)

    @pytest.mark.parametrize("args,kw,exc,word", [
        ((-1,), {}, ValueError, "Lq"),
        ((3, -2), {}, ValueError, "Lk"),
        ((2.0,), {}, TypeError, "Lq"),
        ((3, "4"), {}, TypeError, "Lk"),
        ((True,), {}, TypeError, "Lq"),
        ((None,), {}, TypeError, "Lq"),
        ((3,), {"lower_right": "yes"}, TypeError, "lower_right"),
    ])
    def test_bad_arguments(self, args, kw, exc, word):
        with pytest.raises(exc, match=word):
            causal_mask(*args, **kw)


class TestPaddingMask:
    def test_values(self):
        pm = padding_mask([3, 0, 5, 1], 5)
        assert pm.dtype == np.bool_ and pm.shape == (4, 5)
        np.testing.assert_array_equal(pm.astype(int), [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0],
                                                       [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])

    def test_array_and_zero_sizes(self):
        np.testing.assert_array_equal(padding_mask(np.array([2], np.int32), 3), [[True, True, False]])
        assert padding_mask(np.zeros(0, int), 4).shape == (0, 4)
        assert padding_mask([0, 0], 0).shape == (2, 0)

    def test_seed002_masks(self):
        """The docstring's recipes give seed 002's (B, 1, Lq, Lk) masks and match the lengths."""
        lengths = np.array([4, 2, 6])
        pm = padding_mask(lengths, 6)
        key_only = pm[:, None, None, :]
        both = pm[:, None, :, None] & pm[:, None, None, :]
        causal = both & causal_mask(6)
        assert key_only.shape == (3, 1, 1, 6) and both.shape == causal.shape == (3, 1, 6, 6)
        for b in range(3):
            for i in range(6):
                for j in range(6):
                    real = i < lengths[b] and j < lengths[b]
                    assert both[b, 0, i, j] == real
                    assert causal[b, 0, i, j] == (real and j <= i)
                    assert key_only[b, 0, 0, j] == (j < lengths[b])
        # the same attention as with key_lengths/query_lengths, without building the mask
        r = rng_of(2)
        q, k, v = (randn(r, 3, 2, 6, 4) for _ in range(3))
        np.testing.assert_array_equal(
            attnx.reference(q, k, v, attn_mask=causal),
            attnx.reference(q, k, v, is_causal=True, key_lengths=lengths, query_lengths=lengths))

    @pytest.mark.parametrize("lengths,L,exc,word", [
        ([1, 5], 4, ValueError, "lengths"),
        ([-1, 2], 4, ValueError, "lengths"),
        ([1.0, 2.0], 4, TypeError, "lengths"),
        ([True, False], 4, TypeError, "lengths"),
        ([1, 2], -1, ValueError, "L"),
        ([1, 2], 4.0, TypeError, "L"),
    ])
    def test_bad_arguments(self, lengths, L, exc, word):
        with pytest.raises(exc, match=word):
            padding_mask(lengths, L)


def test_docstring_examples():
    for mod in (attnx._masks, attnx._mha):
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert res.attempted > 0 and res.failed == 0, mod.__name__


# ------------------------------------------------------------------ construction


class TestConstruction:
    @pytest.mark.parametrize("d_model,H,d_head", [(50, 8, 6), (100, 6, 16), (200, 8, 25),
                                                  (300, 8, 37), (300, 6, 50), (4, 8, 1)])
    def test_shapes_and_default_d_head(self, d_model, H, d_head):
        mha = MultiHeadAttention(d_model, H, seed=0)
        assert mha.d_head == d_head
        HD = H * d_head
        shapes = {"W_q": (d_model, HD), "W_k": (d_model, HD), "W_v": (d_model, HD),
                  "W_o": (HD, d_model), "b_q": (HD,), "b_k": (HD,), "b_v": (HD,), "b_o": (d_model,)}
        for name, shape in shapes.items():
            a = getattr(mha, name)
            assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape, name
        for name in ("b_q", "b_k", "b_v", "b_o"):
            assert not getattr(mha, name).any()

    def test_kdim_vdim_d_head_and_no_bias(self):
        mha = MultiHeadAttention(50, 4, 20, kdim=30, vdim=70, bias=False, seed=0)
        assert mha.W_q.shape == (50, 80) and mha.W_k.shape == (30, 80)
        assert mha.W_v.shape == (70, 80) and mha.W_o.shape == (80, 50)
        assert mha.b_q is None and mha.b_k is None and mha.b_v is None and mha.b_o is None

    def test_xavier_init_and_seed(self):
        a, b, c = (MultiHeadAttention(100, 6, seed=s) for s in (7, 7, 8))
        for name in ("W_q", "W_k", "W_v", "W_o"):
            wa = getattr(a, name)
            np.testing.assert_array_equal(wa, getattr(b, name))
            assert not np.array_equal(wa, getattr(c, name))
            bound = np.sqrt(6.0 / sum(wa.shape))
            assert np.abs(wa).max() <= bound
            assert np.abs(wa).max() > 0.9 * bound          # uniform over the whole range
            assert abs(wa.std() - bound / np.sqrt(3)) < 0.1 * bound
        assert not np.array_equal(a.W_q, a.W_k)             # each matrix drawn separately

    def test_repr(self):
        assert repr(MultiHeadAttention(50, 8)) == \
            "MultiHeadAttention(d_model=50, num_heads=8, d_head=6, bias=True)"
        assert repr(MultiHeadAttention(64, 4, 8, kdim=32, vdim=16, bias=False)) == \
            "MultiHeadAttention(d_model=64, num_heads=4, d_head=8, bias=False, kdim=32, vdim=16)"

    @pytest.mark.parametrize("args,kw,exc,word", [
        ((0, 4), {}, ValueError, "d_model"),
        ((50, 0), {}, ValueError, "num_heads"),
        ((50, -2), {}, ValueError, "num_heads"),
        ((50.0, 4), {}, TypeError, "d_model"),
        ((50, True), {}, TypeError, "num_heads"),
        ((50, 4, 0), {}, ValueError, "d_head"),
        ((50, 4), {"kdim": 0}, ValueError, "kdim"),
        ((50, 4), {"vdim": "8"}, TypeError, "vdim"),
        ((50, 4), {"bias": 1}, TypeError, "bias"),
    ])
    def test_bad_arguments(self, args, kw, exc, word):
        with pytest.raises(exc, match=word):
            MultiHeadAttention(*args, **kw)


# ------------------------------------------------------- against the float64 oracle


class TestAgainstReference:
    @pytest.mark.parametrize("d_model,H", [(50, 8), (100, 6), (300, 8), (64, 8), (100, 8)])
    def test_self_attention(self, d_model, H):
        mha = make_layer(d_model, H, seed=d_model + H)
        x = randn(rng_of(d_model), 3, 11, d_model)
        out = mha(x)
        assert out.dtype == np.float32 and out.shape == (3, 11, d_model)
        assert_close(out, composed(mha, x)[0])

    @pytest.mark.parametrize("d_model,H,d_head", [(50, 4, 20), (300, 6, 7), (100, 1, 100)])
    def test_explicit_d_head(self, d_model, H, d_head):
        mha = make_layer(d_model, H, d_head, seed=3)
        x = randn(rng_of(4), 2, 9, d_model)
        assert_close(mha(x, is_causal=True), composed(mha, x, is_causal=True)[0])

    @pytest.mark.parametrize("d_model,H,kdim,vdim,Lq,Lk", [
        (50, 8, 50, 50, 5, 13), (100, 6, 30, 70, 12, 4), (300, 8, 128, 300, 1, 9),
        (64, 8, 64, 40, 7, 7)])
    def test_cross_attention(self, d_model, H, kdim, vdim, Lq, Lk):
        mha = make_layer(d_model, H, kdim=kdim, vdim=vdim, seed=5)
        r = rng_of(6)
        q, k, v = randn(r, 2, Lq, d_model), randn(r, 2, Lk, kdim), randn(r, 2, Lk, vdim)
        lengths = np.array([Lk, max(1, Lk // 2)])
        out, w = mha(q, k, v, key_lengths=lengths, need_weights=True)
        want_out, want_w = composed(mha, q, k, v, key_lengths=lengths)
        assert w.shape == (2, H, Lq, Lk) and w.dtype == np.float32
        assert_close(out, want_out)
        assert_close(w, want_w, atol=W_ATOL)
        assert not w[1, :, :, lengths[1]:].any()   # padded keys get no weight

    def test_value_defaults_to_key(self):
        mha = make_layer(50, 8, kdim=20, vdim=20, seed=7)
        r = rng_of(8)
        q, mem = randn(r, 2, 5, 50), randn(r, 2, 9, 20)
        np.testing.assert_array_equal(mha(q, mem), mha(q, mem, mem))
        assert_close(mha(q, mem), composed(mha, q, mem, mem)[0])

    @pytest.mark.parametrize("d_model,H", [(50, 8), (300, 6)])
    def test_causal_and_key_padding(self, d_model, H):
        """Seed 002's decoder self-attention: causal AND key padding."""
        mha = make_layer(d_model, H, seed=9)
        B, L = 4, 10
        x = randn(rng_of(10), B, L, d_model)
        lengths = np.array([10, 7, 1, 4])
        out, w = mha(x, is_causal=True, key_lengths=lengths, need_weights=True)
        want_out, want_w = composed(mha, x, is_causal=True, key_lengths=lengths)
        assert_close(out, want_out)
        assert_close(w, want_w, atol=W_ATOL)
        allowed = causal_mask(L) & padding_mask(lengths, L)[:, None, None, :]
        assert not w[~np.broadcast_to(allowed, w.shape)].any()
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)   # row 0 always sees key 0
        # the same through an explicit seed-002 mask (B, 1, L, L)
        out_m = mha(x, attn_mask=allowed)
        assert_close(out_m, want_out)
        np.testing.assert_allclose(out_m, out, atol=1e-5, rtol=1e-6)

    def test_encoder_query_and_key_padding(self):
        """Seed 002's encoder mask: (i, j) allowed when both tokens are real."""
        mha = make_layer(100, 6, seed=11)
        B, L = 3, 8
        x = randn(rng_of(12), B, L, 100)
        lengths = np.array([8, 5, 2])
        out, w = mha(x, key_lengths=lengths, query_lengths=lengths, need_weights=True)
        want_out, want_w = composed(mha, x, key_lengths=lengths, query_lengths=lengths)
        assert_close(out, want_out)
        assert_close(w, want_w, atol=W_ATOL)
        pm = padding_mask(lengths, L)
        assert_close(mha(x, attn_mask=pm[:, None, :, None] & pm[:, None, None, :]), want_out)
        # padded query rows attend to nothing: zero attention output, so out = b_o
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(out[b, n:], np.broadcast_to(mha.b_o, (L - n, 100)), atol=1e-6)
            assert not w[b, :, n:].any()
        assert np.isfinite(out).all()

    @pytest.mark.parametrize("Lq,Lk", [(3, 8), (8, 3)])
    def test_lower_right_causal(self, Lq, Lk):
        mha = make_layer(50, 8, seed=13)
        r = rng_of(14)
        q, kv = randn(r, 2, Lq, 50), randn(r, 2, Lk, 50)
        for flag in ("lower_right", True):
            out, w = mha(q, kv, is_causal=flag, need_weights=True)
            want_out, want_w = composed(mha, q, kv, is_causal=flag)
            assert_close(out, want_out)
            assert_close(w, want_w, atol=W_ATOL)

    @pytest.mark.parametrize("mask_shape", [(7, 9), (2, 1, 7, 9), (2, 8, 7, 9), (1, 8, 1, 9),
                                            (1, 7, 9)])
    @pytest.mark.parametrize("kind", ["bool", "float"])
    def test_attn_mask_broadcasts(self, mask_shape, kind):
        mha = make_layer(50, 8, seed=15)
        r = rng_of(16)
        q, kv = randn(r, 2, 7, 50), randn(r, 2, 9, 50)
        if kind == "bool":
            mask = r.random(mask_shape) < 0.7
            mask[..., 0] = True
        else:
            mask = r.standard_normal(mask_shape).astype(np.float32)
        out, w = mha(q, kv, attn_mask=mask, need_weights=True)
        want_out, want_w = composed(mha, q, kv, attn_mask=mask)
        assert_close(out, want_out)
        assert_close(w, want_w, atol=W_ATOL)

    def test_average_weights(self):
        mha = make_layer(100, 6, seed=17)
        x = randn(rng_of(18), 2, 6, 100)
        out, w = mha(x, is_causal=True, need_weights=True)
        out_a, w_a = mha(x, is_causal=True, need_weights=True, average_weights=True)
        assert w.shape == (2, 6, 6, 6) and w_a.shape == (2, 6, 6) and w_a.dtype == np.float32
        np.testing.assert_array_equal(out_a, out)
        assert_close(w_a, composed(mha, x, is_causal=True)[1].mean(axis=1), atol=W_ATOL)
        np.testing.assert_allclose(w_a.sum(-1), 1.0, atol=1e-5)

    def test_unbatched(self):
        mha = make_layer(50, 8, kdim=24, seed=19)
        r = rng_of(20)
        q, k, v = randn(r, 5, 50), randn(r, 7, 24), randn(r, 7, 50)
        out, w = mha(q, k, v, is_causal="lower_right", need_weights=True)
        assert out.shape == (5, 50) and w.shape == (8, 5, 7)
        out_b, w_b = mha(q[None], k[None], v[None], is_causal="lower_right", need_weights=True)
        np.testing.assert_array_equal(out, out_b[0])
        np.testing.assert_array_equal(w, w_b[0])
        assert_close(out, composed(mha, q[None], k[None], v[None], is_causal="lower_right")[0][0])
        _, w_a = mha(q, k, v, key_lengths=3, need_weights=True, average_weights=True)
        assert w_a.shape == (5, 7) and not w_a[:, 3:].any()
        # a per-head (H, Lq, Lk) mask is fine without a batch axis
        mask = r.random((8, 5, 7)) < 0.8
        assert_close(mha(q, k, v, attn_mask=mask),
                     composed(mha, q[None], k[None], v[None], attn_mask=mask)[0][0])

    def test_no_bias(self):
        mha = make_layer(50, 8, bias=False, seed=21)
        x = randn(rng_of(22), 2, 6, 50)
        assert_close(mha(x), composed(mha, x)[0])
        assert_close(mha(np.zeros((1, 3, 50), np.float32)), np.zeros((1, 3, 50)))

    def test_biases_are_used(self):
        """Each bias changes the result as the composition says (guards against a bias left out).

        b_k is the exception: it adds q_i . b_k to every score of row i, which
        the softmax cancels, so it must leave the output unchanged.
        """
        mha = make_layer(50, 8, seed=23)
        x = randn(rng_of(24), 2, 6, 50)
        base = mha(x)
        for name in ("b_q", "b_k", "b_v", "b_o"):
            b = getattr(mha, name)
            saved = b.copy()
            b += 0.25 * rng_of(25).standard_normal(b.shape).astype(np.float32)
            if name == "b_k":
                np.testing.assert_allclose(mha(x), base, atol=1e-5, rtol=1e-5)
            else:
                assert not np.allclose(mha(x), base, atol=1e-4), name
            assert_close(mha(x), composed(mha, x)[0])
            b[...] = saved

    @pytest.mark.parametrize("dtype", LOW_FLOATS + [np.float64])
    def test_other_float_dtypes(self, dtype):
        mha = make_layer(50, 8, seed=26)
        x = randn(rng_of(27), 2, 6, 50).astype(dtype)
        out = mha(x)
        assert out.dtype == np.float32
        assert_close(out, composed(mha, x.astype(np.float32))[0])
        assert_close(mha(x.tolist()), out)            # nested lists work too

    def test_non_contiguous_inputs(self):
        mha = make_layer(50, 8, seed=28)
        big = randn(rng_of(29), 12, 4, 100)
        x = big.transpose(1, 0, 2)[:, ::2, ::2]       # (4, 6, 50), strided
        assert not x.flags.c_contiguous
        assert_close(mha(x), composed(mha, np.ascontiguousarray(x))[0])

    def test_zero_size(self):
        mha = make_layer(50, 8, seed=30)
        assert mha(np.zeros((0, 4, 50), np.float32)).shape == (0, 4, 50)
        out = mha(np.zeros((2, 0, 50), np.float32), np.ones((2, 3, 50), np.float32))
        assert out.shape == (2, 0, 50)
        # no keys at all: every row is fully masked, so the result is b_o
        out, w = mha(np.ones((2, 4, 50), np.float32), np.zeros((2, 0, 50), np.float32),
                     need_weights=True)
        assert out.shape == (2, 4, 50) and w.shape == (2, 8, 4, 0)
        np.testing.assert_allclose(out, np.broadcast_to(mha.b_o, out.shape), atol=1e-6)

    def test_fully_masked_rows_give_b_o_not_nan(self):
        mha = make_layer(50, 8, seed=31)
        x = randn(rng_of(32), 2, 4, 50)
        out, w = mha(x, key_lengths=[0, 4], need_weights=True)
        np.testing.assert_allclose(out[0], np.broadcast_to(mha.b_o, (4, 50)), atol=1e-6)
        assert not w[0].any() and np.isfinite(out).all()

    def test_user_assigned_weights(self):
        """Plain attributes: a user may replace them (e.g. with weights from a file)."""
        mha = MultiHeadAttention(6, 2, 3, seed=0)
        mha.W_q = np.zeros((6, 6), np.float32)         # all scores 0: uniform weights
        mha.W_v = np.eye(6, dtype=np.float32)
        mha.W_o = np.eye(6, dtype=np.float32)
        x = randn(rng_of(33), 1, 4, 6)
        out, w = mha(x, need_weights=True)
        np.testing.assert_allclose(w, 0.25, atol=1e-7)
        np.testing.assert_allclose(out[0], np.broadcast_to(x[0].mean(0), (4, 6)), atol=1e-6)


# ------------------------------------------------------------------------ errors


class TestErrors:
    def setup_method(self):
        self.mha = make_layer(50, 8, kdim=20, vdim=30, seed=0)
        r = rng_of(1)
        self.q, self.k, self.v = randn(r, 2, 5, 50), randn(r, 2, 7, 20), randn(r, 2, 7, 30)

    @pytest.mark.parametrize("which,shape,pattern", [
        ("q", (2, 5, 48), r"query has 48 features but the layer's d_model is 50.*\(2, 5, 48\)"),
        ("k", (2, 7, 50), r"key has 50 features but the layer's kdim is 20.*\(2, 7, 50\)"),
        ("v", (2, 7, 20), r"value has 20 features but the layer's vdim is 30.*\(2, 7, 20\)"),
        ("v", (2, 6, 30), r"same length Lk.*\(2, 6, 30\)"),
        ("k", (3, 7, 20), r"same batch size.*\(3, 7, 20\)"),
        ("k", (7, 20), r"all unbatched.*\(7, 20\)"),
        ("q", (50,), r"query must be .*\(50,\)"),
        ("q", (1, 2, 5, 50), r"query must be .*\(1, 2, 5, 50\)"),
    ])
    def test_bad_shapes(self, which, shape, pattern):
        args = {"q": self.q, "k": self.k, "v": self.v}
        args[which] = np.zeros(shape, np.float32)
        with pytest.raises(ValueError, match=pattern):
            self.mha(args["q"], args["k"], args["v"])

    def test_self_attention_needs_kdim_equal_d_model(self):
        with pytest.raises(ValueError, match=r"key \(defaulted to query\) has 50 features.*kdim is 20"):
            self.mha(self.q)
        with pytest.raises(ValueError, match=r"value \(defaulted to key\) has 20 features.*vdim is 30"):
            self.mha(self.q, self.k)

    @pytest.mark.parametrize("bad", [np.zeros((2, 5, 50), np.int32), np.zeros((2, 5, 50), bool),
                                     np.zeros((2, 5, 50), np.complex64), [[1, 2], [3]]])
    def test_bad_dtypes(self, bad):
        with pytest.raises(TypeError, match="query"):
            self.mha(bad, self.k, self.v)

    def test_ambiguous_3d_mask(self):
        with pytest.raises(ValueError, match=r"3-D attn_mask \(2, 5, 7\) is ambiguous"):
            self.mha(self.q, self.k, self.v, attn_mask=np.ones((2, 5, 7), bool))
        # a leading 1 is not ambiguous
        self.mha(self.q, self.k, self.v, attn_mask=np.ones((1, 5, 7), bool))

    def test_mask_that_does_not_broadcast(self):
        with pytest.raises(ValueError, match="attn_mask"):
            self.mha(self.q, self.k, self.v, attn_mask=np.ones((2, 8, 5, 6), bool))
        with pytest.raises(ValueError, match="attn_mask"):
            self.mha(self.q, self.k, self.v, attn_mask=np.ones((1, 2, 8, 5, 7), bool))
        with pytest.raises(TypeError, match="attn_mask"):
            self.mha(self.q, self.k, self.v, attn_mask=np.ones((5, 7), np.int64))

    @pytest.mark.parametrize("kw,exc", [
        ({"key_lengths": [8, 2]}, ValueError), ({"key_lengths": [-1, 2]}, ValueError),
        ({"key_lengths": [1, 2, 3]}, ValueError), ({"key_lengths": [1.5, 2.0]}, TypeError),
        ({"query_lengths": [6, 2]}, ValueError), ({"is_causal": "yes"}, ValueError)])
    def test_bad_lengths_and_flags(self, kw, exc):
        name = next(iter(kw))
        with pytest.raises(exc, match=name):
            self.mha(self.q, self.k, self.v, **kw)

    def test_wrong_parameter_shape(self):
        self.mha.W_o = np.zeros((50, 50), np.float32)
        with pytest.raises(ValueError, match=r"W_o must be an array of shape \(48, 50\)"):
            self.mha(self.q, self.k, self.v)


# ----------------------------------------------------------- inputs not modified


def test_inputs_and_parameters_not_modified():
    mha = make_layer(50, 8, kdim=24, seed=40)
    r = rng_of(41)
    q, k, v = randn(r, 2, 5, 50), randn(r, 2, 7, 24), randn(r, 2, 7, 50)
    mask = r.standard_normal((2, 1, 5, 7)).astype(np.float32)
    kl, ql = np.array([7, 3]), np.array([5, 2])
    args = [q, k, v, mask, kl, ql]
    params = {n: getattr(mha, n) for n in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")}
    saved = [a.copy() for a in args]
    saved_params = {n: a.copy() for n, a in params.items()}
    for a in args:
        a.flags.writeable = False                      # an in-place write would raise
    out, w = mha(q, k, v, attn_mask=mask, key_lengths=kl, query_lengths=ql, is_causal=True,
                 need_weights=True)
    for a in args:
        a.flags.writeable = True
    for a, s in zip(args, saved):
        np.testing.assert_array_equal(a, s)
    for n, a in params.items():
        assert getattr(mha, n) is a                    # the same arrays, unchanged
        np.testing.assert_array_equal(a, saved_params[n])
    # and the results do not alias the inputs or the parameters
    for a in args + list(params.values()):
        assert not np.shares_memory(out, a) and not np.shares_memory(w, a)


def test_self_attention_does_not_modify_input_float64():
    mha = make_layer(50, 8, seed=42)
    x = rng_of(43).standard_normal((2, 5, 50))
    saved = x.copy()
    mha(x, is_causal=True)
    np.testing.assert_array_equal(x, saved)


# ---------------------------------------------------------------- against torch


class TestTorch:
    @pytest.fixture(autouse=True)
    def _torch(self):
        self.torch = pytest.importorskip("torch")

    def module(self, E, H, *, kdim=None, vdim=None, bias=True, seed=0):
        torch = self.torch
        torch.manual_seed(seed)
        m = torch.nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=vdim, bias=bias)
        if bias:   # torch initialises the biases to zero: make them random to test them
            with torch.no_grad():
                m.in_proj_bias.uniform_(-0.5, 0.5)
                m.out_proj.bias.uniform_(-0.5, 0.5)
        return m.eval()

    def run_torch(self, m, q, k, v, **kw):
        torch = self.torch
        with torch.no_grad():
            out, w = m(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), **kw)
        return out.numpy(), (None if w is None else w.numpy())

    @staticmethod
    def torch_masks(torch, lengths, Lq, Lk, causal):
        kpm = torch.from_numpy(np.arange(Lk)[None, :] >= np.asarray(lengths)[:, None])  # True = pad
        am = torch.from_numpy(~causal_mask(Lq, Lk)) if causal else None                # True = blocked
        return kpm, am

    @pytest.mark.parametrize("E,H", [(64, 8), (48, 6), (300, 6), (100, 4)])
    def test_self_attention_causal_and_padding(self, E, H):
        torch = self.torch
        m = self.module(E, H, seed=E)
        mha = MultiHeadAttention.from_torch(m)
        assert (mha.d_model, mha.num_heads, mha.d_head, mha.bias) == (E, H, E // H, True)
        B, L = 3, 9
        x = randn(rng_of(E), B, L, E)
        lengths = np.array([9, 5, 1])
        kpm, am = self.torch_masks(torch, lengths, L, L, causal=True)
        want, want_w = self.run_torch(m, x, x, x, key_padding_mask=kpm, attn_mask=am)
        out, w = mha(x, is_causal=True, key_lengths=lengths, need_weights=True, average_weights=True)
        assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert_close(w, want_w, atol=1e-6)
        # per-head weights (average_attn_weights=False)
        _, want_wh = self.run_torch(m, x, x, x, key_padding_mask=kpm, attn_mask=am,
                                    average_attn_weights=False)
        _, wh = mha(x, is_causal=True, key_lengths=lengths, need_weights=True)
        assert_close(wh, want_wh, atol=1e-6)
        # without weights torch may take its fast path: same result
        want_nw, _ = self.run_torch(m, x, x, x, key_padding_mask=kpm, need_weights=False)
        assert_close(mha(x, key_lengths=lengths), want_nw, atol=1e-5, rtol=1e-5)

    def test_torch_bool_mask_is_inverted(self):
        """torch's bool attn_mask (True = blocked) is ~ of attnx's (True = attend)."""
        torch = self.torch
        m = self.module(32, 4, seed=1)
        mha = MultiHeadAttention.from_torch(m)
        r = rng_of(2)
        q, kv = randn(r, 2, 6, 32), randn(r, 2, 8, 32)
        allow = r.random((6, 8)) < 0.6
        allow[:, 0] = True
        want, want_w = self.run_torch(m, q, kv, kv, attn_mask=torch.from_numpy(~allow))
        out, w = mha(q, kv, attn_mask=allow, need_weights=True, average_weights=True)
        assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert_close(w, want_w, atol=1e-6)
        fmask = r.standard_normal((6, 8)).astype(np.float32)   # float masks: same convention
        want, _ = self.run_torch(m, q, kv, kv, attn_mask=torch.from_numpy(fmask))
        assert_close(mha(q, kv, attn_mask=fmask), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("E,H,kdim,vdim", [(64, 8, 32, 48), (60, 6, 60, 20), (32, 2, 100, 100)])
    def test_cross_attention_separate_projections(self, E, H, kdim, vdim):
        torch = self.torch
        m = self.module(E, H, kdim=kdim, vdim=vdim, seed=3)
        assert m.in_proj_weight is None                 # torch keeps q/k/v_proj_weight apart
        mha = MultiHeadAttention.from_torch(m)
        assert (mha.kdim, mha.vdim) == (kdim, vdim)
        r = rng_of(4)
        B, Lq, Lk = 2, 5, 11
        q, k, v = randn(r, B, Lq, E), randn(r, B, Lk, kdim), randn(r, B, Lk, vdim)
        lengths = np.array([11, 6])
        kpm, _ = self.torch_masks(torch, lengths, Lq, Lk, causal=False)
        want, want_w = self.run_torch(m, q, k, v, key_padding_mask=kpm)
        out, w = mha(q, k, v, key_lengths=lengths, need_weights=True, average_weights=True)
        assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert_close(w, want_w, atol=1e-6)

    def test_no_bias(self):
        m = self.module(40, 5, bias=False, seed=5)
        mha = MultiHeadAttention.from_torch(m)
        assert not mha.bias and mha.b_q is None and mha.b_o is None
        x = randn(rng_of(6), 2, 7, 40)
        want, _ = self.run_torch(m, x, x, x)
        assert_close(mha(x), want, atol=1e-5, rtol=1e-5)

    def test_unbatched_and_batch_first_false(self):
        torch = self.torch
        torch.manual_seed(7)
        m = torch.nn.MultiheadAttention(32, 4).eval()   # batch_first=False: (L, B, E)
        mha = MultiHeadAttention.from_torch(m)
        x = randn(rng_of(8), 2, 6, 32)
        xt = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))
        with torch.no_grad():
            want = m(xt, xt, xt, need_weights=False)[0].numpy().transpose(1, 0, 2)
            want_u = m(xt[:, 0], xt[:, 0], xt[:, 0], need_weights=False)[0].numpy()
        assert_close(mha(x), want, atol=1e-5, rtol=1e-5)
        assert_close(mha(x[0]), want_u, atol=1e-5, rtol=1e-5)

    def test_load_torch_in_place_and_copies(self):
        torch = self.torch
        m = self.module(64, 8, seed=9)
        mha = MultiHeadAttention(64, 8, seed=123)
        assert mha.load_torch(m) is mha
        E = 64
        np.testing.assert_array_equal(mha.W_q, m.in_proj_weight[:E].detach().numpy().T)
        np.testing.assert_array_equal(mha.W_k, m.in_proj_weight[E:2 * E].detach().numpy().T)
        np.testing.assert_array_equal(mha.W_v, m.in_proj_weight[2 * E:].detach().numpy().T)
        np.testing.assert_array_equal(mha.W_o, m.out_proj.weight.detach().numpy().T)
        np.testing.assert_array_equal(mha.b_k, m.in_proj_bias[E:2 * E].detach().numpy())
        np.testing.assert_array_equal(mha.b_o, m.out_proj.bias.detach().numpy())
        for name in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"):
            a = getattr(mha, name)
            assert a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable, name
        x = randn(rng_of(10), 1, 4, 64)
        before = mha(x)
        with torch.no_grad():                           # changing torch's weights later...
            m.in_proj_weight.mul_(2.0)
            m.out_proj.bias.add_(1.0)
        np.testing.assert_array_equal(mha(x), before)   # ...does not touch the copies

    def test_float64_module(self):
        m = self.module(32, 4, seed=11).double()
        mha = MultiHeadAttention.from_torch(m)
        assert mha.W_q.dtype == np.float32
        x = randn(rng_of(12), 2, 5, 32)
        want, _ = self.run_torch(m, x.astype(np.float64), *(x.astype(np.float64),) * 2)
        assert_close(mha(x), want, atol=1e-5, rtol=1e-5)

    def test_load_torch_errors(self):
        torch = self.torch
        m = self.module(64, 8)
        with pytest.raises(ValueError, match=r"\(64, 8, 8, 64, 64\).*\(64, 4, 16, 64, 64\)"):
            MultiHeadAttention(64, 4).load_torch(m)
        with pytest.raises(ValueError, match="kdim"):
            MultiHeadAttention(64, 8, kdim=32).load_torch(m)
        with pytest.raises(ValueError, match="d_head"):
            MultiHeadAttention(64, 8, 16).load_torch(m)
        with pytest.raises(TypeError, match="MultiheadAttention"):
            MultiHeadAttention(64, 8).load_torch(torch.nn.Linear(64, 64))
        with pytest.raises(TypeError, match="MultiheadAttention"):
            MultiHeadAttention.from_torch(object())
        with pytest.raises(ValueError, match="add_bias_kv"):
            MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(64, 8, add_bias_kv=True))
        with pytest.raises(ValueError, match="add_zero_attn"):
            MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(64, 8, add_zero_attn=True))
        # a failed load leaves the layer as it was
        mha = MultiHeadAttention(64, 8, seed=1)
        W = mha.W_q.copy()
        with pytest.raises(ValueError):
            mha.load_torch(torch.nn.MultiheadAttention(64, 8, add_bias_kv=True))
        np.testing.assert_array_equal(mha.W_q, W)


def test_torch_not_imported_by_attnx():
    import subprocess
    import sys
    code = ("import sys, attnx; m = attnx.MultiHeadAttention(8, 2, seed=0); "
            "import numpy as np; m(np.ones((1, 3, 8), np.float32)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
