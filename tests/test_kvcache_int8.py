"""``attnx.KVCache(dtype="int8")``: each appended (token, head) row rotated by a
fixed orthogonal matrix R (``attnx.int8_rotation(E)``) and stored as int8
values and a float32 scale, ``scale = max|Rx| / 127``, rounded to nearest.

Tested two ways, as the int8 issues ask:
* against the original values: every stored row, dequantized (``R.T @
  (scale * q)``, in float64), within Euclidean distance ``sqrt(E) * max|Rx| /
  254`` of the row it came from (to a relative 2e-5 of that bound), on
  adversarial rows too: outlier channels, one huge value among small ones,
  all zeros, values near float32's largest and subnormal values; NaN, inf and
  rows too long for float32 once rotated raise ValueError naming the argument
  and write nothing. Keys with outlier channels come out at least twice as
  close as the unrotated per-row format (``quantize_rows``, kept for
  ``(pages, scales)`` pools) leaves them;
* against float64: ``attend`` equals ``attnx.reference`` over the dequantized
  values within the float32 tolerance, on every ISA, with decoding rows (read
  in place by the int8 kernels) and larger blocks (converted tile by tile),
  grouped-query heads, value_dim != head_dim, every option (window, sinks,
  softcap, ALiBi, scale, need_weights, return_lse), sequences of different
  lengths, 1-3 threads with keys split across threads, fully masked rows.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx._int8 import INT8_SUBNORMAL_ROWS, INT8_SUBNORMAL_SLACK, quantize_rows
from conftest import LOW_FLOATS, assert_close, randn, random_page_table


def dequantized(cache, L=None):
    """The values an int8 cache stands for: R.T @ (scale * int8), in float64,
    plus each sequence's key centre (k_center) for the keys."""
    L = cache.max_len if L is None else L

    def rows(q, scale, rotation):
        return (scale[:, :, :L, None].astype(np.float64) * q[:, :, :L]) @ rotation
    centre = 0.0 if cache.k_center is None else cache.k_center.astype(np.float64)
    return (rows(cache.k, cache.k_scale, cache.k_rotation) + centre,
            rows(cache.v, cache.v_scale, cache.v_rotation))


def within_bound(x, stored):
    """Each dequantized value within the documented bound of the unrotated
    format: max|x| / 254 of its row (to float32 rounding), plus 2**-150 where
    max|x| < 127 * 2**-126 (the scale subnormal), and no more."""
    assert INT8_SUBNORMAL_ROWS == 127 * 2.0 ** -126 and INT8_SUBNORMAL_SLACK == 2.0 ** -150
    x64 = np.asarray(x, np.float64)
    top = np.abs(x64).max(axis=-1, keepdims=True)
    bound = top / 254 * (1 + 2e-5) + np.where(top < INT8_SUBNORMAL_ROWS, INT8_SUBNORMAL_SLACK, 0)
    err = np.abs(stored.astype(np.float64) - x64)
    assert (err <= bound).all(), f"error {err.max()} past the bound (row max / 254)"


def within_rotated_bound(x, stored, centre=None):
    """Each row the cache stands for within Euclidean distance sqrt(E) * (max|y|
    / 254 + the subnormal slack) of the row appended, y = R (x - centre) (keys
    of a centring cache: centre its k_center; else 0); and max|y| <= ||x -
    centre||, so within sqrt(E) * ||x - centre|| / 254 too."""
    if centre is not None:
        c = np.asarray(centre, np.float64)
        x, stored = np.asarray(x, np.float64) - c, np.asarray(stored, np.float64) - c
    x64 = np.asarray(x, np.float64)
    E = x64.shape[-1]
    top = np.abs(x64 @ attnx.int8_rotation(E).T).max(axis=-1)
    assert (top <= np.linalg.norm(x64, axis=-1) * (1 + 1e-12)).all()
    bound = np.sqrt(E) * (top / 254 * (1 + 2e-5) + np.where(top < INT8_SUBNORMAL_ROWS,
                                                            INT8_SUBNORMAL_SLACK, 0))
    err = np.linalg.norm(np.asarray(stored, np.float64) - x64, axis=-1)
    assert (err <= bound + 1e-12 * np.linalg.norm(x64, axis=-1)).all(), \
        f"error {err.max()} past the bound (sqrt(E) max|Rx| / 254)"


# --------------------------------------------------------------- quantization

