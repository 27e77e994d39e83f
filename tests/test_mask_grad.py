"""The gradient of a float mask, summed over its broadcast axes inside the backward.

The core adds dS into the mask's gradient along the axes the mask repeats
(stride 0 in the view attnx/_grad.py hands it), in one of three ways
(csrc/core/backward.c, ``plan_mask_grad``):

* directly, when no two items of the backward share an element of it;
* into per-item copies summed afterwards in a fixed order, when items of
  other batches, key/value heads or key ranges share elements and the copies
  are small (at most 4 MiB);
* in a pass of its own over the gradient's (batch, head, query block), when
  the copies would be larger (a (1, 1, L, L) mask over several heads).

Each case below names the way its shapes take; each is checked against the
float64 ``attnx.reference_backward`` with a random upstream gradient, on every
ISA and at 1, 2 and 3 threads, and repeated calls give the same bits. The
memory test holds the backward with a broadcast float mask to the same call
with a bool mask plus the mask's own size plus 8 MiB.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import attnx
from conftest import GATOL, GRTOL, assert_close, randn, random_float_mask, under_asan


# (B, Hq, Hk, Lq, Lk, mask shape, the way the core takes at 2 threads)
CASES = [
    (2, 3, 3, 70, 140, (2, 3, 70, 140), "direct: the mask is the scores' shape"),
    (2, 4, 2, 70, 140, (2, 1, 70, 140), "copies: key/value heads share the mask"),
    (3, 2, 2, 33, 200, (1, 2, 33, 200), "copies: batches share the mask"),
    (2, 4, 4, 65, 300, (2, 1, 1, 300), "copies: a padding mask over heads and queries"),
    (1, 2, 1, 40, 600, (1, 1, 40, 1), "copies: key ranges share a mask broadcast over keys"),
    (1, 6, 6, 300, 600, (300, 600), "copies: a 2-D mask over six heads, 5 copies of 0.7 MiB"),
    (1, 8, 8, 400, 512, (400, 512), "own pass: a 2-D mask over eight heads"),
    (3, 2, 1, 600, 1000, (1, 1, 600, 1000), "own pass: batches share a mask, MQA"),
    (1, 1, 1, 50, 90, (50, 90), "direct: one head"),
    (2, 3, 3, 1, 1, (1,), "copies: a single scalar mask"),
]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=[c[-1] for c in CASES])
def test_mask_gradient_summed_in_the_backward(isa, rng, case, threads):
    B, Hq, Hk, Lq, Lk, mshape, _ = case
    q = randn(rng, (B, Hq, Lq, 8))
    k, v = randn(rng, (B, Hk, Lk, 8)), randn(rng, (B, Hk, Lk, 5))
    mask = random_float_mask(rng, mshape)
    kw = dict(attn_mask=mask, enable_gqa=Hq != Hk, is_causal="lower_right" if Lk % 2 else False)
    dout = randn(rng, (B, Hq, Lq, 5))
    previous = attnx.get_num_threads()
    attnx.set_num_threads(threads)
    try:
        out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
        got, again = vjp(dout), vjp(dout)
    finally:
        attnx.set_num_threads(previous)
    ref = attnx.reference_backward(dout, q, k, v, **kw)
    assert got.attn_mask.shape == mshape and got.attn_mask.dtype == np.float32
    # a mask gradient sums up to B·Hq·Lq·Lk terms of dS: the tolerance grows as a random walk
    terms = B * Hq * Lq * Lk / mask.size
    assert_close(got.attn_mask, ref.attn_mask, GATOL * np.sqrt(terms), GRTOL,
                 err_msg="attn_mask")
    for name in ("query", "key", "value"):
        assert_close(getattr(got, name), getattr(ref, name), GATOL, GRTOL, err_msg=name)
    assert got.attn_mask.tobytes() == again.attn_mask.tobytes()


def test_strided_batches_and_lengths(isa, rng):
    """A 5-D batch whose mask is broadcast over the second batch axis: the
    batch axes do not fold, the core is called once per index of the first,
    each call adding into the same gradient; with key and query lengths, GQA
    and blhd."""
    q = randn(rng, (2, 3, 70, 4, 8))
    k, v = randn(rng, (2, 3, 150, 2, 8)), randn(rng, (2, 3, 150, 2, 8))
    mask = random_float_mask(rng, (2, 1, 1, 70, 150))
    kw = dict(attn_mask=mask, enable_gqa=True, layout="blhd",
              key_lengths=[[150, 90, 3], [0, 150, 149]], query_lengths=[[70, 1, 64], [65, 0, 70]])
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
    dout = randn(rng, out.shape)
    got, ref = vjp(dout), attnx.reference_backward(dout, q, k, v, **kw)
    assert_close(got.attn_mask, ref.attn_mask, GATOL * np.sqrt(3 * 4), GRTOL)
    assert_close(got.query, ref.query, GATOL, GRTOL)


def test_mask_grad_false_skips_it(rng):
    q, k, v = (randn(rng, (1, 2, 20, 8)) for _ in range(3))
    mask = random_float_mask(rng, (20, 20))
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    dout = randn(rng, out.shape)
    g = attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, attn_mask=mask,
                                                    mask_grad=False)
    full = attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, attn_mask=mask)
    assert g.attn_mask is None and full.attn_mask is not None
    assert g.query.tobytes() == full.query.tobytes()
    with pytest.raises(TypeError, match="mask_grad"):
        attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, mask_grad="no")


def _peak(f):
    """Peak bytes that NumPy allocated while f() ran (tracemalloc sees NumPy's data)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        f()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.skipif(under_asan(), reason="memory is measured; ASan's allocator changes it")
@pytest.mark.parametrize("mshape", [(1, 1, 1, 1536), (1, 1, 1536, 1536)])
def test_float_mask_backward_memory(rng, mshape):
    """Issue 18's target: a broadcast float mask costs no more than the same call
    with a bool mask plus the mask's own size plus 8 MiB (it was a full
    (B, H, Lq, Lk) float32 array: 72 MiB here)."""
    H, L = 8, 1536
    q, k, v = (randn(rng, (1, H, L, 16)) for _ in range(3))
    fmask = np.where(rng.random(mshape) < 0.9, 0.0, -np.inf).astype(np.float32)
    bmask = fmask == 0
    peaks = {}
    for name, m in (("bool", bmask), ("float", fmask)):
        out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, attn_mask=m)
        dout = randn(rng, out.shape)
        peaks[name] = _peak(lambda: vjp(dout))
    assert peaks["float"] <= peaks["bool"] + fmask.nbytes + 8 * 2**20, peaks


