"""``attnx.KVCache``: ``append`` writes in place into the buffers allocated
once (same objects, same data pointers, the new tokens copied in, rounded to
float16 in a float16 cache); a prompt then single tokens and chunks,
``attend``-ed after each append, equal the float64 ``attnx.reference`` over
the test's own record of everything appended (lower-right causal), on every
ISA, float32 and float16, with grouped-query heads, value_dim != head_dim and
the options (window, sinks per head and per sequence, softcap, ALiBi, scale,
need_weights, return_lse); sequences whose ``lengths`` differ (set through the
public ``lengths`` attribute: prompts of different lengths); a full cache
refuses an append and writes nothing; wrong shapes, dtypes and options
refused naming the argument. (The float16 cache's no-copy check is in
test_variant_options.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import BF16, LOW_FLOATS, assert_close, randn

DTYPES = [np.float32] + LOW_FLOATS


def data_pointer(a):
    return a.__array_interface__["data"][0]


class Record:
    """The test's own copy of what a cache should hold: (B, H, L, E) arrays grown
    by concatenation, rounded to the cache's dtype."""

    def __init__(self, B, H, E, Ev, dtype):
        self.k = np.zeros((B, H, 0, E), dtype)
        self.v = np.zeros((B, H, 0, Ev), dtype)

    def append(self, k_new, v_new):
        self.k = np.concatenate([self.k, k_new.astype(self.k.dtype)], axis=2)
        self.v = np.concatenate([self.v, v_new.astype(self.v.dtype)], axis=2)


def tokens(rng, cache, n):
    return (randn(rng, (cache.batch, cache.heads, n, cache.head_dim)),
            randn(rng, (cache.batch, cache.heads, n, cache.value_dim)))


# ------------------------------------------------------------------ append

@pytest.mark.parametrize("dtype", DTYPES)
def test_append_writes_in_place(rng, dtype):
    """The buffers are the same objects at the same addresses after every append;
    the tokens land after the last ones, the rest stays zero; lengths count them."""
    cache = attnx.KVCache(2, 3, 10, 8, value_dim=5, dtype=dtype)
    k_buf, v_buf = cache.k, cache.v
    k_ptr, v_ptr = data_pointer(cache.k), data_pointer(cache.v)
    assert cache.k.shape == (2, 3, 10, 8) and cache.v.shape == (2, 3, 10, 5)
    assert cache.k.dtype == dtype and cache.v.dtype == dtype and cache.lengths.dtype == np.int64
    rec = Record(2, 3, 8, 5, dtype)
    for n in (4, 1, 0, 2, 3):
        k_new, v_new = tokens(rng, cache, n)
        assert cache.append(k_new, v_new) is None
        rec.append(k_new, v_new)
        assert cache.k is k_buf and cache.v is v_buf
        assert data_pointer(cache.k) == k_ptr and data_pointer(cache.v) == v_ptr
        L = rec.k.shape[2]
        assert cache.lengths.tolist() == [L, L]
        np.testing.assert_array_equal(cache.k[:, :, :L], rec.k)
        np.testing.assert_array_equal(cache.v[:, :, :L], rec.v)
        assert not cache.k[:, :, L:].any() and not cache.v[:, :, L:].any()
    assert L == cache.max_len


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_append_copies_the_new_tokens(rng, dtype):
    """Changing k_new/v_new after the append leaves the cache as it was; the
    caller's arrays are not modified by append or attend (an int8 cache's
    quantization included)."""
    cache = attnx.KVCache(1, 2, 6, 4, dtype=dtype)
    k_new, v_new = tokens(rng, cache, 3)
    k0, v0 = k_new.copy(), v_new.copy()
    cache.append(k_new, v_new)
    stored_k, stored_v = cache.k[:, :, :3].copy(), cache.v[:, :, :3].copy()
    if dtype == np.float32:
        np.testing.assert_array_equal(stored_k, k0)
        np.testing.assert_array_equal(stored_v, v0)
    q = randn(rng, (1, 4, 3, 4))                   # grouped-query heads too
    q0 = q.copy()
    cache.attend(q)
    np.testing.assert_array_equal(k_new, k0)
    np.testing.assert_array_equal(v_new, v0)
    np.testing.assert_array_equal(q, q0)
    k_new += 1.0
    v_new[:] = 0.0
    np.testing.assert_array_equal(cache.k[:, :, :3], stored_k)
    np.testing.assert_array_equal(cache.v[:, :, :3], stored_v)