ROWS = {
    "normal": lambda rng: rng.standard_normal((3, 64)),
    "one_huge_value": lambda rng: np.where(np.arange(64) == 5, 3e30, rng.standard_normal((3, 64))),
    "all_zeros": lambda rng: np.zeros((3, 64)),
    "float32_max": lambda rng: np.full((3, 64), np.finfo(np.float32).max) * np.sign(
        rng.standard_normal((3, 64))),
    "subnormal": lambda rng: rng.standard_normal((3, 64)) * 1e-42,
    # row maxima from the smallest subnormal to 127 times the smallest normal, the
    # rows whose scale is subnormal (each row: its maximum and values below it)
    "subnormal_scales": lambda rng: (2.0 ** rng.uniform(-149, np.log2(127) - 126, (400, 1))
                                     * np.where(np.arange(16) == 0, 1.0,
                                                rng.uniform(-1, 1, (400, 16)))),
    "smallest_subnormal": lambda rng: np.array([[2.0 ** -149, -(2.0 ** -149), 0.0]] * 3),
    "tiny_normal": lambda rng: rng.standard_normal((3, 64)) * 1e-36,
    "exact_multiples": lambda rng: rng.integers(-127, 128, (3, 64)) * 0.5,
    "ties": lambda rng: np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 58] * 3),
    "one_value": lambda rng: rng.standard_normal((3, 1)),
}


@pytest.mark.parametrize("name", ROWS)
def test_quantized_rows_within_the_stated_bound(rng, name):
    x = ROWS[name](rng).astype(np.float32)
    q, scale = quantize_rows(x, "x")
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == x.shape[:-1]
    assert q.min() >= -127
    stored = scale[..., None] * q.astype(np.float32)
    within_bound(x, stored)
    np.testing.assert_array_equal(scale == 0, np.abs(x).max(-1) == 0)


def test_rounding_is_to_nearest_even():
    """scale 1 (max|x| = 127): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2."""
    q, scale = quantize_rows(np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]], np.float32), "x")
    assert scale.tolist() == [1.0]
    assert q.tolist() == [[127, 0, 2, 2, 0, -2]]


#: the signs of int8_rotation(64)'s first row, first 8 columns (1 = positive)
PINNED_SIGNS_64 = [1, 0, 1, 0, 1, 0, 1, 1]

ROTATED_ROWS = dict(ROWS, float32_max=lambda rng: np.where(
    np.arange(64) == 3, np.finfo(np.float32).max, rng.standard_normal((3, 64))),
    outlier_channels=lambda rng: rng.standard_normal((50, 64)) + np.where(
        np.isin(np.arange(64), [3, 17, 40]), 40.0, 0.0))


@pytest.mark.parametrize("name", ROTATED_ROWS)
def test_rotated_rows_within_the_stated_bound(rng, name):
    """attnx.quantize_int8 (the caches' format) on adversarial rows: each within
    sqrt(E) * max|Rx| / 254 of the row; rows of zeros exact, with scale 0."""
    x = ROTATED_ROWS[name](rng).astype(np.float32)
    q, scale = attnx.quantize_int8(x)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == x.shape[:-1]
    assert q.min() >= -127
    R = attnx.int8_rotation(x.shape[-1])
    rows = (scale[..., None].astype(np.float64) * q) @ R
    within_rotated_bound(x, rows)
    with np.errstate(over="ignore"):      # ~float32's largest, rotated back, may round past it
        np.testing.assert_array_equal(attnx.dequantize_int8(q, scale), rows.astype(np.float32))
    np.testing.assert_array_equal(scale == 0, np.abs(x).max(-1) == 0)


def test_outlier_channel_keys_twice_as_close_as_rows_unrotated(rng):
    """Keys whose channels 3, 17 and 40 sit near 40 for every token (as real
    models' keys do): the rotated format's error, over the rows and in the
    scores of random queries, is under half the unrotated per-row format's."""
    k = rng.standard_normal((2, 2, 200, 64)) + np.where(np.isin(np.arange(64), [3, 17, 40]),
                                                         40.0, 0.0)
    k = k.astype(np.float32)
    cache = attnx.KVCache(2, 2, 200, 64, dtype="int8")
    cache.append(k, k)
    rotated, _ = dequantized(cache, 200)
    q8, s8 = quantize_rows(k, "k")
    plain = s8[..., None].astype(np.float64) * q8
    q = rng.standard_normal((2, 2, 16, 64))
    for ours, theirs in ((rotated - k, plain - k),
                         (q @ (rotated - k).swapaxes(-1, -2), q @ (plain - k).swapaxes(-1, -2))):
        ratio = np.sqrt(np.mean(ours ** 2) / np.mean(theirs ** 2))
        assert ratio < 0.5, f"rotated / unrotated rms error {ratio:.2f}"


