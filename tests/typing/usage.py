"""A small, realistic use of attnx's public API, type-checked by tests/test_typing.py.

``mypy --strict tests/typing/usage.py`` must pass: the annotations of attnx
(and the stub of its C extension) are what an editor and a type checker see.
Every result is assigned to an explicitly typed name, so a return type that
regressed to ``Any`` or to a union would make mypy fail. The file also runs
(``python tests/typing/usage.py``), so it stays real code.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

import attnx

F32 = NDArray[np.float32]


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

    attnx.set_num_threads(1)
    threads: int = attnx.get_num_threads()
    isa: str = attnx.isa()
    attnx.set_num_threads(0)
    version: str = attnx.__version__
    print(f"attnx {version}: {isa}, {threads} thread(s), max |out - ref| ok")


if __name__ == "__main__":
    main()