def test_append_accepts_other_float_dtypes_and_array_likes(rng):
    cache = attnx.KVCache(1, 1, 4, 2)
    cache.append(np.ones((1, 1, 1, 2), np.float64), np.ones((1, 1, 1, 2), np.float16))
    cache.append([[[[2.0, 3.0]]]], [[[[4.0, 5.0]]]])
    np.testing.assert_array_equal(cache.k[0, 0, :2], [[1, 1], [2, 3]])
    np.testing.assert_array_equal(cache.v[0, 0, :2], [[1, 1], [4, 5]])


# ------------------------------------------------------------------ attend

SHAPES = {   # (Hq, heads, head_dim, value_dim)
    "mha": (3, 3, 16, None),
    "gqa_value_dim": (8, 2, 16, 24),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prompt_then_tokens_match_reference(isa, rng, dtype, shape):
    """A prompt, single tokens and a chunk: each attend equals the float64 reference
    over everything appended so far, causal from the bottom right."""
    Hq, H, E, Ev = SHAPES[shape]
    B = 2
    cache = attnx.KVCache(B, H, 40, E, value_dim=Ev, dtype=dtype)
    rec = Record(B, H, E, cache.value_dim, dtype)
    for n in (9, 1, 1, 3, 1, 17):
        k_new, v_new = tokens(rng, cache, n)
        cache.append(k_new, v_new)
        rec.append(k_new, v_new)
        q = randn(rng, (B, Hq, n, E))
        out = cache.attend(q)
        assert out.shape == (B, Hq, n, cache.value_dim) and out.dtype == np.float32
        assert_close(out, attnx.reference(q, rec.k, rec.v, is_causal="lower_right",
                                          enable_gqa=True), err_msg=f"after {n} token(s)")
        assert cache.lengths.tolist() == [rec.k.shape[2]] * B


def test_attend_before_any_append_gives_zeros(rng):
    cache = attnx.KVCache(2, 2, 8, 4)
    out, lse = cache.attend(randn(rng, (2, 4, 3, 4)), return_lse=True)
    assert out.shape == (2, 4, 3, 4) and not out.any() and np.isneginf(lse).all()


OPTIONS = {
    "window": dict(window=(4, 0)),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "sinks_per_sequence": dict(sinks=np.array([[0.5, -1.0, 2.0, 0.0], [3.0, 1.0, -2.0, 0.5]])),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "scale": dict(scale=0.7),
    "window_sinks_alibi": dict(window=(5, 0), sinks=[1.0, 0.0, -1.0, 2.0],
                               alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
def test_options_match_reference(isa, rng, dtype, name):
    """Every option reaches the computation: weights too, against the reference."""
    kw = OPTIONS[name]
    cache = attnx.KVCache(2, 2, 24, 8, value_dim=6, dtype=dtype)
    rec = Record(2, 2, 8, 6, dtype)
    for n in (7, 1, 1, 2):
        k_new, v_new = tokens(rng, cache, n)
        cache.append(k_new, v_new)
        rec.append(k_new, v_new)
        q = randn(rng, (2, 4, n, 8))
        ref = dict(is_causal="lower_right", enable_gqa=True, **kw)
        out = cache.attend(q, **kw)
        assert_close(out, attnx.reference(q, rec.k, rec.v, **ref), err_msg=f"{n} token(s)")
        out_w, w = cache.attend(q, need_weights=True, **kw)
        want, want_w = attnx.reference(q, rec.k, rec.v, need_weights=True, **ref)
        assert_close(out_w, want)
        assert_close(w, want_w)


def test_lse_over_the_cache(isa, rng):
    """return_lse: float64 log-sum-exp of each query's allowed (lower-right) keys."""
    cache = attnx.KVCache(2, 2, 16, 8)
    rec = Record(2, 2, 8, 8, np.float32)
    for n in (6, 1, 3):
        k_new, v_new = tokens(rng, cache, n)
        cache.append(k_new, v_new)
        rec.append(k_new, v_new)
        q = randn(rng, (2, 4, n, 8))
        out, lse = cache.attend(q, return_lse=True)
        L = rec.k.shape[2]
        kr = np.repeat(rec.k, 2, axis=1).astype(np.float64)
        s = q.astype(np.float64) @ np.swapaxes(kr, -1, -2) / np.sqrt(8)
        allowed = np.arange(L)[None, :] <= np.arange(n)[:, None] + L - n
        assert_close(lse, np.log(np.where(allowed, np.exp(s), 0.0).sum(-1)))
        np.testing.assert_array_equal(out, cache.attend(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attn_mask_combines_with_the_causal_mask(isa, rng, dtype):
    """A left-padded batch: the padding mask (bool, or additive with a bias) ANDed
    with lower-right causal, a prompt then tokens, against the reference with
    both masks; a fully masked query row (a pad position) gives zeros."""
    cache = attnx.KVCache(2, 2, 24, 8, value_dim=6, dtype=dtype)
    rec = Record(2, 2, 8, 6, dtype)
    pad = np.array([0, 3])                          # sequence 1 starts 3 positions later
    for n in (7, 1, 2):
        k_new, v_new = tokens(rng, cache, n)
        cache.append(k_new, v_new)
        rec.append(k_new, v_new)
        L = rec.k.shape[2]
        keep = np.arange(L)[None, :] >= pad[:, None]              # (B, L)
        bias = rng.standard_normal((1, 4, n, L)).astype(np.float32)
        for mask in (keep[:, None, None, :], np.where(keep[:, None, None, :], bias, -np.inf)):
            q = randn(rng, (2, 4, n, 8))
            out, w = cache.attend(q, attn_mask=mask, need_weights=True)
            want, want_w = attnx.reference(q, rec.k, rec.v, attn_mask=mask, need_weights=True,
                                           is_causal="lower_right", enable_gqa=True)
            assert_close(out, want, err_msg=f"{n} token(s), {mask.dtype} mask")
            assert_close(w, want_w)
            if n == 7:                                    # query 0 of sequence 1: a pad row
                assert not out[1, :, 0].any()


def test_attn_mask_needs_sequences_of_one_length(rng):
    cache = attnx.KVCache(2, 2, 8, 4)
    cache.append(*tokens(rng, cache, 3))
    cache.lengths = [3, 2]
    q = randn(rng, (2, 2, 1, 4))
    with pytest.raises(ValueError, match=r"attn_mask needs sequences of one length; "
                                         r"lengths are \[3, 2\]"):
        cache.attend(q, attn_mask=np.ones(2, bool))


# ------------------------------------------------------ different lengths

def test_sequences_of_different_lengths(isa, rng):
    """Prompts of different lengths: the padded prompts appended, then the public
    ``lengths`` set to the real ones. The next tokens go right after each
    sequence's last; attend sees each sequence's own keys, causal from its own
    bottom right, with its own row of per-sequence sinks and ALiBi slopes; the
    weights are padded with zeros to the longest sequence."""
    B, H, Hq, E, Ev = 3, 2, 4, 8, 6
    real = [5, 2, 7]
    cache = attnx.KVCache(B, H, 16, E, value_dim=Ev)
    kp, vp = tokens(rng, cache, 7)
    cache.append(kp, vp)
    cache.lengths[:] = real
    hist = [[kp[b, :, :real[b]], vp[b, :, :real[b]]] for b in range(B)]
    sinks, slopes = randn(rng, (B, Hq)), rng.random((B, Hq))
    for n in (1, 2, 1):
        k_new, v_new = tokens(rng, cache, n)
        cache.append(k_new, v_new)
        for b in range(B):
            hist[b] = [np.concatenate([hist[b][0], k_new[b]], 1),
                       np.concatenate([hist[b][1], v_new[b]], 1)]
            L = hist[b][0].shape[1]
            np.testing.assert_array_equal(cache.k[b, :, :L], hist[b][0])
            np.testing.assert_array_equal(cache.v[b, :, :L], hist[b][1])
        lengths = [h[0].shape[1] for h in hist]
        assert cache.lengths.tolist() == lengths
        q = randn(rng, (B, Hq, n, E))
        for kw in ({}, dict(sinks=sinks), dict(alibi_slopes=slopes, window=(3, 0)),
                   dict(sinks=sinks[0], softcap=2.0)):
            out, w, lse = cache.attend(q, need_weights=True, return_lse=True, **kw)
            assert out.shape == (B, Hq, n, Ev) and lse.shape == (B, Hq, n)
            assert w.shape == (B, Hq, n, max(lengths))
            np.testing.assert_allclose(cache.attend(q, **kw), out, atol=1e-6, rtol=1e-6)
            for b in range(B):
                kw_b = {name: (x[b] if np.ndim(x) == 2 else x) for name, x in kw.items()}
                want, want_w = attnx.reference(q[b:b + 1], hist[b][0][None], hist[b][1][None],
                                               is_causal="lower_right", enable_gqa=True,
                                               need_weights=True, **kw_b)
                assert_close(out[b:b + 1], want, err_msg=f"sequence {b} {kw}")
                assert_close(w[b:b + 1, ..., :lengths[b]], want_w, err_msg=f"sequence {b} {kw}")
                assert not w[b, ..., lengths[b]:].any()
                _, want_lse = attnx.scaled_dot_product_attention(
                    q[b:b + 1], hist[b][0][None], hist[b][1][None], is_causal="lower_right",
                    enable_gqa=True, return_lse=True, **kw_b)
                np.testing.assert_allclose(lse[b:b + 1], want_lse, rtol=1e-6)


# ---------------------------------------------------------------- full cache

@pytest.mark.parametrize("dtype", DTYPES)
def test_full_cache_refuses_and_writes_nothing(rng, dtype):
    cache = attnx.KVCache(2, 2, 6, 4, dtype=dtype)
    cache.append(*tokens(rng, cache, 4))
    for n in (3, 7):
        k0, v0, len0 = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
        with pytest.raises(ValueError, match=r"cache is full.*max_len=6"):
            cache.append(*tokens(rng, cache, n))
        np.testing.assert_array_equal(cache.k, k0)
        np.testing.assert_array_equal(cache.v, v0)
        np.testing.assert_array_equal(cache.lengths, len0)
    cache.append(*tokens(rng, cache, 2))          # exactly full
    assert cache.lengths.tolist() == [6, 6]
    cache.append(*tokens(rng, cache, 0))          # nothing to write: allowed
    k0 = cache.k.copy()
    with pytest.raises(ValueError, match="max_len"):
        cache.append(*tokens(rng, cache, 1))
    np.testing.assert_array_equal(cache.k, k0)
    assert cache.lengths.tolist() == [6, 6]


def test_full_sequence_blocks_the_others(rng):
    """With lengths [6, 3] of max_len 6, one more token is refused for every
    sequence: nothing written to the second one, which had room."""
    cache = attnx.KVCache(2, 1, 6, 4)
    cache.append(*tokens(rng, cache, 6))
    cache.lengths[1] = 3
    k0, v0 = cache.k.copy(), cache.v.copy()
    with pytest.raises(ValueError, match="max_len"):
        cache.append(*tokens(rng, cache, 1))
    np.testing.assert_array_equal(cache.k, k0)
    np.testing.assert_array_equal(cache.v, v0)
    assert cache.lengths.tolist() == [6, 3]


def test_zero_length_cache():
    cache = attnx.KVCache(1, 1, 0, 4)
    cache.append(np.zeros((1, 1, 0, 4), np.float32), np.zeros((1, 1, 0, 4), np.float32))
    with pytest.raises(ValueError, match="max_len=0"):
        cache.append(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.float32))


# ------------------------------------------------------------------ errors

B_, H_, E_, EV_ = 2, 2, 4, 3
SHAPE_K = r"k_new must be \(batch, heads, n, 4\)"
SHAPE_V = r"v_new must be \(batch, heads, n, 3\)"
BAD_APPEND = {   # name: (k_new shape[+dtype], v_new shape[+dtype], exception, words)
    "k_batch": ((3, H_, 1, E_), (B_, H_, 1, EV_), ValueError, SHAPE_K),
    "k_heads": ((B_, 1, 1, E_), (B_, H_, 1, EV_), ValueError, SHAPE_K),
    "k_head_dim": ((B_, H_, 1, EV_), (B_, H_, 1, EV_), ValueError, SHAPE_K + r".*\(2, 2, 1, 3\)"),
    "k_3d": ((B_, 1, E_), (B_, H_, 1, EV_), ValueError, SHAPE_K),
    "v_value_dim": ((B_, H_, 1, E_), (B_, H_, 1, E_), ValueError, SHAPE_V),
    "v_heads": ((B_, H_, 1, E_), (B_, 4, 1, EV_), ValueError, SHAPE_V),
    "n_differs": ((B_, H_, 2, E_), (B_, H_, 1, EV_), ValueError, "same number of tokens"),
    "k_int": ((B_, H_, 1, E_, np.int64), (B_, H_, 1, EV_), TypeError, "k_new must be float"),
    "k_bool": ((B_, H_, 1, E_, np.bool_), (B_, H_, 1, EV_), TypeError, "k_new must be float"),
    "v_complex": ((B_, H_, 1, E_), (B_, H_, 1, EV_, np.complex64), TypeError, "v_new must be float"),
    "v_object": ((B_, H_, 1, E_), (B_, H_, 1, EV_, object), TypeError, "v_new must be float"),
}


def _array(rng, spec):
    shape, dtype = (spec[:-1], spec[-1]) if not isinstance(spec[-1], int) else (spec, np.float32)
    a = rng.standard_normal(shape)
    return a.astype(dtype) if dtype is not object else np.full(shape, None, object)


@pytest.mark.parametrize("name", BAD_APPEND)
def test_bad_append_refused_naming_the_argument_and_writes_nothing(rng, name):
    k_spec, v_spec, exc, words = BAD_APPEND[name]
    cache = attnx.KVCache(B_, H_, 8, E_, value_dim=EV_)
    cache.append(*tokens(rng, cache, 2))
    k0, v0 = cache.k.copy(), cache.v.copy()
    with pytest.raises(exc, match=words):
        cache.append(_array(rng, k_spec), _array(rng, v_spec))
    np.testing.assert_array_equal(cache.k, k0)
    np.testing.assert_array_equal(cache.v, v0)
    assert cache.lengths.tolist() == [2, 2]


@pytest.mark.parametrize("which", ["k_new", "v_new"])
def test_float16_cache_refuses_values_it_would_store_as_inf(rng, which):
    """A finite value beyond float16's range would become inf in a float16
    cache (data lost): refused naming the argument, nothing written. Values
    that round into range (65519), and inf and NaN given as such, are stored."""
    cache = attnx.KVCache(1, 2, 8, 4, dtype=np.float16)
    cache.append(*tokens(rng, cache, 2))
    k0, v0 = cache.k.copy(), cache.v.copy()
    k, v = (rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(2))
    (k if which == "k_new" else v)[0, 1, 0, 2] = -7e4
    with pytest.raises(ValueError, match=which + r" holds finite values beyond float16.*70000"):
        cache.append(k, v)
    np.testing.assert_array_equal(cache.k, k0)
    np.testing.assert_array_equal(cache.v, v0)
    assert cache.lengths.tolist() == [2]
    (k if which == "k_new" else v)[0, 1, 0, 2] = 65519.0
    (k if which == "k_new" else v)[0, 0, 0, :2] = [np.inf, np.nan]
    cache.append(k, v)
    stored = (cache.k if which == "k_new" else cache.v)[0, :, 2]
    assert stored[1, 2] == 65504 and stored[0, 0] == np.inf and np.isnan(stored[0, 1])
    f32 = attnx.KVCache(1, 1, 2, 1)
    f32.append(np.full((1, 1, 1, 1), 1e30, np.float32), np.full((1, 1, 1, 1), -1e30))
    assert f32.k[0, 0, 0, 0] == np.float32(1e30) and f32.v[0, 0, 0, 0] == np.float32(-1e30)


@pytest.mark.parametrize("q_shape, dtype, kw, exc, words", [
    ((3, 4, 1, 4), np.float32, {}, ValueError, r"q must be \(batch, Hq, n, head_dim\)"),
    ((2, 4, 1, 5), np.float32, {}, ValueError, r"q must be \(batch, Hq, n, head_dim\)"),
    ((2, 1, 4), np.float32, {}, ValueError, r"q must be \(batch"),
    ((2, 4, 1, 4), np.int32, {}, TypeError, "q must be float"),
    ((2, 3, 1, 4), np.float32, {}, ValueError, r"query heads \(3\) to be a multiple"),
    ((2, 4, 1, 4), np.float32, dict(attn_mask=np.ones((1, 3), bool)), ValueError, "attn_mask"),
    ((2, 4, 1, 4), np.float32, dict(is_causal=True), TypeError, "is_causal"),
    ((2, 4, 1, 4), np.float32, dict(key_lengths=[1, 2]), TypeError, "key_lengths"),
    ((2, 4, 1, 4), np.float32, dict(layout="blhd"), TypeError, "layout"),
    ((2, 4, 1, 4), np.float32, dict(enable_gqa=False), TypeError, "enable_gqa"),
    ((2, 4, 1, 4), np.float32, dict(window=(1, 2, 3)), TypeError, "window"),
    ((2, 4, 1, 4), np.float32, dict(sinks=np.zeros(3)), ValueError, "sinks"),
    ((2, 4, 1, 4), np.float32, dict(need_weights="yes"), TypeError, "need_weights"),
])
def test_bad_attend_refused_naming_the_argument(rng, q_shape, dtype, kw, exc, words):
    cache = attnx.KVCache(2, 2, 8, 4)
    cache.append(*tokens(rng, cache, 2))
    with pytest.raises(exc, match=words):
        cache.attend(rng.standard_normal(q_shape).astype(dtype), **kw)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(dtype=np.float64), TypeError, "dtype must be float32, float16, bfloat16 or int8"),
    (dict(dtype=np.int32), TypeError, "dtype must be float32, float16, bfloat16 or int8"),
    (dict(batch=0), ValueError, "batch"),
    (dict(batch=1.5), TypeError, "batch"),
    (dict(heads=0), ValueError, "heads"),
    (dict(max_len=-1), ValueError, "max_len"),
    (dict(head_dim=0), ValueError, "head_dim"),
    (dict(value_dim=0), ValueError, "value_dim"),
])
def test_bad_constructor_arguments_refused(kw, exc, words):
    args = dict(batch=1, heads=2, max_len=4, head_dim=8)
    args.update(kw)
    with pytest.raises(exc, match=words):
        attnx.KVCache(**args)


def test_repr_says_what_the_cache_holds(rng):
    cache = attnx.KVCache(1, 2, 4, 8, value_dim=3, dtype=np.float16)
    cache.append(*tokens(rng, cache, 3))
    assert repr(cache) == ("KVCache(batch=1, heads=2, max_len=4, head_dim=8, value_dim=3, "
                           "dtype=float16, lengths=[3])")


@pytest.mark.parametrize("bad", [[-1, 2], [2, 9], [1], [1.5, 2.0]])
def test_lengths_set_out_of_range_are_refused(rng, bad):
    """``lengths`` is a public attribute: a value the cache cannot hold (negative,
    past max_len, the wrong count, not integers) is refused by append and attend,
    which write nothing, instead of slicing the wrong keys."""
    cache = attnx.KVCache(2, 2, 8, 4)
    cache.append(rng.standard_normal((2, 2, 2, 4)).astype(np.float32),
                 rng.standard_normal((2, 2, 2, 4)).astype(np.float32))
    cache.lengths = np.array(bad)
    k0 = cache.k.copy()
    with pytest.raises(ValueError, match="KVCache.lengths must be 2 integers in"):
        cache.attend(rng.standard_normal((2, 2, 1, 4)).astype(np.float32))
    with pytest.raises(ValueError, match="KVCache.lengths must be 2 integers in"):
        cache.append(np.zeros((2, 2, 1, 4), np.float32), np.zeros((2, 2, 1, 4), np.float32))
    np.testing.assert_array_equal(cache.k, k0)


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "ml_dtypes"])
def test_bfloat16_cache(isa, rng, dtype):
    """A bfloat16 cache (dtype "bfloat16" or ml_dtypes.bfloat16): 2 bytes a value,
    appended from float32 rounded to nearest, ties to even, attended in place:
    the float32 result on the stored values; a finite value it would store as
    inf is refused, naming the argument, with nothing written."""
    cache = attnx.KVCache(2, 2, 40, 8, dtype=BF16 if dtype == "ml_dtypes" else dtype)
    assert cache.k.dtype == BF16 and cache.k.itemsize == 2
    # ties to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (bits 0x3f80, 0x3f81)
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001], np.uint32).view(np.float32)
    k = randn(rng, (2, 2, 9, 8))
    k[0, 0, 0, :3] = ties
    v = randn(rng, (2, 2, 9, 8))
    cache.append(k, v)
    assert cache.k[0, 0, 0, :3].view(np.uint16).tolist() == [0x3F80, 0x3F82, 0x3F81]
    q = randn(rng, (2, 4, 3, 8))
    out = cache.attend(q)
    stored_k, stored_v = (a[:, :, :9].astype(np.float64) for a in (cache.k, cache.v))
    assert_close(out, attnx.reference(q, stored_k, stored_v, is_causal="lower_right",
                                      enable_gqa=True))
    assert out.tobytes() == attnx.scaled_dot_product_attention(
        q, stored_k.astype(np.float32), stored_v.astype(np.float32), is_causal="lower_right",
        enable_gqa=True).tobytes()
    before = cache.k.copy()
    with pytest.raises(ValueError, match=r"v_new holds finite values beyond bfloat16's range"):
        cache.append(randn(rng, (2, 2, 1, 8)), np.full((2, 2, 1, 8), 3.4e38, np.float32))
    assert cache.k.tobytes() == before.tobytes() and cache.lengths.tolist() == [9, 9]