def test_centred_keys_closer_than_uncentred_with_a_shared_part(rng):
    """Keys that share a large part (outlier channels near 40 for every token,
    and every channel's own offset, as real keys' per-channel means are):
    minus the prompt's mean, the rows keep only what differs between
    tokens, and their error, over the rows and in random queries' scores,
    is under half of the rotated rows' without the centre. The values are
    never centred."""
    shared = rng.standard_normal(64) * 3 + np.where(np.isin(np.arange(64), [3, 17, 40]), 40.0, 0.0)
    k = (rng.standard_normal((2, 2, 200, 64)) + shared).astype(np.float32)
    centred = attnx.KVCache(2, 2, 200, 64, dtype="int8")
    plain = attnx.KVCache(2, 2, 200, 64, dtype="int8", center_keys=False)
    assert plain.k_center is None
    for c in (centred, plain):
        c.append(k, k)
    np.testing.assert_allclose(centred.k_center, k.mean(axis=2, keepdims=True), rtol=1e-6,
                               atol=1e-5)
    (ck, cv), (pk, pv) = dequantized(centred, 200), dequantized(plain, 200)
    np.testing.assert_array_equal(cv, pv)
    q = rng.standard_normal((2, 2, 16, 64))
    for ours, theirs in ((ck - k, pk - k), (q @ (ck - k).swapaxes(-1, -2),
                                            q @ (pk - k).swapaxes(-1, -2))):
        ratio = np.sqrt(np.mean(ours ** 2) / np.mean(theirs ** 2))
        assert ratio < 0.5, f"centred / uncentred rms error {ratio:.2f}"


def test_softcap_needs_uncentred_keys(rng):
    """tanh does not let the centre's shift of a row's scores cancel: softcap
    on a centring cache raises ValueError naming center_keys; with
    center_keys=False it is computed as over the rows."""
    k, v = randn(rng, (1, 2, 6, 8)), randn(rng, (1, 2, 6, 8))
    q = randn(rng, (1, 2, 2, 8))
    cache = attnx.KVCache(1, 2, 8, 8, dtype="int8")
    cache.append(k, v)
    with pytest.raises(ValueError, match="center_keys=False"):
        cache.attend(q, softcap=5.0)
    plain = attnx.KVCache(1, 2, 8, 8, dtype="int8", center_keys=False)
    plain.append(k, v)
    kd, vd = dequantized(plain, 6)
    assert_close(plain.attend(q, softcap=5.0),
                 attnx.reference(q, kd, vd, is_causal="lower_right", softcap=5.0))
    for dtype in ("int8", np.float32):
        with pytest.raises(TypeError, match="center_keys"):
            attnx.KVCache(1, 2, 8, 8, dtype=dtype, center_keys="yes")


def test_rotation_is_orthogonal_and_fixed():
    """int8_rotation(E) is orthogonal, the same every call, and its numbers are
    pinned: they define what stored int8 rows mean."""
    for E in (1, 2, 8, 64, 80, 96, 128, 256):
        R = attnx.int8_rotation(E)
        assert R.shape == (E, E) and R.dtype == np.float64
        np.testing.assert_allclose(R @ R.T, np.eye(E), atol=1e-12)
        np.testing.assert_array_equal(R, attnx.int8_rotation(E))
    R = attnx.int8_rotation(64)
    assert np.allclose(np.abs(R), 1 / 8)          # Hadamard: every entry +-1/sqrt(64)
    assert (np.sign(R[0, :8]) > 0).astype(int).tolist() == PINNED_SIGNS_64
    with pytest.raises(ValueError, match="dim"):
        attnx.int8_rotation(0)


@pytest.mark.parametrize("dim", [2.5, 8.0, "8", True, np.bool_(True), None, np.float64(4)])
def test_rotation_dim_must_be_an_integer(dim):
    """Issue 56, 5: int8_rotation(2.5) was a (2, 2) matrix and ("8") was taken;
    dim is an integer (Python, NumPy, 0-d integer arrays), as every size of the
    package: TypeError naming dim and the value; ValueError below 1."""
    with pytest.raises(TypeError, match=r"dim must be a positive integer; got \w+ "):
        attnx.int8_rotation(dim)


def test_rotation_dim_takes_numpy_integers_and_refuses_non_positive():
    np.testing.assert_array_equal(attnx.int8_rotation(np.int64(8)), attnx.int8_rotation(8))
    np.testing.assert_array_equal(attnx.int8_rotation(np.array(6)), attnx.int8_rotation(6))
    for dim in (0, -3, np.int32(-1)):
        with pytest.raises(ValueError, match=rf"dim must be a positive integer; got {int(dim)}"):
            attnx.int8_rotation(dim)


def test_caches_share_one_read_only_rotation():
    """Every int8 cache of a width shares one read-only matrix (an AttnxCache
    has a cache a layer); int8_rotation's own array is the caller's to change,
    and changing it changes no cache."""
    a, b = (attnx.KVCache(1, 2, 4, 64, value_dim=32, dtype="int8") for _ in range(2))
    assert a.k_rotation is b.k_rotation and a.v_rotation is b.v_rotation
    assert not a.k_rotation.flags.writeable and a.v_rotation.shape == (32, 32)
    mine = attnx.int8_rotation(64)
    mine[:] = 0
    np.testing.assert_array_equal(a.k_rotation, attnx.int8_rotation(64))
    assert attnx.KVCache(1, 2, 4, 64).k_rotation is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64] + LOW_FLOATS)
