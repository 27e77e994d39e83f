"""Issue 18: never a silent wrong gradient.

Each finding of the issue has its test here, with random upstream gradients:
the output modified in place before the vjp changes nothing (the vjp keeps a
private copy); inputs modified in place raise RuntimeError naming them (they
are kept by reference, with a fingerprint); a layer's weights updated in place
between its forward and its vjp still give the forward's gradients (copied);
double backward through attnx.torch raises instead of dropping the second-order
term; attnx.torch refuses non-tensors and functorch transforms by name, and
skips the mask's gradient when the mask does not require grad.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import randn


def _qkv(rng, B=2, H=3, L=9, E=8):
    return (randn(rng, (B, H, L, E)) for _ in range(3))


def _same(a, b):
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)


# ----------------------------------------------------------------- the output

def test_output_modified_in_place_changes_nothing(rng):
    q, k, v = _qkv(rng)
    dout = randn(rng, (2, 3, 9, 8))
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    g0 = vjp(dout)
    out += 1.0                               # a residual connection, in place
    out[...] = np.nan
    _same(vjp(dout), g0)


def test_varlen_output_modified_in_place_changes_nothing(rng):
    q, k, v = (randn(rng, (12, 2, 8)) for _ in range(3))
    cu = np.array([0, 5, 12])
    out, vjp = attnx.varlen_attention_vjp(q, k, v, cu, cu, is_causal=True)
    dout = randn(rng, out.shape)
    g0 = vjp(dout)
    out += 1.0
    _same(vjp(dout), g0)


# ----------------------------------------------------------------- the inputs

@pytest.mark.parametrize("which", ["query", "key", "value", "attn_mask"])
def test_inputs_modified_in_place_raise_naming_them(rng, which):
    q, k, v = _qkv(rng)
    args = {"query": q, "key": k, "value": v, "attn_mask": randn(rng, (9, 9))}
    out, vjp = attnx.scaled_dot_product_attention_vjp(**args)
    dout = randn(rng, out.shape)
    g0 = vjp(dout)
    saved = args[which].copy()
    args[which][0, ..., 1] += 1.0                       # one element's change is enough
    with pytest.raises(RuntimeError, match=f"{which} was modified in place.*"
                                           "scaled_dot_product_attention_vjp"):
        vjp(dout)
    args[which][...] = saved                            # restored: the same gradients
    _same(vjp(dout), g0)


def test_small_arguments_are_copied(rng):
    """Lengths, sinks and slopes are copied by the forward: changing the caller's
    afterwards changes nothing."""
    q, k, v = _qkv(rng)
    kl, sinks, slopes = np.array([9, 4]), np.array([0.5, 1.0, -1.0]), np.array([0.1, 0.2, 0.3])
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, key_lengths=kl, sinks=sinks,
                                                      alibi_slopes=slopes)
    dout = randn(rng, out.shape)
    g0 = vjp(dout)
    kl[:] = 1
    sinks[:] = 5.0
    slopes[:] = 0.0
    _same(vjp(dout), g0)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_varlen_inputs_modified_in_place_raise(rng, which):
    arrays = {n: randn(rng, (12, 2, 8)) for n in ("query", "key", "value")}
    cu = np.array([0, 5, 12])
    out, vjp = attnx.varlen_attention_vjp(arrays["query"], arrays["key"], arrays["value"], cu, cu)
    arrays[which][3] *= 2.0
    with pytest.raises(RuntimeError, match=f"{which} was modified in place.*varlen"):
        vjp(randn(rng, out.shape))


def test_torch_tensor_inputs_are_fingerprinted_too(rng):
    """A CPU tensor given to the NumPy API is read in place: its changes are seen."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(a) for a in _qkv(rng))
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v)
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="key was modified in place"):
        vjp(randn(rng, out.shape))


# -------------------------------------------------------- MultiHeadAttention

