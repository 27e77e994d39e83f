"""Window, sinks, softcap and ALiBi (and their combinations) against an
independent float64 oracle written here, forward and gradients, on every ISA;
the oracle itself against torch's float64 autograd; attnx.reference against
the oracle; argument errors."""

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import LOW_FLOATS, randn

ISAS = list(_attnx.available_isas())


def oracle(q, k, v, *, scale=None, causal=False, window=None, align=None, softcap=None,
           alibi=None, sinks=None, key_lengths=None):
    """Seed-style float64 attention with the variants: (out, weights). q (B, H, Lq, E)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, Lq, E = q.shape
    Lk = k.shape[2]
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(E) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    d = np.arange(Lq)[:, None] + (Lk - Lq if "lower_right" in (causal, align) else 0)
    j = np.arange(Lk)[None, :]
    if alibi is not None:
        s = s - np.asarray(alibi, np.float64).reshape(1, H, 1, 1) * np.abs(d - j)
    ok = np.ones((B, H, Lq, Lk), bool)
    if causal:
        ok &= j <= d
    if window is not None:
        left, right = (-1 if x is None else x for x in window)
        if left >= 0:
            ok &= j >= d - left
        if right >= 0:
            ok &= j <= d + right
    if key_lengths is not None:
        ok &= j[None, None] < np.asarray(key_lengths).reshape(B, 1, 1, 1)
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    sk = None if sinks is None else np.asarray(sinks, np.float64).reshape(1, H, 1, 1)
    if sk is not None:
        m = np.maximum(m, sk)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    if sk is not None:
        den = np.where(den > 0, den + np.exp(sk - m), 0.0)
    w = np.where(den > 0, p / np.where(den > 0, den, 1.0), 0.0)
    return w @ v, w


CASES = {
    "window": dict(window=(5, 3)),
    "window_causal": dict(window=(9, 0), causal=True),
    "window_left_open_lower_right": dict(window=(None, 4), align="lower_right"),
    "window_empty_rows": dict(window=(0, 0), key_lengths=[11, 40]),
    "softcap": dict(softcap=1.5),
    "alibi_lower_right": dict(alibi=[0.5, 0.25, 0.125], causal="lower_right"),
    "sinks": dict(sinks=[0.3, -1.0, 4.0]),
    "sinks_causal": dict(sinks=[2.0, 0.0, -2.0], causal=True),
    "all": dict(softcap=2.0, alibi=[0.5, 0.25, 0.1], sinks=[0.3, -1.0, 5.0], window=(30, 2),
                causal="lower_right"),
}


def kwargs(c):
    return dict(window=c.get("window"), softcap=c.get("softcap"), alibi_slopes=c.get("alibi"),
                sinks=c.get("sinks"), is_causal=c.get("causal", False), alignment=c.get("align"),
                key_lengths=c.get("key_lengths"))


@pytest.fixture(params=ISAS)
def isa(request):
    before = _attnx.isa()
    _attnx.set_isa(request.param)
    yield request.param
    _attnx.set_isa(before)


def problem(rng, Lq=21, Lk=70, E=12):
    q, k, v = (randn(rng, (2, 3, L, E)) for L in (Lq, Lk, Lk))
    return q, k, v, randn(rng, (2, 3, Lq, E))


@pytest.mark.parametrize("name", CASES)
def test_forward_and_weights_match_oracle(rng, isa, name):
    c = CASES[name]
    q, k, v, _ = problem(rng)
    want, w_want = oracle(q, k, v, **c)
    out, w, lse = attnx.scaled_dot_product_attention(q, k, v, need_weights=True, return_lse=True,
                                                     **kwargs(c))
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(w, w_want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(attnx.scaled_dot_product_attention(q, k, v, **kwargs(c)), want,
                               atol=2e-6, rtol=1e-5)
    assert lse.shape == (2, 3, 21)


@pytest.mark.parametrize("name", CASES)
def test_decode_split_keys(rng, isa, name):
    """One query against many keys takes the split-K path; sinks fold in at the merge."""
    c = CASES[name]
    q, k, v, _ = problem(rng, Lq=1, Lk=1500, E=8)
    want, _ = oracle(q, k, v, **c)
    out = attnx.scaled_dot_product_attention(q, k, v, **kwargs(c))
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_oracle(rng, name):
    c = CASES[name]
    q, k, v, _ = problem(rng)
    np.testing.assert_allclose(attnx.reference(q, k, v, **kwargs(c)), oracle(q, k, v, **c)[0],
                               atol=1e-12, rtol=1e-10)


def torch_grads(q, k, v, dout, c):
    """Gradients of the oracle's math in torch float64 autograd (sinks as an extra key
    column with a zero value)."""
    torch = pytest.importorskip("torch")
    T = [torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in (q, k, v)]
    B, H, Lq, E = q.shape
    Lk = k.shape[2]
    s = T[0] @ T[1].transpose(-1, -2) / np.sqrt(E)
    if c.get("softcap"):
        s = c["softcap"] * torch.tanh(s / c["softcap"])
    _, w = oracle(q, k, v, **c)                      # only for the allowed pattern
    d = torch.arange(Lq)[:, None] + (Lk - Lq if "lower_right" in (c.get("causal"), c.get("align")) else 0)
    if c.get("alibi") is not None:
        s = s - torch.tensor(c["alibi"], dtype=torch.float64).reshape(1, H, 1, 1) * (d - torch.arange(Lk)).abs()
    allowed = torch.from_numpy(oracle(q, k, v, **{**c, "sinks": None, "softcap": None, "alibi": None})[1] > 0)
    s = s.masked_fill(~allowed, -float("inf"))
    sk = None
    vv = T[2]
    if c.get("sinks") is not None:
        sk = torch.tensor(c["sinks"], dtype=torch.float64, requires_grad=True)
        s = torch.cat([s, sk.reshape(1, H, 1, 1).expand(B, H, Lq, 1)], -1)
        vv = torch.cat([vv, torch.zeros(B, H, 1, v.shape[-1], dtype=torch.float64)], -2)
    p = torch.nan_to_num(torch.softmax(s, -1))
    empty = ~allowed.any(-1, keepdim=True)
    p = p.masked_fill(empty, 0.0)
    (p @ vv).backward(torch.from_numpy(np.asarray(dout, np.float64)))
    return [t.grad.numpy() for t in T] + ([sk.grad.numpy()] if sk is not None else [])


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_torch_autograd(rng, isa, name):
    c = CASES[name]
    q, k, v, dout = problem(rng)
    want = torch_grads(q, k, v, dout, c)
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kwargs(c))
    g = vjp(dout)
    got = [g.query, g.key, g.value] + ([g.sinks] if c.get("sinks") is not None else [])
    assert (g.sinks is None) == (c.get("sinks") is None)
    for a, b, what in zip(got, want, ["query", "key", "value", "sinks"]):
        np.testing.assert_allclose(a, b, atol=1.25e-5, rtol=5.25e-6, err_msg=what)
    ref = attnx.reference_backward(dout, q, k, v, **kwargs(c))
    for a, b in zip(ref, want):
        if a is not None:
            np.testing.assert_allclose(a, b, atol=1e-10, rtol=1e-9)


def test_sinks_broadcast_gradient_is_summed(rng):
    q, k, v, dout = problem(rng)
    per_batch = np.array([[0.5, 1.0, -1.0], [0.5, 1.0, -1.0]], np.float32)
    g1 = attnx.scaled_dot_product_attention_vjp(q, k, v, sinks=per_batch[0])[1](dout)
    g2 = attnx.scaled_dot_product_attention_vjp(q, k, v, sinks=per_batch)[1](dout)
    assert g1.sinks.shape == (3,) and g2.sinks.shape == (2, 3)
    np.testing.assert_allclose(g2.sinks.sum(0), g1.sinks, rtol=1e-5, atol=1e-7)


def test_window_equals_explicit_mask(rng, isa):
    q, k, v, _ = problem(rng)
    i, j = np.arange(21)[:, None], np.arange(70)[None, :]
    mask = (j >= i - 4) & (j <= i + 6)
    np.testing.assert_allclose(attnx.scaled_dot_product_attention(q, k, v, window=(4, 6)),
                               attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               atol=1e-6)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(window=(1, 2, 3)), TypeError, "window"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=(1.5, 0)), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(sinks=np.zeros(4)), ValueError, "sinks"),
    (dict(alibi_slopes=np.zeros((5, 3))), ValueError, "alibi_slopes"),
    (dict(sinks=[np.inf, 0, 0]), ValueError, "sinks"),
    (dict(alignment="middle"), ValueError, "alignment"),
    (dict(alignment="lower_right", is_causal=True), ValueError, "alignment"),
])
def test_errors_name_the_argument(rng, kw, exc, words):
    q, k, v, _ = problem(rng)
    with pytest.raises(exc, match=words):
        attnx.scaled_dot_product_attention(q, k, v, **kw)


# ------------------------------------------------------------ float16 keys and values

@pytest.mark.parametrize("dtype", LOW_FLOATS)
@pytest.mark.parametrize("Lq", [1, 3, 70])     # decoding (rows of queries) and whole tiles
def test_half_keys_and_values_give_the_float32_bits(rng, isa, Lq, dtype):
    """float16 and bfloat16 K/V are read as such (converted exactly, in registers
    or tile by tile): the result is the float32 computation on the same values,
    bit for bit."""
    q = randn(rng, (2, 4, Lq, 40))
    k = randn(rng, (2, 2, 600, 40)).astype(dtype)
    v = randn(rng, (2, 2, 600, 24)).astype(dtype)
    kw = dict(enable_gqa=True, is_causal="lower_right", sinks=[0.0, 1.0, 2.0, 3.0], window=(100, 0))
    got = attnx.scaled_dot_product_attention(q, k, v, **kw)
    want = attnx.scaled_dot_product_attention(q, k.astype(np.float32), v.astype(np.float32), **kw)
    np.testing.assert_array_equal(got, want)


def test_half_cache_is_not_copied_to_float32():
    import tracemalloc
    cache = attnx.KVCache(1, 8, 4096, 64, dtype=np.float16)
    rng = np.random.default_rng(0)
    new = rng.standard_normal((1, 8, 4096, 64)).astype(np.float16)
    cache.append(new, new)
    q = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)
    cache.attend(q)
    tracemalloc.start()
    out = cache.attend(q)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < cache.k.nbytes // 4, f"attend allocated {peak} bytes (K is {cache.k.nbytes})"
    want = attnx.reference(q, cache.k.astype(np.float32), cache.v.astype(np.float32),
                           is_causal="lower_right")
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)


def test_multihead_attention_takes_the_variants(rng):
    """The layer passes the variants on: its output equals the attention of its own
    projections with them, and the sinks' gradient matches central differences."""
    mha = attnx.MultiHeadAttention(20, 4, seed=0)
    x = randn(rng, (2, 9, 20))
    kw = dict(window=(2, 1), softcap=5.0, alibi_slopes=[0.5, 0.25, 0.1, 0.0])
    sinks = np.array([0.0, 1.0, 2.0, 3.0])
    heads = [(x @ W + b).reshape(2, 9, 4, 5) for W, b in ((mha.W_q, mha.b_q), (mha.W_k, mha.b_k),
                                                        (mha.W_v, mha.b_v))]
    z = attnx.reference(*heads, layout="blhd", sinks=sinks, **kw)
    want = z.reshape(2, 9, 20) @ mha.W_o + mha.b_o
    np.testing.assert_allclose(mha(x, sinks=sinks, **kw), want, atol=2e-5, rtol=1e-5)
    out, vjp = mha.vjp(x, sinks=sinks, **kw)
    dout = randn(rng, out.shape)
    g = vjp(dout)
    eps = 1e-3
    for h in range(4):
        up, down = sinks.copy(), sinks.copy()
        up[h] += eps
        down[h] -= eps
        num = ((attnx.reference(*heads, layout="blhd", sinks=up, **kw)
                - attnx.reference(*heads, layout="blhd", sinks=down, **kw)).reshape(2, 9, 20)
               @ mha.W_o * dout).sum() / (2 * eps)
        assert abs(g["sinks"][h] - num) <= 1e-4 * max(1.0, abs(num)), (h, g["sinks"][h], num)


