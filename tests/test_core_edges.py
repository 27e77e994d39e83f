"""Regression tests at the edges of what the core computes: lengths changed
by another thread while the GIL is released, broadcast masks over several
batch axes, scales whose pre-scaled queries would overflow, and which tiny
weights are flushed to zero."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnx
from attnx import _attnx
from attnx._args import attention_args
from attnx._functional import _core_calls

from conftest import assert_close, make_qkv, randn


# ------------------------------------------- lengths written during a call

RACE = textwrap.dedent("""
    import threading, time, numpy as np, attnx
    from attnx import _attnx
    q = np.random.default_rng(0).standard_normal((2, 4, 2048, 32), dtype=np.float32)
    kl = np.array([2048, 2048]); ql = np.array([2048, 2048])
    stop = False
    def writer(a, L):
        while not stop:
            a[0] = 10**15; a[1] = -10**15; a[0] = L; a[1] = L // 2
    for a in (kl, ql):
        threading.Thread(target=writer, args=(a, 2048), daemon=True).start()
    t0 = time.time()
    while time.time() - t0 < {seconds}:
        try:   # the Python checks may see a bad value and refuse it: fine
            out = attnx.scaled_dot_product_attention(q, q, q, key_lengths=kl, query_lengths=ql)
            out, w = attnx.scaled_dot_product_attention(q[:, :, :100], q, q[..., :8],
                                                        key_lengths=kl, need_weights=True)
        except ValueError as e:
            assert "must lie in" in str(e) or "length lies outside" in str(e), e
        # the private entry point reads the lengths array the caller gives it,
        # in place: the core itself must clamp what it reads
        k2 = np.broadcast_to(kl[:, None], (2, 4))
        out = np.empty((2, 4, 2048, 32), np.float32)
        try:   # the core validates first, then reads the lengths again
            _attnx.forward(q, q, q, out, None, None, k2, np.broadcast_to(ql[:, None], (2, 4)),
                           2, 0.1)
            _attnx.forward(q[:, :, :1], q, q, out[:, :, :1], None, None, k2, None, 1, 0.1)
        except ValueError as e:
            assert "length lies outside" in str(e), e
    stop = True
    print("ok")
""")


def test_lengths_written_by_another_thread_never_crash():
    """A thread rewrites key_lengths/query_lengths with absurd values while the
    core runs without the GIL: wrong numbers are allowed, a crash is not."""
    r = subprocess.run([sys.executable, "-c", RACE.format(seconds=3)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


# ------------------------------------ broadcast masks over two batch axes

def test_mask_broadcast_over_two_batch_axes_is_not_expanded():
    """A (2, 1, 1, L, L) mask over (2, 4, 8, L, E) inputs is read through its
    strides, never expanded to (2, 4, 8, L, L) (+256 MiB)."""
    code = textwrap.dedent("""
        import resource, numpy as np, attnx
        q = np.random.rand(2, 4, 8, 1024, 32).astype('f4')
        m = np.random.rand(2, 1, 1, 1024, 1024).astype('f4')
        attnx.scaled_dot_product_attention(q[:, :, :, :8], q, q, attn_mask=m[..., :8, :])  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = attnx.scaled_dot_product_attention(q, q, q, attn_mask=m)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    grew_mib = int(r.stdout.strip())
    assert grew_mib < 64, f"peak RSS grew {grew_mib} MiB (the expanded mask is 256 MiB)"


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 5, 7), (1, 3, 1, 5, 7), (2, 3, 1, 1, 7),
                                        (1, 1, 4, 5, 7), (2, 1, 4, 5, 1), (5, 7)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_over_batch_axes_are_views(rng, mask_shape, kind):
    """Every core call reads the caller's mask memory (no copy), and the result
    equals the float64 reference."""
    q, k, v = make_qkv(rng, B=(2, 3), Hq=4, Lq=5, Lk=7, E=8)
    m = rng.random(mask_shape) > 0.3 if kind == "bool" else randn(rng, mask_shape)
    p = attention_args(q, k, v, m, 0.0, False, None, False, layout="bhld").astype(np.float32)
    out = np.empty((2, 3, 4, 5, 8), np.float32)
    calls = list(_core_calls(p, out, None))
    for c in calls:
        assert np.shares_memory(c.mask, m) and np.shares_memory(c.out, out)
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert_close(got, attnx.reference(q, k, v, attn_mask=m))


