"""A small, realistic use of attnx's public API, type-checked by tests/test_typing.py.

``mypy --strict tests/typing/usage.py`` must pass: the annotations of attnx
(and the stub of its C extension) are what an editor and a type checker see.
Every result is assigned to an explicitly typed name, so a return type that
regressed to ``Any`` or to a union would make mypy fail. The file also runs
(``python tests/typing/usage.py``), so it stays real code.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
from numpy.typing import NDArray

import attnx

F32 = NDArray[np.float32]
Grads = Callable[[F32], attnx.AttentionGrads]


def encode(mha: attnx.MultiHeadAttention, x: F32, lengths: list[int]) -> F32:
    """Encoder self-attention over a padded batch (a Transformer encoder's padding mask)."""
    return mha(x, key_lengths=lengths, query_lengths=lengths)


def cross_attend(mha: attnx.MultiHeadAttention, x: F32, memory: F32) -> tuple[F32, F32]:
    """Cross-attention, with the weights averaged over the heads (B, Lq, Lk)."""
    out, w = mha(x, memory, need_weights=True, average_weights=True)
    return out, w


def decode_step(q: F32, k_cache: F32, v_cache: F32) -> F32:
    """New queries against a KV cache: the last query sees every key."""
    return attnx.scaled_dot_product_attention(q, k_cache, v_cache, is_causal="lower_right")


def attention_with_weights(x: F32, mask: NDArray[np.bool_]) -> tuple[F32, F32]:
    """Single-head self-attention on (L, E) embeddings, as in the tutorials."""
    out, weights = attnx.scaled_dot_product_attention(x, x, x, attn_mask=mask, need_weights=True)
    return out, weights


def sgd_step(mha: attnx.MultiHeadAttention, x: F32, lr: float) -> float:
    """One step of gradient descent on sum(out**2) / 2: the layer's vjp and its live parameters."""
    out, vjp = mha.vjp(x, is_causal=True, window=(4, 0))
    grads: dict[str, F32] = vjp(out)
    params: dict[str, F32] = mha.parameters()
    for name, param in params.items():
        param -= np.float32(lr) * grads[name]
    dx: F32 = grads["query"]
    assert dx.shape == x.shape
    return float(np.sum(out.astype(np.float64) ** 2) / 2)


def chunked(q: F32, k: F32, v: F32, chunk: int) -> tuple[F32, F32]:
    """Attention over a long sequence of keys, one chunk at a time, merged by lse."""
    outs: list[F32] = []
    lses: list[F32] = []
    for s in range(0, k.shape[-2], chunk):
        o, lse = attnx.scaled_dot_product_attention(q, k[..., s:s + chunk, :],
                                                    v[..., s:s + chunk, :], return_lse=True)
        outs.append(o)
        lses.append(lse)
    return attnx.merge_attention(outs, lses)


def gradients(q: F32, k: F32, v: F32, bias: F32, sinks: F32) -> attnx.AttentionGrads:
    """The gradient API: a vjp closure, and the backward from saved (out, lse)."""
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, bias, sinks=sinks, softcap=30.0)
    pullback: Grads = vjp
    g: attnx.AttentionGrads = pullback(np.ones_like(out))
    saved: tuple[F32, F32] = attnx.scaled_dot_product_attention(
        q, k, v, bias, sinks=sinks, softcap=30.0, return_lse=True)
    same = attnx.scaled_dot_product_attention_backward(
        np.ones_like(out), q, k, v, saved[0], saved[1], bias, sinks=sinks, softcap=30.0)
    dq: F32 = same.query
    dk: F32 = same.key
    dv: F32 = same.value
    dmask: Optional[F32] = same.attn_mask            # a float mask's gradient; None for bool
    dsinks: Optional[F32] = same.sinks               # None without sinks
    assert dmask is not None and dmask.shape == bias.shape
    assert dsinks is not None and dsinks.shape == sinks.shape
    assert np.array_equal(dq, g.query) and np.array_equal(dk, g.key) and np.array_equal(dv, g.value)
    ref: attnx.AttentionGrads = attnx.reference_backward(
        np.ones_like(out), q, k, v, bias, sinks=sinks, softcap=30.0)
    assert float(np.max(np.abs(ref.query - dq))) < 1e-3
    return g


