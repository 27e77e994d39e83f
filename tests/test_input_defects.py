"""Regressions for input defects: every array argument of the public API goes
through one conversion (``attnx._args.as_array``), which must never give
a silently wrong value.

A. torch tensors with the lazy negative/conjugate bit (``z.conj().imag``) and
   zero tensors: DLPack exports their memory without the bit, so they are
   resolved (``resolve_neg()``) or refused, never read as they lie in memory.
B. float64 inputs and masks holding finite values beyond float32's range
   raise ValueError naming the argument, in the kernels and in
   ``attnx.reference`` alike.
C. MultiHeadAttention's mask, padding_mask's lengths and plot_attention's
   weights use the same conversion; masked arrays are refused; bool flags
   take bools only; ``from_torch`` warns about dropout in training mode;
   ``set_num_threads`` names ``n``; MemoryError propagates; the 3-D head
   mismatch message says what N is.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import DLPackOnly


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def qkv(shape_q=(1, 2, 6, 8), Lk=7, Ev=4, seed=0):
    rng = np.random.default_rng(seed)
    B, H, Lq, E = shape_q
    return (rng.standard_normal(shape_q, dtype=np.float32),
            rng.standard_normal((B, H, Lk, E), dtype=np.float32),
            rng.standard_normal((B, H, Lk, Ev), dtype=np.float32))


def neg_bit(torch, a):
    """A float tensor showing the values of ``a`` whose memory holds ``-a``
    (``is_neg()`` is True): the imaginary part of a conjugated complex tensor."""
    t = torch.complex(torch.zeros(a.shape, dtype=torch.float32), torch.from_numpy(-a))
    x = t.conj().imag
    assert x.is_neg()
    np.testing.assert_array_equal(x.resolve_neg().numpy(), a)
    return x


# ------------------------------------------------------------ A. negative bit

def test_negative_bit_tensors_give_their_values(torch):
    F = torch.nn.functional
    q, k, v = qkv()
    mask = np.random.default_rng(1).standard_normal((6, 7)).astype(np.float32)
    tq, tk, tv, tm = (neg_bit(torch, a) for a in (q, k, v, mask))
    want = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attnx.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm).numpy(),
                               atol=1e-5, rtol=1e-5)
    # only the query has the bit
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(tq, k, v),
                                  attnx.scaled_dot_product_attention(q, k, v))
    assert tq.is_neg()                      # the caller's tensor is untouched


def test_negative_bit_tensors_in_reference(torch):
    q, k, v = qkv()
    got = attnx.reference(neg_bit(torch, q), neg_bit(torch, k), neg_bit(torch, v))
    np.testing.assert_array_equal(got, attnx.reference(q, k, v))


def test_negative_bit_tensor_that_requires_grad(torch):
    q, k, v = qkv()
    x = torch.tensor(-q, requires_grad=True)
    tq = torch.complex(torch.zeros_like(x), x).conj().imag     # requires grad and is_neg
    assert tq.requires_grad and tq.is_neg()
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(tq, k, v),
                                  attnx.scaled_dot_product_attention(q, k, v))
    assert x.grad is None


def test_negative_bit_lengths_and_padding_mask(torch):
    q, k, v = qkv((2, 2, 6, 8))
    kl = torch._neg_view(torch.tensor([-7, -3]))               # shows [7, 3]
    assert kl.is_neg()
    np.testing.assert_array_equal(
        attnx.scaled_dot_product_attention(q, k, v, key_lengths=kl),
        attnx.scaled_dot_product_attention(q, k, v, key_lengths=[7, 3]))
    np.testing.assert_array_equal(attnx.padding_mask(kl, 7), attnx.padding_mask([7, 3], 7))


def test_negative_bit_in_multi_head_attention(torch):
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 8), dtype=np.float32)
    m = rng.standard_normal((5, 5)).astype(np.float32)
    np.testing.assert_array_equal(mha(neg_bit(torch, x), attn_mask=neg_bit(torch, m)),
                                  mha(x, attn_mask=m))


def test_zero_tensors_are_not_read_as_garbage(torch):
    """A ZeroTensor has no memory of its own: DLPack exports whatever is there."""
    q, k, v = qkv()
    z = torch._efficientzerotensor(1, 2, 6, 8)
    with pytest.raises(TypeError, match="query"):
        attnx.scaled_dot_product_attention(z, k, v)


def test_tensors_dlpack_cannot_describe_raise(torch):
    """Conjugate bit (complex anyway), sparse, quantized, meta: clear TypeErrors."""
    q, k, v = qkv()
    zc = torch.complex(torch.from_numpy(q), torch.from_numpy(q)).conj()
    assert zc.is_conj()
    with pytest.raises(TypeError, match="query must be float16, float32, float64 or bfloat16.*complex"):
        attnx.scaled_dot_product_attention(zc, k, v)
    with pytest.raises(TypeError, match="attn_mask"):
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(6, 7).to_sparse())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                        # quantize_per_tensor is deprecated
        qt = torch.quantize_per_tensor(torch.from_numpy(k), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="key"):
        attnx.scaled_dot_product_attention(q, qt, v)
    with pytest.raises(TypeError, match="value.*meta"):
        attnx.reference(q, k, torch.empty(1, 2, 7, 4, device="meta"))


# ------------------------------------------------------- B. float32's range

@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_float64_inputs_beyond_float32_raise(which):
    q, k, v = (a.astype(np.float64) for a in qkv())
    args = {"query": q, "key": k, "value": v}
    args[which][0, 0, 1, 0] = 1e39
    for f in (attnx.scaled_dot_product_attention, attnx.reference):
        with pytest.raises(ValueError, match=f"{which} .*float32's range.*1e\\+39"):
            f(args["query"], args["key"], args["value"])
    args[which][0, 0, 1, 0] = -np.finfo(np.float64).max
    with pytest.raises(ValueError, match=which):
        attnx.scaled_dot_product_attention(args["query"], args["key"], args["value"])


@pytest.mark.parametrize("blocked", [np.finfo(np.float64).min, -1e300, 1e39])
def test_float64_masks_beyond_float32_raise(blocked):
    q, k, v = qkv()
    m = np.zeros((6, 7))
    m[1] = blocked                                             # a fully blocked row
    for f in (attnx.scaled_dot_product_attention, attnx.reference):
        with pytest.raises(ValueError, match="attn_mask .*float32's range.*-np.inf"):
            f(q, k, v, attn_mask=m)
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(q[0, 0], attn_mask=m[:, :6])


def test_float64_values_within_float32_range_and_non_finite_pass():
    q, k, v = qkv()
    f32 = np.finfo(np.float32)
    m = np.zeros((6, 7))
    m[1] = -np.inf
    m[2, :3] = f32.min
    m[3, 2] = np.nan
    m[4, 1] = f32.max
    want = attnx.reference(q, k, v, attn_mask=m)
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=5e-6)
    q64 = q.astype(np.float64)
    q64[0, 0, 0, 0] = np.inf
    q64[0, 0, 1, 0] = np.nan
    q64[0, 1, 0, 0] = -f32.max
    attnx.scaled_dot_product_attention(q64, k, v)              # no error
    attnx.reference(q64, k, v)


def test_float32_range_check_on_strided_and_broadcast_views():
    q, k, v = qkv()
    big = np.zeros((2, 7))
    big[1, 3] = 1e39
    m = np.broadcast_to(big[1], (1, 2, 6, 7))                  # stride-0 view holding 1e39
    with pytest.raises(ValueError, match="attn_mask"):
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
    np.testing.assert_array_equal(                             # big[0] is fine
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=big[0]),
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=big[0].astype(np.float32)))


# -------------------------------------------- C. one conversion for everything

def test_multi_head_attention_mask_takes_any_array(torch):
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    x = np.random.default_rng(4).standard_normal((2, 5, 8), dtype=np.float32)
    m = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    want = mha(x, attn_mask=m)
    tm = torch.tensor(m, requires_grad=True)
    np.testing.assert_array_equal(mha(x, attn_mask=tm), want)
    assert tm.grad is None
    np.testing.assert_array_equal(mha(x, attn_mask=DLPackOnly(m)), want)
    # a bfloat16 tensor is read through its bits (its 0 and -inf are exact)
    np.testing.assert_array_equal(mha(x, attn_mask=torch.from_numpy(m).bfloat16()), want)


@pytest.mark.parametrize("mask", [np.ma.nomask, False, True])
def test_masked_arrays_are_refused(mask):
    q, k, v = qkv()
    ma = np.ma.masked_array
    sdpa = attnx.scaled_dot_product_attention
    with pytest.raises(TypeError, match=r"query is a masked array.*key_lengths.*attn_mask.*\.filled"):
        sdpa(ma(q, mask=mask), k, v)
    with pytest.raises(TypeError, match="value is a masked array"):
        attnx.reference(q, k, ma(v, mask=mask))
    with pytest.raises(TypeError, match="attn_mask is a masked array"):
        sdpa(q, k, v, attn_mask=ma(np.ones((6, 7), bool), mask=mask))
    with pytest.raises(TypeError, match="key_lengths is a masked array"):
        sdpa(q, k, v, key_lengths=ma([7], mask=mask))
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match="query is a masked array"):
        mha(ma(q[0], mask=mask))
    with pytest.raises(TypeError, match="attn_mask is a masked array"):
        mha(q[0], attn_mask=ma(np.ones((6, 6), bool), mask=mask))
    with pytest.raises(TypeError, match="lengths is a masked array"):
        attnx.padding_mask(ma([3, 1], mask=mask), 4)


def test_masked_nans_do_not_reach_the_output():
    """NaN padding hidden by a masked array's mask is refused, never read as values;
    the lengths the message suggests leave it out."""
    q, k, v = qkv()
    v_pad = v.copy()
    v_pad[..., 5:, :] = np.nan
    with pytest.raises(TypeError, match="masked array"):
        attnx.scaled_dot_product_attention(q, k, np.ma.masked_invalid(v_pad))
    # what the message suggests works
    np.testing.assert_array_equal(
        attnx.scaled_dot_product_attention(q, k, v_pad, key_lengths=[5]),
        attnx.scaled_dot_product_attention(q[..., :, :], k[..., :5, :], v[..., :5, :]))


def test_plot_attention_refuses_masked_weights():
    pytest.importorskip("matplotlib")
    with pytest.raises(TypeError, match="weights is a masked array"):
        attnx.plot_attention(np.ma.masked_array(np.full((2, 2), 0.5), mask=[[0, 1], [0, 0]]))


def test_padding_mask_lengths_take_dlpack_and_tensors(torch):
    want = attnx.padding_mask([3, 1], 4)
    np.testing.assert_array_equal(attnx.padding_mask(DLPackOnly(np.array([3, 1])), 4), want)
    np.testing.assert_array_equal(attnx.padding_mask(torch.tensor([3, 1]), 4), want)
    with pytest.raises(TypeError, match="lengths"):
        attnx.padding_mask(torch.tensor([3, 1], dtype=torch.bfloat16), 4)


def test_from_torch_warns_about_dropout_in_training_mode(torch):
    t = torch.nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
    assert t.training
    with pytest.warns(UserWarning, match="training mode with dropout=0.1.*without dropout") as rec:
        attnx.MultiHeadAttention.from_torch(t)
    assert rec[0].filename == __file__                          # points at the caller
    with pytest.warns(UserWarning, match="eval") as rec:
        attnx.MultiHeadAttention(8, 2).load_torch(t)
    assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnx.MultiHeadAttention.from_torch(t.eval())           # eval mode: no warning
        attnx.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2))   # dropout 0


@pytest.mark.parametrize("value", ["no", "", 1, 0, None, [True]])
def test_bool_flags_take_bools_only(value):
    q, k, v = qkv((1, 4, 6, 8))
    k, v = k[:, :2], v[:, :2]
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        attnx.scaled_dot_product_attention(q, k, v, enable_gqa=value)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        attnx.reference(q, k, v, enable_gqa=value)
    with pytest.raises(TypeError, match="need_weights must be a bool"):
        attnx.reference(q, q, q, need_weights=value)
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    x = q[0, 0]
    with pytest.raises(TypeError, match="need_weights must be a bool"):
        mha(x, need_weights=value)
    with pytest.raises(TypeError, match="average_weights must be a bool"):
        mha(x, need_weights=True, average_weights=value)


def test_bool_flags_take_numpy_bools():
    q, k, v = qkv((1, 4, 6, 8))
    want = attnx.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True)
    np.testing.assert_array_equal(
        attnx.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=np.True_), want)
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    out, w = mha(q[0, 0], need_weights=np.True_, average_weights=np.bool_(True))
    assert w.shape == (6, 6)


@pytest.fixture
def restore_threads():
    before = _attnx.get_num_threads()
    yield
    attnx.set_num_threads(0)
    assert _attnx.get_num_threads() >= 1
    _ = before


@pytest.mark.parametrize("n, error", [(10**30, ValueError), (2**20 + 1, ValueError),
                                      ("x", TypeError), ("2", TypeError), (2.0, TypeError),
                                      (True, TypeError), (None, TypeError)])
def test_set_num_threads_names_n(n, error, restore_threads):
    attnx.set_num_threads(3)
    with pytest.raises(error, match=r"\bn must be"):
        attnx.set_num_threads(n)
    assert attnx.get_num_threads() == 3                        # unchanged


def test_set_num_threads_accepts_integers(restore_threads):
    attnx.set_num_threads(np.int64(2))
    assert attnx.get_num_threads() == 2
    attnx.set_num_threads(-10**30)                              # <= 0: the default
    assert attnx.get_num_threads() >= 1


class RaisesMemoryError:
    def __array__(self, dtype=None, copy=None):
        raise MemoryError("out of memory while materialising")


def test_memory_error_propagates():
    q, k, v = qkv()
    with pytest.raises(MemoryError):
        attnx.scaled_dot_product_attention(RaisesMemoryError(), k, v)
    with pytest.raises(MemoryError):
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=RaisesMemoryError())
    with pytest.raises(MemoryError):
        attnx.MultiHeadAttention(8, 2)(RaisesMemoryError())
    with pytest.raises(MemoryError):
        attnx.padding_mask(RaisesMemoryError(), 4)


def test_3d_batch_mismatch_message_does_not_suggest_gqa():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 3, 8), dtype=np.float32)
    k = rng.standard_normal((2, 5, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=r"3-D \(N, L, E\).*N.*must match.*4-D \(B, H, L, E\)") as e:
        attnx.scaled_dot_product_attention(q, k, k)
    assert "pass enable_gqa=True" not in str(e.value)
    # 4-D inputs keep the GQA hint
    with pytest.raises(ValueError, match="heads but key/value have.*pass enable_gqa=True"):
        attnx.scaled_dot_product_attention(q[None], k[None], k[None])


def test_flags_are_checked_on_the_plain_path():
    """The shortcut for plain calls must not skip the flag checks."""
    q = np.ones((1, 1, 2, 2), np.float32)
    with pytest.raises(TypeError, match="enable_gqa"):
        attnx.scaled_dot_product_attention(q, q, q, enable_gqa="no")
    with pytest.raises(TypeError, match="need_weights"):
        attnx.scaled_dot_product_attention(q, q, q, need_weights="yes")