def test_strided_batch_axes_are_read_in_place(rng):
    """Inputs whose batch axes do not fold into one (a step along the second)
    are read in place, one core call per index of the first axis."""
    big = randn(rng, (2, 7, 4, 9, 8))
    q, k, v = big[:, 0:6:2], big[:, 1:7:2], big[:, 0:6:2, :, :, :4]
    kl = np.array([[9, 3, 0], [1, 9, 5]])
    p = attention_args(q, k, v, None, 0.0, True, None, False, layout="bhld",
                       key_lengths=kl).astype(np.float32)
    out = np.empty((2, 3, 4, 9, 4), np.float32)
    calls = list(_core_calls(p, out, None))
    assert len(calls) == 2 and all(np.shares_memory(c.q, big) for c in calls)
    for layout in ("bhld", "blhd"):
        a = [np.swapaxes(x, -2, -3) if layout == "blhd" else x for x in (q, k, v)]
        got, w = attnx.scaled_dot_product_attention(*a, is_causal=True, key_lengths=kl,
                                                    layout=layout, need_weights=True)
        ref, rw = attnx.reference(*a, is_causal=True, key_lengths=kl, layout=layout,
                                  need_weights=True)
        assert_close(got, ref)
        assert_close(w, rw)


# -------------------------------------------------- large finite scales

def test_large_scale_whose_scores_fit(isa):
    """scale * q overflows float32 but every score fits: the reference's result."""
    q = np.array([[[[1e3, 0]]]], "f4")
    k = np.array([[[[1e-3, 0], [2e-3, 0]]]], "f4")
    v = np.array([[[[1.0], [2.0]]]], "f4")
    got = attnx.scaled_dot_product_attention(q, k, v, scale=1e36)
    np.testing.assert_array_equal(got, attnx.reference(q, k, v, scale=1e36).astype(np.float32))
    np.testing.assert_array_equal(got, [[[[2.0]]]])


@pytest.mark.parametrize("Lq", [1, 3, 70])       # the dot-product path and the tiled one
@pytest.mark.parametrize("scale", [1.5, -4.0, 3e30])
def test_scales_above_one(isa, rng, Lq, scale):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=Lq, Lk=150, E=16)
    q = q / np.float32(max(1.0, abs(scale)) * 4)     # scores stay well-scaled
    m = randn(rng, (Lq, 150))
    for kw in ({}, {"attn_mask": m}, {"is_causal": "lower_right"}):
        out, w = attnx.scaled_dot_product_attention(q, k, v, scale=scale, need_weights=True, **kw)
        ref, rw = attnx.reference(q, k, v, scale=scale, need_weights=True, **kw)
        assert_close(out, ref)
        assert_close(w, rw)
        assert_close(attnx.scaled_dot_product_attention(q, k, v, scale=scale, **kw), ref)


# ----------------------------------------------- which weights are flushed

def test_flushed_weights_agree_with_the_reference(isa):
    """A weight exp(s - max) below e^EXP_FLUSH_BELOW is exactly 0 in the kernels
    and in attnx.reference: an inf value behind it is dropped by both; just
    above the threshold it is kept by both."""
    assert _attnx.EXP_FLUSH_BELOW == pytest.approx(-87.3365, abs=1e-4)
    q = np.array([[1.0]], "f4")
    v = np.array([[1.0], [np.inf]], "f4")
    for s, want in ((-93.6, 1.0), (-87.0, np.inf), (-88.0, 1.0)):
        k = np.array([[0.0], [s]], "f4")
        got = attnx.scaled_dot_product_attention(q, k, v, scale=1.0)
        ref = attnx.reference(q, k, v, scale=1.0)
        assert got[0, 0] == want and ref[0, 0] == want, (s, got, ref)
    # the same in the weights, on a tile of many queries
    q = np.ones((80, 1), "f4")
    k = np.array([[0.0], [-87.0], [-88.0]], "f4")
    _, w = attnx.scaled_dot_product_attention(q, k, k, scale=1.0, need_weights=True)
    _, rw = attnx.reference(q, k, k, scale=1.0, need_weights=True)
    assert (w[:, 1] > 0).all() and (w[:, 2] == 0).all() and (rw[:, 2] == 0).all()
