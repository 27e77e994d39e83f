"""Inputs other than NumPy arrays: PyTorch CPU tensors, ``__array__``, DLPack.

scaled_dot_product_attention, reference and MultiHeadAttention accept them,
read float32 data in place whenever the last axis is contiguous (checked on
what the C core receives, by wrapping ``attnx._attnx.forward``), convert
float16/float64, read tensors that require grad through ``detach()`` and
never modify the caller's object. Results equal those of NumPy arrays.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import attnx
from attnx import _functional
from conftest import DLPackOnly


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def core_args(monkeypatch):
    """Record the arguments of every call into the C core (the call still runs)."""
    calls = []
    real = _functional._attnx.forward

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_functional._attnx, "forward", spy)
    return calls


def qkv(shape=(2, 3, 10, 8), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


class ArrayOnly:
    """Exposes its data through ``__array__`` only."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


def shares(recorded, original):
    return np.shares_memory(recorded, original)


# ------------------------------------------------------------------ torch tensors

def test_float32_tensors_are_read_in_place(torch, core_args):
    q, k, v = qkv()
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))
    out = attnx.scaled_dot_product_attention(tq, tk, tv)
    (args,) = core_args
    for got, t in zip(args[:3], (tq, tk, tv)):
        assert shares(got, t.numpy()), "a contiguous float32 tensor was copied"
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, attnx.scaled_dot_product_attention(q, k, v))


def test_transposed_tensor_views_are_read_in_place(torch, core_args):
    """(B, L, H, E).transpose(1, 2): the (B, H, L, E) view PyTorch users pass."""
    q, k, v = qkv((2, 10, 3, 8))
    tq, tk, tv = (torch.from_numpy(x.copy()).transpose(1, 2) for x in (q, k, v))
    assert not tq.is_contiguous()
    out = attnx.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    (args,) = core_args
    for got, t in zip(args[:3], (tq, tk, tv)):
        assert shares(got, t.numpy())
    ref = attnx.scaled_dot_product_attention(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), is_causal=True)
    np.testing.assert_array_equal(out, ref)


def test_sliced_and_strided_tensor_views(torch, core_args):
    q, k, v = qkv((2, 3, 20, 8))
    tq = torch.from_numpy(q.copy())[:, :, ::2]             # every other query: strided rows
    tk = torch.from_numpy(k.copy())[:, 1:]                 # a slice of the heads
    tv = torch.from_numpy(v.copy())[:, 1:]
    tkt = torch.from_numpy(np.ascontiguousarray(np.swapaxes(k[:, 1:], -1, -2)))
    tk_last = tkt.transpose(-1, -2)                        # last axis not contiguous: must copy
    out = attnx.scaled_dot_product_attention(tq[:, 1:], tk, tv)
    out2 = attnx.scaled_dot_product_attention(tq[:, 1:], tk_last, tv)
    a1, a2 = core_args
    assert shares(a1[0], tq.numpy()) and shares(a1[1], tk.numpy()) and shares(a1[2], tv.numpy())
    assert not shares(a2[1], tkt.numpy())                  # copied, as documented
    ref = attnx.scaled_dot_product_attention(q[:, 1:, ::2], k[:, 1:], v[:, 1:])
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out2, ref)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_float16_and_float64_tensors_are_converted(torch, dtype):
    q, k, v = (x.astype(dtype) for x in qkv())
    t = [torch.from_numpy(x.copy()) for x in (q, k, v)]
    out, w = attnx.scaled_dot_product_attention(*t, need_weights=True)
    ref_out, ref_w = attnx.scaled_dot_product_attention(q, k, v, need_weights=True)
    assert out.dtype == w.dtype == np.float32
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)
    for x, tx in zip((q, k, v), t):                         # untouched
        np.testing.assert_array_equal(tx.numpy(), x)


def test_tensors_that_require_grad(torch, core_args):
    q, k, v = qkv()
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    versions = [x._version for x in t]
    out = attnx.scaled_dot_product_attention(*t, attn_mask=torch.ones(10, 10, dtype=torch.bool))
    args = core_args[0]
    np.testing.assert_array_equal(out, attnx.scaled_dot_product_attention(q, k, v))
    for got, x in zip(args[:3], t):
        assert shares(got, x.detach().numpy())              # read in place, not copied
    for x, a, ver in zip(t, (q, k, v), versions):           # the caller's tensor is unchanged
        assert x.requires_grad and x.grad is None and x.grad_fn is None and x._version == ver
        np.testing.assert_array_equal(x.detach().numpy(), a)
    ref = attnx.reference(*t)
    assert ref.dtype == np.float64 and ref.shape == out.shape


def test_tensor_masks_and_lengths(torch):
    q, k, v = qkv()
    rng = np.random.default_rng(1)
    bool_mask = rng.random((2, 1, 10, 10)) > 0.3
    float_mask = np.where(bool_mask, 0.5, -np.inf).astype(np.float32)
    lengths = np.array([10, 4])
    for mask in (bool_mask, float_mask):
        got = attnx.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask),
            key_lengths=torch.from_numpy(lengths), query_lengths=torch.tensor([7, 10]))
        want = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_lengths=lengths,
                                                  query_lengths=[7, 10])
        np.testing.assert_array_equal(got, want)
    # a broadcast (expanded, stride 0) tensor mask
    expanded = torch.from_numpy(bool_mask[:1]).expand(2, 3, 10, 10)
    np.testing.assert_array_equal(
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=expanded),
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask[:1]))