# ------------------------------------------------- grouped-query decoding, folded

def _gqa_decoding_cases():
    """Calls the core folds (each group's query heads as the rows of its key/value
    head) and calls it must not fold (each head alone)."""
    rng = np.random.default_rng(5)
    pad = np.ones((2, 1, 1, 1000), bool)
    pad[1, ..., 700:] = False
    per_head = rng.standard_normal((2, 8, 1, 1000)).astype(np.float32)
    return [{}, {"is_causal": "lower_right"}, {"key_lengths": [900, 300]},
            {"layout": "blhd"}, {"softcap": 3.0}, {"return_lse": True}, {"need_weights": True},
            {"attn_mask": pad}, {"attn_mask": np.where(pad, 0.0, -np.inf).astype(np.float32)},
            {"attn_mask": per_head},                        # per query head: strides fold it
            {"is_causal": True}, {"window": (100, 0), "alignment": "lower_right"},
            {"query_lengths": [1, 0]}]


@pytest.mark.parametrize("kw", _gqa_decoding_cases())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gqa_decoding_folded_per_group_matches(rng, isa, kw, dtype):
    """One query per head, 4 query heads per key/value head: the core computes each
    group as the rows of one problem (each key read once). The same numbers as
    each query head computed alone, against a copy of its key/value head (on one
    thread, so that neither call splits its keys, the same bits where the group
    fits the row kernels: 4 rows on every x86 ISA), and as the float64 reference."""
    attnx.set_num_threads(1)
    try:
        _check_gqa_decoding(rng, isa, kw, dtype)
    finally:
        attnx.set_num_threads(0)
    attnx.set_num_threads(2)            # split across threads: within float32's rounding
    try:
        _check_gqa_decoding(rng, isa, kw, dtype, exact=False)
    finally:
        attnx.set_num_threads(0)