def test_mha_weights_updated_before_the_vjp_give_the_forwards_gradients(rng):
    """The issue's case: an optimiser applies the previous step's update in place
    between this step's forward and its vjp. The gradients stay those of the
    forward's weights (they were 3.5 off in dW_q)."""
    mha = attnx.MultiHeadAttention(16, 2, seed=0)
    x = randn(rng, (2, 5, 16))
    dout = randn(rng, (2, 5, 16))
    out, vjp = mha.vjp(x, is_causal=True)
    want = vjp(dout)
    out2, vjp2 = mha.vjp(x, is_causal=True)
    for name, p in mha.parameters().items():
        p -= 0.5 * want[name]                    # the weights change in place
    got = vjp2(dout)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_mha_input_modified_in_place_raises(rng):
    mha = attnx.MultiHeadAttention(16, 2, seed=0)
    x, y = randn(rng, (2, 5, 16)), randn(rng, (2, 7, 16))
    out, vjp = mha.vjp(x, y)
    y += 1.0
    with pytest.raises(RuntimeError, match="key was modified in place.*MultiHeadAttention.vjp"):
        vjp(randn(rng, out.shape))


def test_mha_output_modified_in_place_changes_nothing(rng):
    mha = attnx.MultiHeadAttention(16, 2, seed=0)
    x = randn(rng, (2, 5, 16))
    dout = randn(rng, (2, 5, 16))
    out, vjp = mha.vjp(x)
    want = vjp(dout)
    out += x
    got = vjp(dout)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# --------------------------------------------------------------- attnx.torch

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("how", ["hvp", "hvp_allow_unused", "penalty", "through_weights"])
def test_double_backward_raises(torch, dtype, how):
    """The issue's HVP was off by 3.0 where it is ~17: now every second derivative
    through attnx.torch raises, whatever the upstream gradient requires."""
    import attnx.torch as at
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, generator=g, dtype=dt, requires_grad=True)
    w = torch.randn(8, 8, generator=g, dtype=dt, requires_grad=True)
    out = at.scaled_dot_product_attention(x @ w, x, x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    v = torch.randn(gx.shape, generator=g, dtype=dt)
    with pytest.raises(RuntimeError, match="differentiable once"):
        if how == "hvp":
            torch.autograd.grad((gx * v).sum(), x)
        elif how == "hvp_allow_unused":
            torch.autograd.grad((gx * v).sum(), x, allow_unused=True)
        elif how == "penalty":                       # a gradient penalty added to the loss
            (out.sum() + (gx ** 2).sum()).backward()
        else:
            torch.autograd.grad((gx * v).sum(), w)


def test_first_order_under_create_graph_is_unchanged(torch):
    import attnx.torch as at
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    (plain,) = torch.autograd.grad(at.scaled_dot_product_attention(x, x, x), x, dout)
    (graph,) = torch.autograd.grad(at.scaled_dot_product_attention(x, x, x), x, dout,
                                   create_graph=True)
    assert torch.equal(plain, graph.detach())
    (want,) = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(x, x, x),
                                  x, dout)
    torch.testing.assert_close(plain, want, atol=1.25e-5, rtol=5.25e-6)   # attnx: float32


@pytest.mark.parametrize("which", ["query", "key", "value", "attn_mask", "sinks"])
def test_non_tensors_are_refused_by_name(torch, which):
    import attnx.torch as at
    t = torch.randn(1, 2, 5, 8)
    args = dict(query=t, key=t, value=t)
    args[which] = np.zeros((1, 2, 5, 8), np.float32) if which in args else np.zeros(2)
    with pytest.raises(TypeError, match=f"{which} must be a torch.Tensor; got ndarray"):
        at.scaled_dot_product_attention(**args)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_functorch_transforms_are_refused(torch, transform):
    import attnx.torch as at
    x = torch.randn(3, 1, 2, 5, 8)
    f = {"vmap": lambda: torch.func.vmap(lambda a: at.scaled_dot_product_attention(a, a, a))(x),
         "grad": lambda: torch.func.grad(lambda a: at.scaled_dot_product_attention(a, a, a).sum())(x[0]),
         "jacrev": lambda: torch.func.jacrev(lambda a: at.scaled_dot_product_attention(a, a, a))(x[0])}
    with pytest.raises(RuntimeError, match="does not support functorch transforms"):
        f[transform]()