def test_torch_results_match_torch(torch):
    q, k, v = qkv()
    t = [torch.from_numpy(x) for x in (q, k, v)]
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask).numpy()
    np.testing.assert_allclose(attnx.scaled_dot_product_attention(*t, attn_mask=mask), want,
                               atol=1e-5, rtol=5e-6)


def test_multi_head_attention_takes_tensors(torch):
    mha = attnx.MultiHeadAttention(16, 4, seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 7, 16), dtype=np.float32)
    mem = rng.standard_normal((2, 5, 16))                   # float64
    tx = torch.tensor(x, requires_grad=True)
    out, w = mha(tx, torch.from_numpy(mem), need_weights=True,
                 attn_mask=torch.ones(7, 5, dtype=torch.bool), key_lengths=torch.tensor([5, 3]))
    ref_out, ref_w = mha(x, mem, need_weights=True, key_lengths=[5, 3])
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)
    assert tx.requires_grad and tx.grad is None
    np.testing.assert_array_equal(tx.detach().numpy(), x)


def test_unsupported_tensors_raise_clear_errors(torch):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="query.*complex"):
        attnx.scaled_dot_product_attention(torch.from_numpy(q).to(torch.complex64), k, v)
    with pytest.raises(TypeError, match="key.*meta"):
        attnx.scaled_dot_product_attention(q, torch.empty(2, 3, 10, 8, device="meta"), v)
    with pytest.raises(TypeError, match="query must be float16, float32, float64 or bfloat16"):
        attnx.scaled_dot_product_attention(torch.ones(2, 3, 10, 8, dtype=torch.int32), k, v)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(10, 10, dtype=torch.int64))


def test_torch_is_not_imported():
    """attnx never imports torch itself, for NumPy or for foreign inputs."""
    code = ("import sys, numpy as np, attnx\n"
            "x = np.ones((4, 8), np.float32)\n"
            "attnx.scaled_dot_product_attention(x, x, x)\n"
            "attnx.MultiHeadAttention(8, 2)(x)\n"
            "assert 'torch' not in sys.modules, 'attnx imported torch'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------- __array__ and DLPack

def test_array_protocol_objects(core_args):
    q, k, v = qkv()
    out, w = attnx.scaled_dot_product_attention(ArrayOnly(q), ArrayOnly(k), ArrayOnly(v),
                                                attn_mask=ArrayOnly(attnx.causal_mask(10)),
                                                need_weights=True)
    (args,) = core_args
    for got, a in zip(args[:3], (q, k, v)):
        assert shares(got, a)
    ref_out, ref_w = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)
    # float64 through __array__: converted, same result
    out64 = attnx.scaled_dot_product_attention(*(ArrayOnly(x.astype(np.float64)) for x in (q, k, v)))
    np.testing.assert_array_equal(out64, attnx.scaled_dot_product_attention(q, k, v))


def test_dlpack_only_objects(core_args):
    q, k, v = qkv()
    assert np.asarray(DLPackOnly(q)).dtype == object        # what plain np.asarray would give
    out = attnx.scaled_dot_product_attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v),
                                             attn_mask=DLPackOnly(attnx.causal_mask(10)),
                                             key_lengths=DLPackOnly(np.array([10, 6])))
    (args,) = core_args
    for got, a in zip(args[:3], (q, k, v)):
        assert shares(got, a)
    want = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, key_lengths=[10, 6])
    np.testing.assert_array_equal(out, want)
    ref = attnx.reference(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), is_causal=True,
                          key_lengths=DLPackOnly(np.array([10, 6])))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=5e-6)
    mha = attnx.MultiHeadAttention(8, 2, seed=0)
    x = q[0, 0]
    np.testing.assert_array_equal(mha(DLPackOnly(x)), mha(x))


def test_dlpack_object_of_ints_is_refused():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="key must be float16, float32, float64 or bfloat16"):
        attnx.scaled_dot_product_attention(q, DLPackOnly(np.ones((2, 3, 10, 8), np.int32)), v)


def test_objects_that_are_not_arrays():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="value"):
        attnx.scaled_dot_product_attention(q, k, object())
    with pytest.raises(TypeError, match="query must be array-like"):
        attnx.scaled_dot_product_attention([[1.0, 2.0], [3.0]], k, v)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")   # np.matrix
def test_ndarray_subclasses_are_read_as_plain_arrays(core_args):
    """np.matrix (always 2-D): its data, as NumPy's own functions read it. (Masked
    arrays are refused: tests/test_input_defects.py.)"""
    q, k, v = (x[0, 0] for x in qkv())                     # (10, 8)
    out = attnx.scaled_dot_product_attention(np.asmatrix(q), np.asmatrix(k), v)
    assert type(out) is np.ndarray
    assert all(type(a) is np.ndarray for a in core_args[0][:3])
    assert shares(core_args[0][0], q) and shares(core_args[0][1], k)
    np.testing.assert_array_equal(out, attnx.scaled_dot_product_attention(q, k, v))
