"""attnx.torch's lean path: the calls models make while generating (no mask, no
variant, no gradient) skip the general argument handling. They must give what
the checked path gives, bit for bit, and anything the lean path does not take
must reach the checked path (its results, its errors)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import randn

torch = pytest.importorskip("torch")
import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the calls that took the lean path (plain_forward gave a result)."""
    calls = []
    original = at.plain_forward

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(at, "plain_forward", counting)
    return calls


def checked(q, k, v, **kw):
    """The same call through the general path (a zero float mask is not lean)."""
    zero = torch.zeros(q.shape[-2], k.shape[-2], dtype=torch.float32)
    return at.scaled_dot_product_attention(q, k, v, attn_mask=zero, **kw)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,Lq,Lk,causal", [((4, 4), 1, 300, False), ((6, 2), 1, 300, False),
                                                ((6, 3), 37, 37, True), ((4, 2), 5, 70, True)])
def test_lean_path_matches_the_checked_path(rng, isa, lean_calls, kv_dtype, q_dtype, heads, Lq,
                                            Lk, causal):
    Hq, Hk = heads
    q = torch.from_numpy(randn(rng, (2, Hq, Lq, 32))).to(q_dtype)
    k, v = (torch.from_numpy(randn(rng, (2, Hk, Lk, 32))).to(kv_dtype) for _ in range(2))
    kw = dict(is_causal=causal, enable_gqa=Hq != Hk, scale=0.3)
    with torch.no_grad():
        got = at.scaled_dot_product_attention(q, k, v, **kw)
    assert lean_calls == [True]
    want = checked(q, k, v, **kw)
    assert got.dtype == q_dtype and got.shape == (2, Hq, Lq, 32)
    assert torch.equal(got, want)
    ref = attnx.reference(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                          is_causal=causal, enable_gqa=Hq != Hk, scale=0.3)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.float().numpy(), ref, atol=tol, rtol=tol)


def test_lean_path_on_strided_views(rng, lean_calls):
    """Views (a cache's first keys, heads picked out of a wider tensor) are read in place."""
    big = torch.from_numpy(randn(rng, (2, 8, 100, 48)))
    q, k, v = big[:, :4, :1, :32], big[:, 4:6, :60, :32], big[:, 6:, :60, 16:]
    with torch.no_grad():
        got = at.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert lean_calls == [True]
    assert torch.equal(got, checked(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("case", ["float16 query", "float64", "gqa not enabled", "3-D",
                                  "negative view", "causal as a string", "integer scale"])
def test_what_the_lean_path_does_not_take_reaches_the_checked_path(rng, lean_calls, case):
    q, k, v = (torch.from_numpy(randn(rng, (1, 4, 9, 16))) for _ in range(3))
    kw = {}
    if case == "float16 query":
        q = q.half()
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "gqa not enabled":
        k, v = k[:, :2], v[:, :2]
        with torch.no_grad(), pytest.raises(ValueError, match="enable_gqa"):
            at.scaled_dot_product_attention(q, k, v)
        assert not any(lean_calls)
        return
    elif case == "3-D":
        q, k, v = q[0], k[0], v[0]
    elif case == "negative view":
        k = torch._neg_view(-k)
    elif case == "causal as a string":
        kw["is_causal"] = "lower_right"
    elif case == "integer scale":
        kw["scale"] = 1
    with torch.no_grad():
        got = at.scaled_dot_product_attention(q, k, v, **kw)
    assert not any(lean_calls)
    want = attnx.scaled_dot_product_attention(*(t.float().resolve_neg().numpy() for t in (q, k, v)),
                                              **kw)
    np.testing.assert_allclose(got.float().numpy(), want, atol=1e-3 if case == "float16 query"
                               else 1e-6, rtol=1e-3)
    assert got.dtype == q.dtype


def test_lean_path_not_taken_with_gradients(rng, lean_calls):
    q = torch.from_numpy(randn(rng, (1, 2, 5, 8))).requires_grad_()
    out = at.scaled_dot_product_attention(q, q, q)
    out.sum().backward()
    assert not any(lean_calls) and q.grad is not None