def test_append_stores_int8_and_scales_in_place(rng, dtype):
    cache = attnx.KVCache(2, 3, 10, 8, value_dim=5, dtype="int8")
    assert cache.k.dtype == cache.v.dtype == np.int8
    assert cache.k_scale.shape == (2, 3, 10) and cache.v_scale.shape == (2, 3, 10)
    ids = [id(a) for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)]
    k, v = randn(rng, (2, 3, 4, 8), dtype), randn(rng, (2, 3, 4, 5), dtype)
    cache.append(k, v)
    assert [id(a) for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)] == ids
    dk, dv = dequantized(cache, 4)
    within_rotated_bound(k.astype(np.float32), dk, cache.k_center)
    within_rotated_bound(v.astype(np.float32), dv)
    assert not cache.k[:, :, 4:].any() and not cache.k_scale[:, :, 4:].any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["k_new", "v_new"])
def test_nan_and_inf_refused_writing_nothing(rng, bad, which):
    cache = attnx.KVCache(1, 2, 8, 4, dtype=np.int8)
    cache.append(randn(rng, (1, 2, 2, 4)), randn(rng, (1, 2, 2, 4)))
    before = [a.copy() for a in (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lengths)]
    k, v = randn(rng, (1, 2, 3, 4)), randn(rng, (1, 2, 3, 4))
    (k if which == "k_new" else v)[0, 1, 2, 3] = bad
    with pytest.raises(ValueError, match=rf"{which} holds .* at \(0, 1, 2, 3\).*int8"):
        cache.append(k, v)
    after = (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lengths)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------- attend

SHAPES = {"mha": (2, 2, 16, 16), "gqa_4": (8, 2, 64, 64), "gqa_value_dim": (6, 2, 24, 40),
          "odd_dims": (3, 3, 13, 7)}


@pytest.mark.parametrize("shape", SHAPES)
def test_prompt_then_tokens_match_reference_on_dequantized_values(isa, rng, shape):
    """A prompt (a block: converted tiles), single tokens (decoding rows: the int8
    kernels) and a chunk, each attend equal to float64 over the dequantized values."""
    Hq, H, E, Ev = SHAPES[shape]
    B = 2
    cache = attnx.KVCache(B, H, 400, E, value_dim=Ev, dtype="int8")
    for n in (150, 1, 1, 2, 3, 70, 1):
        cache.append(randn(rng, (B, H, n, E)), randn(rng, (B, H, n, Ev)))
        q = randn(rng, (B, Hq, n, E))
        k, v = dequantized(cache, int(cache.lengths[0]))
        out = cache.attend(q)
        assert out.shape == (B, Hq, n, Ev) and out.dtype == np.float32
        assert_close(out, attnx.reference(q, k, v, is_causal="lower_right", enable_gqa=True),
                     err_msg=f"after {n} token(s)")


def test_attn_mask_combines_with_the_causal_mask(isa, rng):
    """A left-padded batch's mask over an int8 cache: a prompt (converted tiles)
    and tokens (the int8 kernels), against float64 over the dequantized values."""
    cache = attnx.KVCache(2, 2, 300, 16, dtype="int8")
    for n in (200, 1, 1):
        cache.append(randn(rng, (2, 2, n, 16)), randn(rng, (2, 2, n, 16)))
        L = int(cache.lengths[0])
        mask = (np.arange(L) >= np.array([[0], [5]]))[:, None, None, :]
        q = randn(rng, (2, 4, n, 16))
        k, v = dequantized(cache, L)
        assert_close(cache.attend(q, attn_mask=mask),
                     attnx.reference(q, k, v, attn_mask=mask, is_causal="lower_right",
                                     enable_gqa=True), err_msg=f"after {n} token(s)")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_cache_decoding_split_over_threads(rng, threads):
    """One token over 3000 keys: the keys split across threads and merged."""
    cache = attnx.KVCache(1, 2, 3000, 32, dtype="int8")
    cache.append(randn(rng, (1, 2, 3000, 32)), randn(rng, (1, 2, 3000, 32)))
    q = randn(rng, (1, 8, 1, 32))
    k, v = dequantized(cache)
    previous = attnx.get_num_threads()
    attnx.set_num_threads(threads)
    try:
        out, lse = cache.attend(q, return_lse=True)
    finally:
        attnx.set_num_threads(previous)
    assert_close(out, attnx.reference(q, k, v, is_causal="lower_right", enable_gqa=True))
    s = np.einsum("bhe,bhle->bhl", q[:, :, 0].astype(np.float64),
                  np.repeat(k, 4, axis=1).astype(np.float64)) / np.sqrt(32)
    top = s.max(-1)
    assert_close(lse[..., 0], top + np.log(np.exp(s - top[..., None]).sum(-1)))