@pytest.mark.parametrize("mask_requires_grad", [False, True])
def test_torch_skips_the_mask_gradient_when_not_required(torch, monkeypatch, mask_requires_grad):
    import attnx.torch as at
    seen = []
    original = at._sdpa_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["mask_grad"])
        return original(*args, **kwargs)
    monkeypatch.setattr(at, "_sdpa_backward", spy)
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    mask = torch.randn(5, 5, requires_grad=mask_requires_grad)
    at.scaled_dot_product_attention(x, x, x, attn_mask=mask).sum().backward()
    assert seen == [mask_requires_grad]
    assert (mask.grad is not None) == mask_requires_grad


# ---------------------------------------------------- merge_attention's sinks

@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("sinks_shape", ["per_head", "per_batch_head", "scalar"])
def test_merge_attention_joins_the_sinks_once(rng, layout, sinks_shape):
    """Parts computed without sinks, merged with sinks=, give the whole call with
    sinks (they were 0.17 off when each part was computed with them); a row
    with no key anywhere stays zeros and -inf."""
    B, H, Lq, Lk, E = 2, 3, 5, 11, 8
    q, k, v = randn(rng, (B, H, Lq, E)), randn(rng, (B, H, Lk, E)), randn(rng, (B, H, Lk, E))
    if layout == "blhd":
        q, k, v = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    sinks = {"per_head": randn(rng, (H,)), "per_batch_head": randn(rng, (B, H)),
             "scalar": np.float32(0.7)}[sinks_shape]
    kl = np.array([Lk, 0])                                # batch 1: no key at all
    kw = dict(layout=layout)
    whole, lse_whole = attnx.scaled_dot_product_attention(q, k, v, sinks=sinks, key_lengths=kl,
                                                          return_lse=True, **kw)
    cut = [0, 4, 4, 11]                                   # an empty part too
    parts = []
    for a, b in zip(cut, cut[1:]):
        sl = (slice(None), slice(a, b)) if layout == "blhd" else (slice(None), slice(None), slice(a, b))
        parts.append(attnx.scaled_dot_product_attention(
            q, k[sl], v[sl], key_lengths=np.clip(kl - a, 0, b - a), return_lse=True, **kw))
    out, lse = attnx.merge_attention([p[0] for p in parts], [p[1] for p in parts], sinks=sinks,
                                     **kw)
    ref = attnx.reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                          sinks=sinks, key_lengths=kl, **kw)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(out, whole, atol=2e-6, rtol=1e-5)
    finite = np.isfinite(lse_whole)
    assert np.array_equal(np.isfinite(lse), finite) and not finite[1].any()
    np.testing.assert_allclose(lse[finite], lse_whole[finite], atol=2e-6, rtol=1e-6)
    assert not out[1].any()


def test_merge_attention_sinks_errors(rng):
    o, l = attnx.scaled_dot_product_attention(*_qkv(rng), return_lse=True)
    with pytest.raises(ValueError, match="sinks with shape \\(4,\\) does not broadcast"):
        attnx.merge_attention([o], [l], sinks=np.zeros(4))
    with pytest.raises(ValueError, match="sinks must be finite"):
        attnx.merge_attention([o], [l], sinks=[0.0, np.nan, 1.0])


# --------------------------------------------------------------------- edges