def _check_gqa_decoding(rng, isa, kw, dtype, exact=True):
    q = randn(rng, (2, 8, 1, 32))
    k, v = (randn(rng, (2, 2, 1000, 32)).astype(dtype) for _ in range(2))
    if kw.get("layout") == "blhd":
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
    got = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    axis = 2 if kw.get("layout") == "blhd" else 1
    kr, vr = np.repeat(k, 4, axis=axis), np.repeat(v, 4, axis=axis)  # no group left to fold
    alone = attnx.scaled_dot_product_attention(q, kr, vr, **kw)
    extra = kw.get("return_lse") or kw.get("need_weights")
    for g, a in zip(got, alone) if extra else [(got, alone)]:
        if exact and isa != "neon":
            np.testing.assert_array_equal(g, a)
        else:
            np.testing.assert_allclose(g, a, atol=1e-6, rtol=1e-5)
    got = got[0] if extra else got
    ref_kw = {n: x for n, x in kw.items() if n not in ("return_lse", "need_weights")}
    ref = attnx.reference(q, k.astype(np.float32), v.astype(np.float32), enable_gqa=True, **ref_kw)
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)


def test_gqa_decoding_with_no_query_heads():
    """A fuzz finding: zero query heads over three key/value heads (0 is a multiple
    of 3) with key lengths crashed the grouped decoding; it is a plain empty result."""
    q = np.zeros((4, 0, 1, 0), np.float32)
    k = v = np.zeros((4, 3, 3, 0), np.float32)
    out = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal="lower_right",
                                             key_lengths=np.array([0, 1, 2, 3], np.int32))
    assert out.shape == (4, 0, 1, 0)