OPTIONS = {
    "window": dict(window=(4, 0)),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "scale": dict(scale=0.7),
    "query_lengths": dict(query_lengths=[1, 0]),
    "window_sinks_alibi": dict(window=(5, 0), sinks=[1.0, 0.0, -1.0, 2.0],
                               alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_options_weights_and_lse_match_reference(isa, rng, name):
    kw = OPTIONS[name]
    # softcap needs uncentred keys (tanh does not let the centre's shift cancel)
    cache = attnx.KVCache(2, 2, 40, 8, value_dim=6, dtype="int8", center_keys="softcap" not in kw)
    for n in (20, 1, 1, 2):
        cache.append(randn(rng, (2, 2, n, 8)), randn(rng, (2, 2, n, 6)))
        q = randn(rng, (2, 4, n, 8))
        k, v = dequantized(cache, int(cache.lengths[0]))
        ref = dict(is_causal="lower_right", enable_gqa=True, **kw)
        out, w, lse = cache.attend(q, need_weights=True, return_lse=True, **kw)
        want, want_w = attnx.reference(q, k, v, need_weights=True, **ref)
        assert_close(out, want, err_msg=f"{n} token(s)")
        assert_close(w, want_w)
        _, want_lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True, **ref)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(cache.attend(q, **kw), out, rtol=1e-5, atol=1e-6)


def test_sequences_of_different_lengths(rng):
    cache = attnx.KVCache(3, 2, 16, 8, dtype="int8")
    cache.append(randn(rng, (3, 2, 7, 8)), randn(rng, (3, 2, 7, 8)))
    cache.lengths[:] = [5, 0, 7]
    cache.append(randn(rng, (3, 2, 1, 8)), randn(rng, (3, 2, 1, 8)))
    q = randn(rng, (3, 4, 1, 8))
    out, w = cache.attend(q, need_weights=True)
    assert w.shape == (3, 4, 1, 8)
    k, v = dequantized(cache)
    for b, L in enumerate([6, 1, 8]):
        want, want_w = attnx.reference(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                                       is_causal="lower_right", enable_gqa=True,
                                       need_weights=True)
        assert_close(out[b:b + 1], want)
        assert_close(w[b:b + 1, ..., :L], want_w)
        assert not w[b, ..., L:].any()


def test_empty_cache_and_fully_masked_rows_give_zeros(rng):
    cache = attnx.KVCache(2, 2, 8, 4, dtype="int8")
    out, lse = cache.attend(randn(rng, (2, 4, 3, 4)), return_lse=True)
    assert out.shape == (2, 4, 3, 4) and not out.any() and np.isneginf(lse).all()
    cache.append(randn(rng, (2, 2, 3, 4)), randn(rng, (2, 2, 3, 4)))
    out = cache.attend(randn(rng, (2, 4, 1, 4)), window=(-1, -1), query_lengths=[0, 0])
    assert not out.any() and not np.isnan(out).any()


def test_zero_rows_and_a_huge_value_in_the_cache(rng):
    """Adversarial stored rows: all-zero keys (scale 0) and one huge value among
    small ones still give the reference over what is stored."""
    cache = attnx.KVCache(1, 2, 8, 16, dtype="int8")
    k, v = randn(rng, (1, 2, 4, 16)), randn(rng, (1, 2, 4, 16))
    k[0, 0, 1] = 0.0
    v[0, 1, 2] = 0.0
    k[0, 1, 3, 7] = 1e4
    cache.append(k, v)
    q = randn(rng, (1, 2, 2, 16), scale=1e-3)
    kd, vd = dequantized(cache, 4)
    assert_close(cache.attend(q), attnx.reference(q, kd, vd, is_causal="lower_right"))


def test_int8_cache_refuses_what_the_others_refuse(rng):
    cache = attnx.KVCache(1, 2, 8, 4, dtype="int8")
    cache.append(randn(rng, (1, 2, 2, 4)), randn(rng, (1, 2, 2, 4)))
    with pytest.raises(ValueError, match="attn_mask"):
        cache.attend(randn(rng, (1, 2, 1, 4)), attn_mask=np.ones((1, 3), bool))
    with pytest.raises(TypeError, match="is_causal"):
        cache.attend(randn(rng, (1, 2, 1, 4)), is_causal=True)
    with pytest.raises(TypeError, match="windw"):
        cache.attend(randn(rng, (1, 2, 1, 4)), windw=(1, 0))
    with pytest.raises(ValueError, match="k_new must be"):
        cache.append(randn(rng, (1, 2, 1, 5)), randn(rng, (1, 2, 1, 4)))
    with pytest.raises(TypeError, match="int8"):
        attnx.KVCache(1, 1, 1, 1, dtype=np.int16)
    assert "int8" in repr(cache)


# ------------------------------------------------------- int8 pages (varlen)

@pytest.mark.parametrize("rotated", [True, False, "centred"],
                         ids=["rotated", "unrotated", "centred"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_int8_pages_read_in_place_match_reference(isa, rng, block_size, rotated):
    """varlen_attention over int8 pages given as (pages, scales, rotation) (the
    caches' format), (pages, scales) or, for keys, (pages, scales, rotation,
    centers), pages in a random order, decoding rows and a prefill chunk in
    one call: each sequence equals float64 over its dequantized keys (plus its
    centre), gathered."""
    Hk, Hq, E, Ev = 2, 6, 24, 16
    lens, lq = [300, 1, 0, 45, 7], [1, 1, 0, 45, 3]
    need = [-(-n // block_size) for n in lens]
    NB = sum(need) + 3
    quantize = attnx.quantize_int8 if rotated else (lambda x: quantize_rows(x, "x"))
    kq, ks = quantize(randn(rng, (NB, block_size, Hk, E)))
    vq, vs = quantize(randn(rng, (NB, block_size, Hk, Ev)))
    Rk = attnx.int8_rotation(E) if rotated else np.eye(E)
    Rv = attnx.int8_rotation(Ev) if rotated else np.eye(Ev)
    table = random_page_table(rng, need, NB)
    cu_q, cu_k = np.cumsum([0] + lq), np.cumsum([0] + lens)
    q = randn(rng, (sum(lq), Hq, E))
    key, value = ((kq, ks, Rk), (vq, vs, Rv)) if rotated else ((kq, ks), (vq, vs))
    centers = randn(rng, (len(lens), Hk, E), scale=3.0) if rotated == "centred" else None
    if centers is not None:
        key += (centers,)
    sinks = rng.standard_normal((len(lens), Hq)).astype(np.float32)
    assert (centers is not None) == (rotated == "centred")
    out, lse = attnx.varlen_attention(q, key, value, cu_q, cu_k, block_table=table, sinks=sinks,
                                      is_causal="lower_right", enable_gqa=True, return_lse=True)
    kd = (ks[..., None].astype(np.float64) * kq) @ Rk
    vd = (vs[..., None].astype(np.float64) * vq) @ Rv
    for i, (n, m) in enumerate(zip(lens, lq)):
        if m == 0:
            continue
        rows = lambda pool: pool[table[i, :need[i]]].reshape(-1, Hk, pool.shape[-1])[:n]  # noqa: E731
        k, v = rows(kd).swapaxes(0, 1)[None], rows(vd).swapaxes(0, 1)[None]
        if centers is not None:
            k = k + centers[i][None, :, None, :]
        qi = q[cu_q[i]:cu_q[i + 1]].swapaxes(0, 1)[None]
        kw = dict(is_causal="lower_right", enable_gqa=True, sinks=sinks[i])
        want = attnx.reference(qi, k, v, **kw)
        assert_close(out[cu_q[i]:cu_q[i + 1]], want[0].swapaxes(0, 1), err_msg=f"sequence {i}")
        want_lse = attnx.scaled_dot_product_attention(qi, k, v, return_lse=True, **kw)[1]
        np.testing.assert_allclose(lse[:, cu_q[i]:cu_q[i + 1]], want_lse[0], rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("center_keys", [True, False], ids=["centred", "uncentred"])
def test_int8_pages_from_a_kvcache_equal_its_attend(isa, rng, center_keys):
    """Issue 56: an int8 KVCache's rows handed to varlen_attention as pages, with
    its rotations and (when it centres keys) its centres, give ``attend``'s
    answer on the same rows (the 4-tuple's rotation was once ignored: off by up
    to 1.46). Two sequences of one page each, GQA 4/2, a decoding row and a
    prefill chunk."""
    B, Hk, Hq, E, L = 2, 2, 4, 16, 37
    cache = attnx.KVCache(B, Hk, 64, E, dtype="int8", center_keys=center_keys)
    cache.append(randn(rng, (B, Hk, L, E)) + 2.5, randn(rng, (B, Hk, L, E)))
    assert (cache.k_center is not None) == center_keys
    assert cache.k_rotation is not None and cache.v_rotation is not None
    lq = [1, 5]
    q = [randn(rng, (1, Hq, m, E)) for m in lq]
    want = [cache.attend(np.broadcast_to(qi, (B, Hq, qi.shape[2], E)))[b]
            for b, qi in enumerate(q)]
    pages = cache.k[:, :, :L].swapaxes(1, 2)                      # (B pages, L rows, Hk, E)
    key = (pages, cache.k_scale[:, :, :L].swapaxes(1, 2), cache.k_rotation)
    if center_keys:
        key += (cache.k_center[:, :, 0],)                           # (N, Hk, E)
    value = (cache.v[:, :, :L].swapaxes(1, 2), cache.v_scale[:, :, :L].swapaxes(1, 2),
             cache.v_rotation)
    packed = np.concatenate([qi[0].swapaxes(0, 1) for qi in q])    # (total, Hq, E)
    out = attnx.varlen_attention(packed, key, value, np.cumsum([0] + lq), [0, L, 2 * L],
                                 block_table=[[0], [1]], is_causal="lower_right", enable_gqa=True)
    for b in range(B):
        got = out[sum(lq[:b]):sum(lq[:b + 1])].swapaxes(0, 1)
        assert_close(got, want[b], err_msg=f"sequence {b}")


def test_int8_pages_take_misaligned_scales(rng):
    """float32 scales at an address not a multiple of 4 (a valid NumPy layout,
    found by the fuzzer) are read as aligned ones: once refused with "k's
    scales data is not aligned", naming no argument."""
    kq, ks = quantize_rows(randn(rng, (3, 8, 2, 16)), "k")
    buf = np.empty(ks.nbytes + 1, np.uint8)
    odd = buf[1:].view(np.float32).reshape(ks.shape)
    odd[...] = ks
    assert not odd.flags.aligned
    q, cu, table = randn(rng, (1, 2, 16)), np.array([0, 1]), np.array([[2]], np.int32)
    want = attnx.varlen_attention(q, (kq, ks), (kq, ks), cu, [0, 8], block_table=table)
    got = attnx.varlen_attention(q, (kq, odd), (kq, odd), cu, [0, 8], block_table=table)
    np.testing.assert_array_equal(got, want)


def test_int8_pages_refused_when_malformed(rng):
    kq, ks = quantize_rows(randn(rng, (4, 8, 2, 16)), "k")
    q, cu, table = randn(rng, (1, 2, 16)), np.array([0, 1]), np.array([[0]], np.int32)
    with pytest.raises(TypeError, match="both be"):
        attnx.varlen_attention(q, (kq, ks), kq.astype(np.float32), cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"key\[1\] must be float32 scales"):
        attnx.varlen_attention(q, (kq, ks[:, :4]), (kq, ks), cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"key\[0\] must be int8 pages"):
        attnx.varlen_attention(q, (kq.astype(np.int16), ks), (kq, ks), cu, cu,
                               block_table=table)
    with pytest.raises(ValueError, match="need block_table"):
        attnx.varlen_attention(q, (kq[0], ks[0]), (kq[0], ks[0]), cu, cu)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 9 names no page"):
        attnx.varlen_attention(q, (kq, ks), (kq, ks), cu, cu, block_table=[[9]])
    with pytest.raises(ValueError, match=r"key\[2\] must be a finite rotation \(16, 16\)"):
        attnx.varlen_attention(q, (kq, ks, np.eye(8)), (kq, ks), cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"value\[2\] must be a finite rotation"):
        attnx.varlen_attention(q, (kq, ks), (kq, ks, np.full((16, 16), np.nan)), cu, cu,
                               block_table=table)
    for bad in (np.full((3, 5), np.nan), np.full((16, 16), np.nan), np.eye(8)):  # every form alike
        with pytest.raises(ValueError, match=r"key\[2\] must be a finite rotation \(16, 16\)"):
            attnx.varlen_attention(q, (kq, ks, bad, np.zeros((1, 2, 16))), (kq, ks), cu, cu,
                                   block_table=table)
    with pytest.raises(ValueError, match="got 5 items"):
        attnx.varlen_attention(q, (kq, ks, None, None, None), (kq, ks), cu, cu, block_table=table)
    with pytest.raises(ValueError, match="value as a tuple .* got 4 items"):
        attnx.varlen_attention(q, (kq, ks), (kq, ks, None, None), cu, cu, block_table=table)
    with pytest.raises(ValueError, match=r"key\[3\] must be finite centers \(1, 2, 16\)"):
        attnx.varlen_attention(q, (kq, ks, None, np.zeros((2, 2, 16))), (kq, ks), cu, cu,
                               block_table=table)
    with pytest.raises(ValueError, match="softcap needs the scores"):
        attnx.varlen_attention(q, (kq, ks, None, np.zeros((1, 2, 16))), (kq, ks), cu, cu,
                               block_table=table, softcap=3.0)


# ------------------------------------------------------------ the glue's tuples

def test_glue_tuples_keep_refcounts_on_success_and_error_paths(rng):
    """The extension's (int8, scales) tuples: 2000 calls, successful and refused,
    leave every array's reference count as it was."""
    import sys

    from attnx import _attnx
    q = randn(rng, (1, 4, 1, 16))
    k8, ks = quantize_rows(randn(rng, (1, 2, 30, 16)), "k")
    v8, vs = quantize_rows(randn(rng, (1, 2, 30, 16)), "v")
    ks4, vs4 = ks[..., None], vs[..., None]
    out = np.empty((1, 4, 1, 16), np.float32)
    bad_scale = ks4.astype(np.float64)
    calls = [
        (lambda: _attnx.forward(q, (k8, ks4), (v8, vs4), out, None, None, None, None, 2, 0.25), None),
        (lambda: _attnx.forward(q, (k8, bad_scale), (v8, vs4), out, None, None, None, None, 2, 0.25),
         TypeError),
        (lambda: _attnx.forward(q, (k8,), (v8, vs4), out, None, None, None, None, 2, 0.25),
         TypeError),
        (lambda: _attnx.forward(q, (k8, ks4), v8, out, None, None, None, None, 2, 0.25), TypeError),
        (lambda: _attnx.forward(q, (k8, ks4[:, :, :5]), (v8, vs4), out, None, None, None, None, 2,
                                0.25), ValueError),
    ]
    objs = [q, k8, ks, v8, vs, ks4, vs4, out, bad_scale]
    for c, exc in calls:
        if exc is None:
            c()
        else:
            with pytest.raises(exc):
                c()
    before = [sys.getrefcount(o) for o in objs]
    for i in range(2000):
        c, exc = calls[i % len(calls)]
        try:
            c()
        except Exception as e:           # noqa: BLE001  (the refused ones)
            assert exc is not None and isinstance(e, exc)
    assert [sys.getrefcount(o) for o in objs] == before
    want = attnx.reference(q, ks4 * k8.astype(np.float32), vs4 * v8.astype(np.float32),
                           is_causal="lower_right", enable_gqa=True)
    assert_close(out, want)


def test_float64_values_beyond_float32_refused_quickly(rng):
    """A float64 row past float32's range cannot get a float32 scale: refused at
    once (it once looped for seconds and then broke the bound), writing nothing."""
    cache = attnx.KVCache(1, 1, 4, 2, dtype="int8")
    with pytest.raises(ValueError, match="k_new .*beyond float32's range"):
        cache.append(np.array([[[[1e39, 1.0]]]]), np.ones((1, 1, 1, 2)))
    assert cache.lengths.tolist() == [0] and not cache.k_scale.any()
    with pytest.raises(ValueError, match=r"x holds 1e\+39 at \(0, 0\), beyond float32"):
        quantize_rows(np.array([[1e39, 1.0]]), "x")
    top = float(np.finfo(np.float32).max)
    q, scale = quantize_rows(np.array([[top, -top, 1.0]]), "x")      # the largest, exactly
    within_bound(np.array([[top, -top, 1.0]]), scale[..., None] * q.astype(np.float32))


@pytest.mark.parametrize("which", ["k_new", "v_new"])
def test_rows_too_long_once_rotated_refused_writing_nothing(rng, which):
    """A row of float32's largest values has a norm past float32's range: its
    rotated values cannot be stored; refused naming the row, nothing written.
    The same values alone in their rows are stored, within the bound."""
    top = np.finfo(np.float32).max
    cache = attnx.KVCache(1, 2, 8, 16, dtype="int8")
    cache.append(randn(rng, (1, 2, 2, 16)), randn(rng, (1, 2, 2, 16)))
    before = [a.copy() for a in (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lengths)]
    k, v = randn(rng, (1, 2, 3, 16)), randn(rng, (1, 2, 3, 16))
    (k if which == "k_new" else v)[0, 1, 2] = top
    with pytest.raises(ValueError, match=rf"{which}'s row at \(0, 1, 2\) is too large"):
        cache.append(k, v)
    for a, b in zip(before, (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lengths)):
        np.testing.assert_array_equal(a, b)
    k[0, 1, 2] = np.where(np.arange(16) == 5, top, 0.5)
    v[0, 1, 2] = np.where(np.arange(16) == 5, -top, 0.5)
    cache.append(k, v)
    dk, dv = dequantized(cache, 5)
    within_rotated_bound(k, dk[:, :, 2:], cache.k_center)
    within_rotated_bound(v, dv[:, :, 2:])


def test_cache_starting_with_one_token_grows(isa, rng):
    """A cache that starts with one token and grows one at a time: the keys'
    centre is fixed by the append that writes token 0 (here that token alone,
    so its centred row is zero and it is stored exactly) and never moves; every
    row is within the bound and attention is float64's over the rows."""
    cache = attnx.KVCache(1, 2, 70, 64, dtype="int8")
    ks, vs = [], []
    for t in range(70):
        k = randn(rng, (1, 2, 1, 64)) + np.where(np.arange(64) == 9, 30.0, 0.0).astype(np.float32)
        v = randn(rng, (1, 2, 1, 64))
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
        np.testing.assert_array_equal(cache.k_center, ks[0])     # fixed by token 0, kept
        if t in (0, 1, 10, 69):
            q = randn(rng, (1, 4, 1, 64))
            kd, vd = dequantized(cache, t + 1)
            assert_close(cache.attend(q), attnx.reference(q, kd, vd, is_causal="lower_right",
                                                          enable_gqa=True))
    kd, vd = dequantized(cache, 70)
    np.testing.assert_array_equal(kd[:, :, 0], ks[0][:, :, 0])
    within_rotated_bound(np.concatenate(ks, axis=2), kd, cache.k_center)
    within_rotated_bound(np.concatenate(vs, axis=2), vd)
