"""attnx against torch.nn.functional.scaled_dot_product_attention (CPU).

Both are compared with the float64 reference at the project's bar
(atol=1e-5, rtol=5e-6). PyTorch in float64 is a second exact oracle: attnx
must meet the bar against it too. PyTorch in float32 is a peer with its own
rounding error: two results that are each within the bar of the exact value
can differ by twice the bar, so attnx and torch-float32 are compared at
atol=2e-5, rtol=1e-5 (that is the bar, applied to both; not a looser one).

Fully masked rows: attnx gives zeros (output and weights), by design. PyTorch
gave NaN for such rows in older releases; 2.5+ on CPU gives zeros too.
``test_fully_masked_rows`` checks attnx gives zeros and accepts either
behaviour from torch, comparing only the rows where the two agree by design.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attnx  # noqa: E402
from conftest import assert_close, make_qkv, random_bool_mask, random_float_mask  # noqa: E402

sdpa = attnx.scaled_dot_product_attention
PEER_ATOL, PEER_RTOL = 2e-5, 1e-5


def torch_sdpa(q, k, v, dtype, **kw):
    """F.scaled_dot_product_attention on NumPy inputs, computed in ``dtype``."""
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    tq, tk, tv = (t(a).to(dtype) for a in (q, k, v))
    mask = kw.pop("attn_mask", None)
    if mask is not None and not isinstance(mask, np.ndarray):
        kw["attn_mask"] = mask                         # e.g. a torch CausalBias
    elif mask is not None:
        tm = t(mask)
        kw["attn_mask"] = tm if tm.dtype == torch.bool else tm.to(dtype)
    with torch.no_grad():
        return F.scaled_dot_product_attention(tq, tk, tv, **kw).numpy()


def compare(q, k, v, attnx_kw=None, torch_kw=None):
    """attnx vs reference (bar), vs torch float64 (bar), vs torch float32 (peer)."""
    attnx_kw = dict(attnx_kw or {})
    torch_kw = dict(torch_kw if torch_kw is not None else attnx_kw)
    got = sdpa(q, k, v, **attnx_kw)
    assert_close(got, attnx.reference(q, k, v, **attnx_kw), err_msg="vs reference")
    t64 = torch_sdpa(q, k, v, torch.float64, **dict(torch_kw))
    assert_close(got, t64, err_msg="vs torch float64")
    t32 = torch_sdpa(q, k, v, torch.float32, **dict(torch_kw))
    assert t32.dtype == np.float32
    assert_close(got, t32, atol=PEER_ATOL, rtol=PEER_RTOL, err_msg="vs torch float32")
    # torch float32 itself against the reference: the peer meets the bar too
    assert_close(t32, attnx.reference(q, k, v, **attnx_kw), err_msg="torch float32 vs reference")
    return got


@pytest.mark.parametrize("shape", [(5, 16), (3, 5, 16), (2, 3, 5, 16), (2, 2, 3, 9, 33)], ids=str)
def test_plain(isa, rng, shape):
    q = rng.standard_normal(shape).astype(np.float32)
    kshape = shape[:-2] + (shape[-2] + 4, shape[-1])
    k = rng.standard_normal(kshape).astype(np.float32)
    v = rng.standard_normal(kshape[:-1] + (7,)).astype(np.float32)
    compare(q, k, v)


@pytest.mark.parametrize("mshape", [(1, 9), (5, 9), (2, 1, 5, 9), (2, 3, 1, 9), (3, 5, 9)], ids=str)
def test_bool_mask(isa, rng, mshape):
    # the same convention in both: True = may attend
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=9, E=16)
    mask = random_bool_mask(rng, mshape, p=0.6)
    mask[..., 0] = True                         # keep every row alive (see fully masked)
    compare(q, k, v, dict(attn_mask=mask))


@pytest.mark.parametrize("mshape", [(1, 9), (5, 9), (2, 1, 5, 9), (2, 3, 5, 9)], ids=str)
def test_float_mask(isa, rng, mshape):
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=9, E=16)
    mask = random_float_mask(rng, mshape, p_inf=0.3)
    mask[..., 0] = 0.5
    compare(q, k, v, dict(attn_mask=mask))


@pytest.mark.parametrize("lq_lk", [(7, 7), (4, 9), (16, 16), (33, 33)], ids=str)
def test_is_causal(isa, rng, lq_lk):
    Lq, Lk = lq_lk
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=Lq, Lk=Lk, E=32)
    compare(q, k, v, dict(is_causal=True))


@pytest.mark.parametrize("lq_lk", [(4, 9), (9, 9), (1, 9)], ids=str)
def test_causal_lower_right(isa, rng, lq_lk):
    bias = pytest.importorskip("torch.nn.attention.bias")
    Lq, Lk = lq_lk
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=Lq, Lk=Lk, E=16)
    compare(q, k, v, dict(is_causal="lower_right"),
            dict(attn_mask=bias.causal_lower_right(Lq, Lk)))


def test_causal_and_mask(isa, rng):
    # torch refuses is_causal with attn_mask: give it the AND as one bool mask
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=8, Lk=8, E=16)
    pad = np.ones((2, 1, 1, 8), dtype=bool)
    pad[1, ..., 6:] = False
    both = pad & np.tril(np.ones((8, 8), dtype=bool))
    compare(q, k, v, dict(attn_mask=pad, is_causal=True), dict(attn_mask=both))


@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (1, 1), (6, 3)], ids=str)
def test_gqa(isa, rng, heads):
    Hq, Hk = heads
    q, k, v = make_qkv(rng, B=(2,), Hq=Hq, Hk=Hk, Lq=6, Lk=10, E=16, Ev=8)
    compare(q, k, v, dict(enable_gqa=True))


@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 2.0, -0.7])
def test_scale(isa, rng, scale):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=5, Lk=8, E=16)
    compare(q, k, v, dict(scale=scale))


def test_odd_sizes(isa, rng):
    for Lq, Lk, E, Ev in [(1, 1, 1, 1), (17, 33, 15, 17), (3, 65, 65, 31), (31, 129, 128, 64)]:
        q, k, v = make_qkv(rng, B=(1,), Hq=2, Lq=Lq, Lk=Lk, E=E, Ev=Ev)
        compare(q, k, v, dict(is_causal=Lq == Lk))


def test_fully_masked_rows(isa, rng):
    """attnx: zeros for a row with no allowed key (never NaN). torch: NaN
    in some releases, zeros in others; the other rows must agree either way."""
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=6, Lk=7, E=16)
    mask = random_bool_mask(rng, (2, 1, 6, 7), p=0.7)
    mask[..., 0] = True
    mask[0, 0, 2] = False                 # fully masked rows
    mask[1, 0, 5] = False
    dead = np.broadcast_to(~mask.any(-1), (2, 2, 6))
    got = sdpa(q, k, v, attn_mask=mask)
    assert not np.isnan(got).any()
    assert not got[dead].any(), "attnx gives zeros for fully masked rows"
    assert_close(got, attnx.reference(q, k, v, attn_mask=mask))
    for dtype in (torch.float32, torch.float64):
        t = torch_sdpa(q, k, v, dtype, attn_mask=mask)
        t_dead = t[dead]
        assert np.isnan(t_dead).all() or not t_dead.any(), "torch: NaN or zeros"
        tol = {} if dtype == torch.float64 else dict(atol=PEER_ATOL, rtol=PEER_RTOL)
        assert_close(got[~dead], t[~dead], check_dtype=dtype == torch.float32, **tol)
    # a float mask of -inf on a whole row: the same rule
    fmask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    got_f = sdpa(q, k, v, attn_mask=fmask)
    assert not got_f[dead].any() and not np.isnan(got_f).any()
    np.testing.assert_array_equal(got_f[~dead] == 0, got[~dead] == 0)


def test_need_weights_match_softmax(isa, rng):
    # torch SDPA returns no weights: compare with torch's softmax(scores)
    q, k, v = make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=9, E=16)
    mask = random_bool_mask(rng, (5, 9))
    mask[:, 0] = True
    _, w = sdpa(q, k, v, attn_mask=mask, need_weights=True)
    tq, tk = torch.from_numpy(q).double(), torch.from_numpy(k).double()
    scores = tq @ tk.transpose(-2, -1) / np.sqrt(16)
    scores = scores.masked_fill(~torch.from_numpy(mask), float("-inf"))
    assert_close(w, torch.softmax(scores, dim=-1).numpy())