def test_tiny_softcap_is_finite_or_refused(rng):
    """softcap=1e-40 was accepted, and its float32 reciprocal is inf: NaN rows where
    a score is 0 and NaN gradients. It is refused now, by attnx and the reference
    alike; the smallest softcap with a finite reciprocal gives finite results."""
    q, k, v = _qkv(rng)
    q[0, 0, 0] = 0.0                                      # a row of zero scores
    for f in (attnx.scaled_dot_product_attention, attnx.reference):
        with pytest.raises(ValueError, match="softcap must be > 0 and finite in float32, "
                                             "with a finite reciprocal.*got 1e-40"):
            f(q, k, v, softcap=1e-40)
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, softcap=3e-39)
    g = vjp(randn(rng, out.shape))
    assert np.isfinite(out).all() and all(np.isfinite(getattr(g, n)).all()
                                          for n in ("query", "key", "value"))
    np.testing.assert_allclose(out, attnx.reference(q, k, v, softcap=3e-39), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("align", ["upper_left", "lower_right"])
def test_alibi_slopes_whose_bias_overflows_are_refused(rng, align):
    """Slopes of -1e38 over 32 keys: the float32 bias overflowed (NaN where the
    float64 reference is finite). Refused by name; the largest allowed slope for
    the lengths gives finite results equal to the reference."""
    q, k, v = randn(rng, (1, 2, 4, 8)), randn(rng, (1, 2, 32, 8)), randn(rng, (1, 2, 32, 8))
    for f in (attnx.scaled_dot_product_attention, attnx.reference):
        with pytest.raises(ValueError, match="alibi_slopes: a slope of magnitude 1e\\+38 over "
                                             "distances up to 31"):
            f(q, k, v, alibi_slopes=[-1e38, 0.5], alignment=align)
    ok = np.float32(np.finfo(np.float32).max / 2 / 31 * 0.99)
    out = attnx.scaled_dot_product_attention(q, k, v, alibi_slopes=[-ok, ok], alignment=align)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, attnx.reference(q, k, v, alibi_slopes=[-ok, ok],
                                                    alignment=align), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------- errors

@pytest.mark.parametrize("call, error, message", [
    (lambda q: attnx.scaled_dot_product_attention(q, q, q, window=(2 ** 63, 0)), ValueError,
     r"window sides must be at most 2\*\*62.*window=\(9223372036854775808, 0\)"),
    (lambda q: attnx.scaled_dot_product_attention(q, q, q, softcap=10 ** 400), ValueError,
     r"softcap must be > 0 and finite.*got 1000"),
    (lambda q: attnx.unpack(np.ones((3, 2)), [0, 3], max_len=6.7), TypeError,
     "max_len must be a non-negative integer; got float 6.7"),
    (lambda q: attnx.unpack(np.ones((3, 2)), [0, 3], max_len="9"), TypeError,
     "max_len must be a non-negative integer; got str '9'"),
    (lambda q: attnx.KVCache(1, 1, 4, 4, dtype=None), TypeError,
     "dtype must be float32, float16, bfloat16 or int8; got None"),
    (lambda q: attnx.varlen_attention(q[0, 0, :3, None], q[0, 0, :3, None], q[0, 0, :3, None],
                                      np.array([0, 2 ** 64 - 1, 3], np.uint64), [0, 1, 3]),
     ValueError, "cu_seqlens_q holds 18446744073709551615"),
])
def test_errors_name_the_argument_and_the_value(rng, call, error, message):
    with pytest.raises(error, match=message):
        call(randn(rng, (1, 2, 4, 8)))


def test_torch_numpy_array_argument_says_what_to_use(torch):
    import attnx.torch as at
    with pytest.raises(TypeError, match="query must be a torch.Tensor; got ndarray.*"
                                        "attnx.scaled_dot_product_attention"):
        at.scaled_dot_product_attention(np.zeros((1, 2, 5, 8), np.float32), torch.ones(1), None)


def test_dask_unknown_chunk_sizes(rng):
    da = pytest.importorskip("dask.array")
    import attnx.dask as ad
    x = da.from_array(randn(rng, (4, 2, 8, 16)), chunks=(2, 2, 8, 16))
    y = x[x[:, 0, 0, 0] > 0]
    with pytest.raises(ValueError, match=r"query has unknown chunk sizes.*"
                                         r"query.compute_chunk_sizes\(\)"):
        ad.scaled_dot_product_attention(y, y, y)


def test_varlen_checks_alibi_range_per_sequence(rng):
    """The ALiBi range follows each sequence's own lengths, not the packed totals:
    slopes fine for two 40-token sequences (80 tokens packed) are accepted, and
    refused for a sequence long enough to overflow."""
    q, k, v = (randn(rng, (80, 2, 8)) for _ in range(3))
    slope = np.float32(np.finfo(np.float32).max / 2 / 60)    # fine up to 61 tokens
    cu = np.array([0, 40, 80])
    out = attnx.varlen_attention(q, k, v, cu, cu, alibi_slopes=[slope, 0.0])
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="alibi_slopes: a slope of magnitude"):
        attnx.varlen_attention(q, k, v, np.array([0, 80]), np.array([0, 80]),
                               alibi_slopes=[slope, 0.0])