def main() -> None:
    rng = np.random.default_rng(0)

    # (B, H, L, E) with grouped-query attention and a bool mask, True = may attend
    q: F32 = rng.standard_normal((2, 8, 16, 32), dtype=np.float32)
    k: F32 = rng.standard_normal((2, 2, 16, 32), dtype=np.float32)
    v: F32 = rng.standard_normal((2, 2, 16, 24), dtype=np.float32)
    pad: NDArray[np.bool_] = attnx.padding_mask([16, 9], 16)                # (B, Lk)
    mask: NDArray[np.bool_] = pad[:, None, None, :] & attnx.causal_mask(16)  # (B, 1, Lq, Lk)
    out: F32 = attnx.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    ref: NDArray[np.float64] = attnx.reference(q, k, v, mask, enable_gqa=True)
    assert out.shape == (2, 8, 16, 24)
    ref_w: tuple[NDArray[np.float64], NDArray[np.float64]] = attnx.reference(
        q, k, v, mask, enable_gqa=True, need_weights=True, window=(4, 0), softcap=30.0)
    assert ref_w[1].shape == (2, 8, 16, 16)
    assert float(np.max(np.abs(out - ref))) < 1e-4

    # (B, L, H, E), what a projection reshaped gives; lists work as lengths
    x = rng.standard_normal((2, 16, 4, 8), dtype=np.float32)
    blhd: F32 = attnx.scaled_dot_product_attention(x, x, x, layout="blhd", key_lengths=[16, 5])
    assert blhd.shape == x.shape

    # a need_weights that is only known at run time: a union to narrow
    want = len(q) > 1
    res = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, need_weights=want)
    if isinstance(res, tuple):
        _, w = res
        assert w.shape == (2, 8, 16, 16)
    res_lse: Union[F32, tuple[F32, F32], tuple[F32, F32, F32]] = attnx.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, need_weights=want, return_lse=want)
    assert isinstance(res_lse, tuple) and len(res_lse) == 3

    # a tutorial's example sentence through a GloVe-sized layer
    tokens = "The animal didn't cross the street because it was too tired".split()
    emb: F32 = rng.standard_normal((2, len(tokens), 50), dtype=np.float32)
    mha = attnx.MultiHeadAttention(50, 8, seed=0)                 # d_head = 6
    d_head: int = mha.d_head
    W_q: F32 = mha.W_q
    assert W_q.shape == (50, 8 * d_head)
    y = encode(mha, emb, [len(tokens), 7])
    z, w_avg = cross_attend(mha, y, emb[:, :5])
    assert z.shape == (2, len(tokens), 50) and w_avg.shape == (2, len(tokens), 5)
    step = decode_step(q[:, :, -1:], q, q)
    assert step.shape == (2, 8, 1, 32)
    o, wts = attention_with_weights(emb[0], attnx.causal_mask(len(tokens)))
    assert o.shape == (len(tokens), 50) and wts.shape == (len(tokens), len(tokens))
    loss = sgd_step(mha, emb, 1e-3)
    assert sgd_step(mha, emb, 1e-3) < loss                    # the step went downhill
    mha_var: F32 = mha(emb, is_causal=True, window=(3, 0), sinks=np.zeros(8, np.float32),
                       softcap=30.0, alibi_slopes=np.full(8, 0.5, np.float32))
    assert mha_var.shape == emb.shape
    mha_res: Union[F32, tuple[F32, F32]] = mha(emb, need_weights=want, key_lengths=[7, 5])
    assert isinstance(mha_res, tuple) and mha_res[1].shape == (2, 8, len(tokens), len(tokens))

    # the variants: sliding window, sinks, soft-capping, ALiBi, and their alignment
    sinks: F32 = np.zeros(8, np.float32)
    slopes: F32 = 2.0 ** -np.arange(1, 9, dtype=np.float32)
    var: F32 = attnx.scaled_dot_product_attention(
        q, k, v, is_causal="lower_right", enable_gqa=True, window=(4, None), sinks=sinks,
        softcap=50.0, alibi_slopes=slopes, alignment="lower_right")
    assert var.shape == out.shape
    win: F32 = attnx.scaled_dot_product_attention(q, q, q, window=(2, 2), alignment="upper_left")
    assert win.shape == q.shape

    # out and lse (what the backward and merge_attention take), and all three
    o_lse: tuple[F32, F32] = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                                return_lse=True)
    assert o_lse[1].shape == (2, 8, 16)
    o_w_lse: tuple[F32, F32, F32] = attnx.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, need_weights=True, return_lse=True)
    assert o_w_lse[1].shape == (2, 8, 16, 16)
    merged, merged_lse = chunked(q, q, q, 5)
    assert float(np.max(np.abs(merged - attnx.scaled_dot_product_attention(q, q, q)))) < 1e-5
    assert float(np.max(np.abs(merged_lse - chunked(q, q, q, 16)[1]))) < 1e-4

    # gradients, with a float mask (an additive bias) and sinks
    bias: F32 = rng.standard_normal((16, 16), dtype=np.float32)
    g = gradients(q[:, :2], q[:, :2], q[:, :2], bias, np.zeros(2, np.float32))
    assert g.query.shape == (2, 2, 16, 32)

    # a packed batch of sequences of different lengths (flash-attn's varlen layout)
    seqs: F32 = rng.standard_normal((3, 10, 4, 8), dtype=np.float32)     # (B, L, H, E)
    packed, cu = attnx.pack(seqs, [10, 3, 6])
    cu_seqlens: NDArray[np.int64] = cu
    qkv: F32 = packed.astype(np.float32)
    vl: F32 = attnx.varlen_attention(qkv, qkv, qkv, cu_seqlens, cu_seqlens, is_causal=True,
                                     window=(3, 0), softcap=20.0)
    # return_lse is typed `bool` here (no Literal[True] overload): a union to narrow
    vl_res: Union[F32, tuple[F32, F32]] = attnx.varlen_attention(
        qkv, qkv, qkv, cu_seqlens, cu_seqlens, is_causal=True, window=(3, 0), softcap=20.0,
        return_lse=True)
    assert isinstance(vl_res, tuple) and vl_res[1].shape == (4, 19)
    vl_out, vl_vjp = attnx.varlen_attention_vjp(qkv, qkv, qkv, cu_seqlens, cu_seqlens,
                                                is_causal=True, sinks=np.zeros((3, 4), np.float32))
    vl_pullback: Grads = vl_vjp
    vl_grads: attnx.AttentionGrads = vl_pullback(np.ones_like(vl_out))
    assert vl_grads.attn_mask is None and vl_grads.sinks is not None
    assert vl_grads.query.shape == qkv.shape and vl_grads.sinks.shape == (3, 4)
    padded: NDArray[np.float32] = attnx.unpack(vl, cu_seqlens, max_len=10)
    assert padded.shape == (3, 10, 4, 8) and np.array_equal(vl, attnx.pack(padded, [10, 3, 6])[0])

    # decoding with a KV cache: the prompt, then one token at a time
    cache = attnx.KVCache(batch=2, heads=2, max_len=24, head_dim=32, value_dim=24)
    cache.append(k, v)
    prompt: F32 = cache.attend(q, window=(8, None))
    full: F32 = attnx.scaled_dot_product_attention(q, k, v, is_causal="lower_right",
                                                   enable_gqa=True, window=(8, None))
    assert prompt.shape == out.shape and float(np.max(np.abs(prompt - full))) < 1e-6
    for _ in range(3):
        cache.append(k[:, :, -1:], v[:, :, -1:])
        new: F32 = cache.attend(q[:, :, -1:], sinks=np.zeros(8, np.float32))
        assert new.shape == (2, 8, 1, 24)
    step_lse: tuple[F32, F32] = cache.attend(q[:, :, -1:], return_lse=True)
    step_w: tuple[F32, F32] = cache.attend(q[:, :, -1:], need_weights=True)
    step_all: tuple[F32, F32, F32] = cache.attend(q[:, :, -1:], need_weights=True, return_lse=True)
    cached: NDArray[np.int64] = cache.lengths
    assert step_lse[1].shape == (2, 8, 1) and step_w[1].shape == (2, 8, 1, 19)
    assert step_all[2].shape == (2, 8, 1) and cached.tolist() == [19, 19]

    attnx.set_num_threads(1)
    threads: int = attnx.get_num_threads()
    isa: str = attnx.isa()
    attnx.set_num_threads(0)
    version: str = attnx.__version__
    print(f"attnx {version}: {isa}, {threads} thread(s), max |out - ref| ok")


if __name__ == "__main__":
    main()