@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_however_the_batch_is_cut_into_calls(isa, rng, threads):
    """A mask shared by a 2 x 3 batch and 4 heads: one call over the folded batch
    sums it in a pass of its own (24 copies of 250 x 250 would pass 4 MiB), while
    a dout whose first batch axis runs backwards cannot be folded and takes one
    call per index of it, each summing into copies. Both add each (batch, key/value
    head)'s sum into the gradient in the same order: the same bits (a fuzzer
    finding)."""
    q, k, v = (randn(rng, (2, 3, 4, 250, 8)) for _ in range(3))
    mask = random_float_mask(rng, (250, 250))
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    dout = randn(rng, out.shape)
    backwards = np.flip(np.flip(dout, 0).copy(), 0)          # the same values, stride < 0
    assert backwards.strides[0] < 0 and np.array_equal(backwards, dout)
    previous = attnx.get_num_threads()
    attnx.set_num_threads(threads)
    try:
        one = attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, attn_mask=mask)
        cut = attnx.scaled_dot_product_attention_backward(backwards, q, k, v, out, lse,
                                                          attn_mask=mask)
    finally:
        attnx.set_num_threads(previous)
    for name in ("attn_mask", "query", "key", "value"):
        assert getattr(one, name).tobytes() == getattr(cut, name).tobytes(), name


@pytest.mark.parametrize("mshape", [(4, 0, 1, 1), (4, 1, 1, 1), (1,)])
def test_no_query_heads(isa, rng, mshape):
    """Hq = 0 (a multiple of any head count) with a float mask summed over heads: no
    score, nothing written (ASan under the fuzzer found the merge writing one
    element of an empty gradient)."""
    q, k, v = randn(rng, (4, 0, 1, 5)), randn(rng, (4, 3, 1, 5)), randn(rng, (4, 3, 1, 0))
    mask = randn(rng, mshape)
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, attn_mask=mask, enable_gqa=True)
    g = vjp(randn(rng, out.shape))
    assert g.attn_mask.shape == mshape and not g.attn_mask.any()
    assert g.key.shape == k.shape and not g.key.any()
