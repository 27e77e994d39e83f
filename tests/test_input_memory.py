"""How the inputs are read: strided, reversed, misaligned, big-endian,
broadcast, read-only and nested-list inputs give the contiguous inputs' bits;
the inputs are never modified, the outputs are fresh arrays, and no
reference is leaked. On every ISA."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

import attnx
from conftest import (assert_close, check_against_reference, make_qkv, naive, randn,
                      random_bool_mask, random_float_mask)

sdpa = attnx.scaled_dot_product_attention


# ------------------------------------------------------ non-contiguous views

def _view(rng, kind, shape):
    """A float32 view of ``shape`` whose memory layout is given by ``kind``."""
    B, H, L, E = shape
    if kind == "step_slice":
        return randn(rng, (B, H * 2, L * 3, E))[:, ::2, ::3, :]
    if kind == "swapped_batch_head":
        return np.swapaxes(randn(rng, (H, B, L, E)), 0, 1)
    if kind == "negative_strides":
        return randn(rng, shape)[::-1, :, ::-1, :]
    if kind == "last_axis_step":
        return randn(rng, (B, H, L, 2 * E))[..., ::2]
    if kind == "last_axis_reversed":
        return randn(rng, shape)[..., ::-1]
    if kind == "fortran":
        return np.asfortranarray(randn(rng, shape))
    if kind == "transposed_L_E":
        return np.swapaxes(randn(rng, (B, H, E, L)), -1, -2)
    if kind == "offset_4_bytes":       # aligned to float, not to any vector width
        base = np.empty(B * H * L * E + 1, dtype=np.float32)
        a = base[1:].reshape(shape)
        a[...] = randn(rng, shape)
        return a
    if kind == "unaligned_bytes":      # not even aligned to 4 bytes
        buf = np.zeros(4 * B * H * L * E + 1, dtype=np.uint8)[1:]
        a = np.ndarray(shape, dtype=np.float32, buffer=buf)
        a[...] = randn(rng, shape)
        return a
    if kind == "big_endian":
        return randn(rng, shape).astype(">f4")
    if kind == "broadcast_batch":      # stride 0 on the batch axis
        return np.broadcast_to(randn(rng, (1, H, L, E)), shape)
    raise AssertionError(kind)


VIEW_KINDS = ["step_slice", "swapped_batch_head", "negative_strides", "last_axis_step",
              "last_axis_reversed", "fortran", "transposed_L_E", "offset_4_bytes",
              "unaligned_bytes", "big_endian", "broadcast_batch"]


@pytest.mark.parametrize("kind", VIEW_KINDS)
def test_non_contiguous_views(isa, rng, kind):
    B, H, Lq, Lk, E, Ev = 2, 3, 5, 19, 17, 9
    q = _view(rng, kind, (B, H, Lq, E))
    k = _view(rng, kind, (B, H, Lk, E))
    v = _view(rng, kind, (B, H, Lk, Ev))
    if kind == "unaligned_bytes":
        assert not q.flags.aligned
    elif kind not in ("big_endian", "fortran", "broadcast_batch", "offset_4_bytes"):
        assert not q.flags.c_contiguous
    mask = random_bool_mask(rng, (Lk, Lq)).T            # a transposed mask view
    fmask = random_float_mask(rng, (B, 1, Lq, 2 * Lk))[..., ::-2]   # negative stride
    for m in (mask, fmask):
        out, w = check_against_reference(q, k, v, attn_mask=m, need_weights=True)
        contiguous = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v)]
        o_n, w_n = (naive(*contiguous, allowed=m.copy()) if m.dtype == bool
                    else naive(*contiguous, add=m.copy()))
        assert_close(out, o_n)
        assert_close(w, w_n)
        # strides change nothing in the arithmetic: bit-identical to contiguous copies
        out_c, w_c = sdpa(*contiguous, attn_mask=np.ascontiguousarray(m), need_weights=True)
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(w, w_c)


def test_query_rows_too_far_apart_for_int32_gathers(isa, rng):
    """Query rows 600 MB apart: the SIMD packer gathers a column of 16 rows
    with int32 element offsets, which cannot reach row 15; the core must fall
    back to the scalar packer, not wrap around (that read out of bounds and
    crashed). The rows live in a lazily mapped 9 GB region: only the touched
    pages take memory."""
    Lq, E, row = 16, 24, 150_000_000                      # 15 * row > 2**31
    region = mmap.mmap(-1, 4 * (row * (Lq - 1) + E))
    base = np.frombuffer(region, dtype=np.float32)
    q = np.lib.stride_tricks.as_strided(base, (1, 1, Lq, E), (0, 0, row * 4, 4))
    q[...] = randn(rng, (1, 1, Lq, E))                    # writes the rows, not the gaps
    k, v = randn(rng, (1, 1, 33, E)), randn(rng, (1, 1, 33, 7))
    out = sdpa(q, k, v)
    np.testing.assert_array_equal(out, sdpa(np.ascontiguousarray(q), k, v))
    check_against_reference(q, k, v)
    del q, base


def test_read_only_inputs(isa, rng):
    q, k, v = make_qkv(rng)
    mask = random_bool_mask(rng, (5, 7))
    kl = np.array([7, 3])
    for a in (q, k, v, mask, kl):
        a.flags.writeable = False
    check_against_reference(q, k, v, attn_mask=mask, key_lengths=kl, need_weights=True)


def test_nested_lists(isa, rng):
    q, k, v = make_qkv(rng, B=(), Hq=4, Lq=3, Lk=5, E=4)
    out = sdpa(q.tolist(), k.tolist(), v.tolist(), attn_mask=np.ones((3, 5), bool).tolist())
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, sdpa(q, k, v))


# ----------------------------------------- inputs untouched, outputs fresh

def test_inputs_not_modified(isa, rng):
    q = _view(rng, "negative_strides", (2, 3, 6, 16))
    k, v = randn(rng, (2, 3, 9, 16)), randn(rng, (2, 3, 9, 7)).astype(np.float64)
    q[0, 0, 0, 0] = np.nan
    mask = random_float_mask(rng, (3, 6, 9))
    kl, ql = np.array([9, 2]), np.array([6, 3], dtype=np.int32)
    args = [q, k, v, mask, kl, ql]
    copies = [a.copy() for a in args]
    for _ in range(2):
        for nw in (False, True):
            sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", key_lengths=kl,
                 query_lengths=ql, need_weights=nw)
    qb = np.ascontiguousarray(np.swapaxes(q, 1, 2))
    qb_copy = qb.copy()
    sdpa(qb, np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2), layout="blhd")
    for a, c in zip(args + [qb], copies + [qb_copy]):
        assert a.dtype == c.dtype
        assert np.array_equal(a, c, equal_nan=a.dtype.kind == "f"), "an input was modified"


def test_output_is_fresh(isa, rng):
    q, k, v = make_qkv(rng)
    out, w = sdpa(q, k, v, need_weights=True)
    for a in (q, k, v):
        assert not np.shares_memory(out, a) and not np.shares_memory(w, a)
    assert out.flags.writeable and w.flags.writeable
    out2 = sdpa(q, k, v)
    assert not np.shares_memory(out, out2)


def test_no_reference_leaks(rng):
    q, k, v = make_qkv(rng, Lq=4, Lk=6, E=8)
    q = q[:, :, ::-1]                          # a view: the glue handles its base
    mask = random_bool_mask(rng, (4, 6))
    kl, ql = np.array([6, 2]), np.array([4, 1])
    objs = [q, q.base, k, v, mask, kl, ql]
    sdpa(q, k, v, attn_mask=mask, key_lengths=kl, query_lengths=ql, need_weights=True)
    before = [sys.getrefcount(o) for o in objs]
    for _ in range(50):
        out, w = sdpa(q, k, v, attn_mask=mask, key_lengths=kl, query_lengths=ql, need_weights=True)
    del out, w
    assert [sys.getrefcount(o) for o in objs] == before
    out = sdpa(q, k, v)
    rc = sys.getrefcount(out)
    assert rc == 2, f"the result holds {rc - 2} extra reference(s)"
