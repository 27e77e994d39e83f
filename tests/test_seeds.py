"""The seeds' own attention snippets, reimplemented verbatim, matched by attnx.

* seed 000 (PyTorch): ``scores.masked_fill(mask == 1, -inf)``: 1 = blocked.
  attnx takes ``attn_mask = (mask == 0)`` (bool, True = may attend).
* seed 001 (PyTorch): no mask, 2-D (4, 8) inputs from ``torch.rand``.
* seed 004 (NumPy): ``np.where(mask == 0, -1e9, scores)``: 0 = blocked,
  3-D (batch, seq, d). attnx takes ``attn_mask = (mask != 0)``.

Documented differences (tested below):
* a fully masked row: seed 000 gives NaN (softmax of all -inf), seed 004 gives
  the uniform average of the values (-1e9 is a finite number, so every key
  gets the same score); attnx gives zeros, in the output and the weights.

Tolerances: the seeds run in float64 (on inputs exactly representable in
float32) are exact oracles and attnx must meet the bar (atol=1e-5,
rtol=5e-6) against them; seed 000/001 in float32 are a peer with their own
rounding, compared at twice the bar (atol=2e-5, rtol=1e-5).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import attnx
from conftest import assert_close

sdpa = attnx.scaled_dot_product_attention
PEER = dict(atol=2e-5, rtol=1e-5)

SENTENCE = "The animal didn't cross the street because it was too tired"


def _torch():
    return pytest.importorskip("torch")


# ----------------------------------------------------------------------------
# Seed 000 (verbatim, as a function instead of a method: ``self`` dropped)
# ----------------------------------------------------------------------------

def seed000_forward(query, key, value, mask=None):
    import torch
    # Get dimension for scaling
    d_k = query.size(-1)
    # Compute attention scores: Q·Kᵀ / √d_k
    scores = torch.matmul(query, key.transpose(-2, -1))
    scores = scores / torch.sqrt(torch.tensor(d_k, dtype=torch.float32))
    # Apply causal mask if provided (prevent looking at future)
    if mask is not None:
        scores = scores.masked_fill(mask == 1, float('-inf'))
    # Apply softmax to get attention weights (probabilities)
    attention_weights = torch.softmax(scores, dim=-1)
    # Apply attention weights to values
    output = torch.matmul(attention_weights, value)
    return output, attention_weights


# ----------------------------------------------------------------------------
# Seed 001 (verbatim)
# ----------------------------------------------------------------------------

def seed001_scaled_dot_product_attention(Q, K, V):
    import math

    import torch.nn.functional as F
    d_k = Q.size(-1)
    # Computing raw scores
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)
    # Converting scores to attention weights
    weights = F.softmax(scores, dim=-1)
    # Aggregating value vectors
    output = weights @ V
    return output, weights


# ----------------------------------------------------------------------------
# Seed 004 (verbatim; the function renamed from scaled_dot_product_attention)
# ----------------------------------------------------------------------------

def seed004_scaled_dot_product_attention(Q, K, V, mask=None):
    """
    Q: (batch, seq_q, d_k)
    K: (batch, seq_k, d_k)
    V: (batch, seq_k, d_v)
    """
    d_k = Q.shape[-1]

    # (batch, seq_q, seq_k)
    scores = Q @ K.transpose(0, 2, 1) / np.sqrt(d_k)

    if mask is not None:
        scores = np.where(mask == 0, -1e9, scores)

    weights = softmax(scores, axis=-1)   # attention weights
    output  = weights @ V                # (batch, seq_q, d_v)  # noqa: E221
    return output, weights


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ----------------------------------------------------------------------------

def f32_exact(rng, shape):
    """float64 values that are exactly representable in float32."""
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def check_seed(got, got_w, seed_out, seed_w, exact):
    """attnx's (out, weights) against a seed's; ``exact``: the seed ran in float64."""
    tol = {} if exact else PEER
    assert_close(got, np.asarray(seed_out), **tol, err_msg="output")
    assert_close(got_w, np.asarray(seed_w), **tol, err_msg="weights")


# ------------------------------------------------------------------ seed 000

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(6, 8), (2, 6, 8), (2, 4, 6, 16)], ids=str)
def test_seed000_causal_mask(isa, rng, shape, dtype):
    torch = _torch()
    dt = getattr(torch, dtype)
    q, k, v = (f32_exact(rng, shape) for _ in range(3))
    L = shape[-2]
    mask = torch.triu(torch.ones(L, L), diagonal=1)        # 1 = blocked (the future)
    s_out, s_w = seed000_forward(*(torch.from_numpy(a).to(dt) for a in (q, k, v)), mask=mask)
    out, w = sdpa(q, k, v, attn_mask=(mask == 0).numpy(), need_weights=True)
    check_seed(out, w, s_out, s_w, exact=dtype == "float64")
    # the seed's mask is PyTorch's is_causal
    out_c, w_c = sdpa(q, k, v, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(out_c, out)
    np.testing.assert_array_equal(w_c, w)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_seed000_padding_mask(isa, rng, dtype):
    torch = _torch()
    dt = getattr(torch, dtype)
    B, H, L, d = 3, 2, 7, 8
    q, k, v = (f32_exact(rng, (B, H, L, d)) for _ in range(3))
    lengths = np.array([7, 3, 5])
    mask = torch.from_numpy((np.arange(L) >= lengths[:, None])[:, None, None, :].astype(np.float32))
    s_out, s_w = seed000_forward(*(torch.from_numpy(a).to(dt) for a in (q, k, v)), mask=mask)
    out, w = sdpa(q, k, v, attn_mask=(mask == 0).numpy(), need_weights=True)
    check_seed(out, w, s_out, s_w, exact=dtype == "float64")
    # the same padding without building a mask
    out_l = sdpa(q, k, v, key_lengths=lengths)
    assert_close(out_l, s_out.double().numpy() if dtype == "float64" else s_out.numpy(),
                 **({} if dtype == "float64" else PEER))


def test_seed000_fully_masked_row_difference(isa, rng):
    """Seed 000 gives NaN for a row whose mask is all 1; attnx gives zeros."""
    torch = _torch()
    q, k, v = (f32_exact(rng, (5, 8)) for _ in range(3))
    mask = torch.zeros(5, 5)
    mask[2] = 1                                            # row 2 may attend nothing
    s_out, s_w = seed000_forward(*(torch.from_numpy(a) for a in (q, k, v)), mask=mask)
    s_out, s_w = s_out.numpy(), s_w.numpy()
    out, w = sdpa(q, k, v, attn_mask=(mask == 0).numpy(), need_weights=True)
    assert np.isnan(s_out[2]).all() and np.isnan(s_w[2]).all()   # the seed: NaN
    assert not out[2].any() and not w[2].any()                   # attnx: zeros
    rows = [0, 1, 3, 4]
    check_seed(out[rows], w[rows], s_out[rows], s_w[rows], exact=True)


# ------------------------------------------------------------------ seed 001

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_seed001(isa, dtype):
    torch = _torch()
    torch.manual_seed(0)
    # Sequence of 4 tokens, each projected into dimension 8
    Q = torch.rand(4, 8)
    K = torch.rand(4, 8)
    V = torch.rand(4, 8)
    dt = getattr(torch, dtype)
    output, weights = seed001_scaled_dot_product_attention(Q.to(dt), K.to(dt), V.to(dt))
    assert tuple(output.shape) == (4, 8)
    out, w = sdpa(Q.numpy(), K.numpy(), V.numpy(), need_weights=True)
    assert out.shape == (4, 8) and w.shape == (4, 4)
    check_seed(out, w, output, weights, exact=dtype == "float64")
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6, rtol=0)


def test_seed001_more_sizes(isa, rng):
    torch = _torch()
    for L, d in [(1, 8), (5, 3), (17, 33), (40, 64)]:
        Q, K, V = (torch.from_numpy(f32_exact(rng, (L, d))) for _ in range(3))
        output, weights = seed001_scaled_dot_product_attention(Q, K, V)
        out, w = sdpa(Q.numpy(), K.numpy(), V.numpy(), need_weights=True)
        check_seed(out, w, output, weights, exact=True)


# ------------------------------------------------------------------ seed 004

@pytest.mark.parametrize("mask_kind", ["none", "full", "padding"])
def test_seed004(isa, rng, mask_kind):
    batch, seq_q, seq_k, d_k, d_v = 3, 5, 9, 16, 7
    Q = f32_exact(rng, (batch, seq_q, d_k))
    K = f32_exact(rng, (batch, seq_k, d_k))
    V = f32_exact(rng, (batch, seq_k, d_v))
    mask = None
    kw = {}
    if mask_kind == "full":                 # (batch, seq_q, seq_k), 0 = blocked
        mask = (rng.random((batch, seq_q, seq_k)) < 0.7).astype(np.int64)
        mask[..., 0] = 1                    # no fully masked row here (see below)
    elif mask_kind == "padding":            # (batch, 1, seq_k)
        lengths = np.array([9, 4, 1])
        mask = (np.arange(seq_k) < lengths[:, None])[:, None, :].astype(np.float64)
        kw["key_lengths"] = lengths
    s_out, s_w = seed004_scaled_dot_product_attention(Q, K, V, mask)
    out, w = sdpa(Q, K, V, attn_mask=None if mask is None else mask != 0, need_weights=True)
    assert out.shape == (batch, seq_q, d_v) and w.shape == (batch, seq_q, seq_k)
    check_seed(out, w, s_out, s_w, exact=True)
    if kw:                                  # the padding as lengths: the same result
        check_seed(*sdpa(Q, K, V, need_weights=True, **kw), s_out, s_w, exact=True)


def test_seed004_fully_masked_row_difference(isa, rng):
    """Seed 004 writes -1e9, not -inf: a row whose mask is all 0 gets equal
    scores everywhere and the uniform average of the values. attnx treats the
    row as fully masked and gives zeros (output and weights)."""
    Q, K, V = (f32_exact(rng, (2, 4, 8)) for _ in range(3))
    mask = np.ones((2, 4, 4))
    mask[1, 2] = 0                                     # batch 1, query 2: nothing allowed
    s_out, s_w = seed004_scaled_dot_product_attention(Q, K, V, mask)
    np.testing.assert_allclose(s_w[1, 2], 0.25)                      # the seed: uniform
    np.testing.assert_allclose(s_out[1, 2], V[1].mean(axis=0))
    out, w = sdpa(Q, K, V, attn_mask=mask != 0, need_weights=True)
    assert not out[1, 2].any() and not w[1, 2].any()                  # attnx: zeros
    keep = np.ones((2, 4), dtype=bool)
    keep[1, 2] = False
    check_seed(out[keep], w[keep], s_out[keep], s_w[keep], exact=True)
    # Seed 004's -1e9 as an additive float mask gives the seed's result on
    # every row that has an allowed key (exp(-1e9 - max) is exactly 0).
    add = np.where(mask == 0, -1e9, 0.0)
    out_f, w_f = sdpa(Q, K, V, attn_mask=add, need_weights=True)
    check_seed(out_f[keep], w_f[keep], s_out[keep], s_w[keep], exact=True)


# ----------------------------------------------------- the seeds' sentence

def _sentence_qkv(d_model=16, d_head=8):
    tokens = SENTENCE.split()
    assert len(tokens) == 11 and tokens[7] == "it"
    rng = np.random.default_rng(zlib.crc32(SENTENCE.encode()))
    vocab = sorted({t.lower() for t in tokens})
    emb = rng.standard_normal((len(vocab), d_model)).astype(np.float32)
    X = emb[[vocab.index(t.lower()) for t in tokens]]              # (11, d_model)
    Wq, Wk, Wv = (rng.standard_normal((d_model, d_head)).astype(np.float32) * 0.5
                  for _ in range(3))
    return tokens, X @ Wq, X @ Wk, X @ Wv


def test_sentence_seed000_causal(isa):
    torch = _torch()
    tokens, Q, K, V = _sentence_qkv()
    L = len(tokens)
    mask = torch.triu(torch.ones(L, L), diagonal=1)
    s_out, s_w = seed000_forward(*(torch.from_numpy(a).double() for a in (Q, K, V)), mask=mask)
    out, w = sdpa(Q, K, V, attn_mask=(mask == 0).numpy(), need_weights=True)
    check_seed(out, w, s_out, s_w, exact=True)
    it = tokens.index("it")
    assert not w[it, it + 1:].any()                   # "it" does not see "was too tired"
    np.testing.assert_allclose(w[it].sum(), 1.0, atol=1e-6)
    assert np.argmax(w[it]) == np.argmax(s_w[it].numpy())


def test_sentence_seed004_padded_batch(isa):
    tokens, Q, K, V = _sentence_qkv()
    L = len(tokens)
    # batch of two: the sentence, and "The animal was tired" padded to 11
    short = [tokens.index(t) for t in ("The", "animal", "was", "tired")]
    pad = lambda a: np.concatenate([a[short], np.zeros((L - len(short), a.shape[1]), a.dtype)])
    Qb, Kb, Vb = (np.stack([a, pad(a)]).astype(np.float64) for a in (Q, K, V))
    mask = np.stack([np.ones(L), (np.arange(L) < len(short)).astype(float)])[:, None, :]
    s_out, s_w = seed004_scaled_dot_product_attention(Qb, Kb, Vb, mask)
    out, w = sdpa(Qb, Kb, Vb, attn_mask=mask != 0, need_weights=True)
    check_seed(out, w, s_out, s_w, exact=True)
    out_l, w_l = sdpa(Qb, Kb, Vb, key_lengths=[L, len(short)], need_weights=True)
    check_seed(out_l, w_l, s_out, s_w, exact=True)
    assert not w[1, :, len(short):].any()            # nobody attends to <PAD>
    it = tokens.index("it")
    np.testing.assert_allclose(w[0, it].sum(), 1.0, atol=1e-6)
