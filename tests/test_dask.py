"""attnx.dask: attention on dask arrays against attnx.scaled_dot_product_attention.

Every result is compared with the NumPy function on the computed inputs
(atol 2e-6, rtol 1e-5: the merge of key blocks rounds differently), with the
threaded scheduler, and a few on a two-process dask.distributed cluster. The
graph of a causal key-chunked call holds no block above the diagonal, and
building the array computes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import attnx  # noqa: E402
import attnx.dask as adask  # noqa: E402

ATOL, RTOL = 2e-6, 1e-5


@pytest.fixture(autouse=True)
def _threads():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                       dashboard_address=None)
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()


def _rng(*seed):
    return np.random.default_rng(list(seed))


def _qkv(rng, q_shape, k_shape, ev=None):
    ev = k_shape[-1] if ev is None else ev
    q = rng.standard_normal(q_shape, dtype=np.float32)
    k = rng.standard_normal(k_shape, dtype=np.float32)
    v = rng.standard_normal(k_shape[:-1] + (ev,), dtype=np.float32)
    return q, k, v


def _check(q, k, v, q_chunks, k_chunks, v_chunks=None, mask=None, mask_chunks=None, **kw):
    """The dask call on chunked copies of q, k, v (and mask) equals the NumPy call."""
    m = None if mask is None else (mask if mask_chunks is None else da.from_array(mask, mask_chunks))
    out = adask.scaled_dot_product_attention(
        da.from_array(q, q_chunks), da.from_array(k, k_chunks),
        da.from_array(v, k_chunks if v_chunks is None else v_chunks), attn_mask=m, **kw)
    expected = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert isinstance(out, da.Array)
    assert out.dtype == np.float32 and out.shape == expected.shape
    got = out.compute()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)
    return out


# ------------------------------------------------------------- chunkings

CHUNKINGS = {                         # (q chunks, k chunks) for (2, 4, 37, 16) / (2, 4, 53, 16)
    "whole": ((2, 4, 37, 16), (2, 4, 53, 16)),
    "batch_heads": ((1, 2, 37, 16), (1, 2, 53, 16)),
    "queries": ((2, 4, 10, 16), (2, 4, 53, 16)),
    "keys": ((2, 4, 37, 16), (2, 4, 16, 16)),
    "keys_odd": ((2, 4, 37, 16), (2, 4, 7, 16)),
    "queries_keys": ((2, 4, 10, 16), (2, 4, 16, 16)),
    "all": ((1, 1, 9, 16), (1, 3, 11, 8)),          # k chunks differ from q's: rechunked
}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_chunkings(chunking, is_causal):
    q, k, v = _qkv(_rng(1, len(chunking)), (2, 4, 37, 16), (2, 4, 53, 16))
    cq, ck = CHUNKINGS[chunking]
    _check(q, k, v, cq, ck, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_more_queries_than_keys(is_causal):
    """Lq > Lk: with lower-right causal the first rows see no key (zeros)."""
    q, k, v = _qkv(_rng(2), (1, 2, 53, 8), (1, 2, 37, 8))
    _check(q, k, v, (1, 2, 10, 8), (1, 2, 16, 8), is_causal=is_causal)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(2, 4, 37, 53), (37, 53), (2, 1, 37, 53), (4, 1, 53),
                                        (1, 37, 1)])
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_masks(kind, mask_shape, is_causal):
    rng = _rng(3, len(mask_shape), len(kind))
    q, k, v = _qkv(rng, (2, 4, 37, 16), (2, 4, 53, 16))
    if kind == "bool":
        mask = rng.random(mask_shape) > 0.3
    else:
        mask = rng.standard_normal(mask_shape).astype(np.float32)
        mask[rng.random(mask_shape) < 0.2] = -np.inf
    _check(q, k, v, (1, 2, 10, 16), (1, 2, 16, 16), mask=mask, is_causal=is_causal)


def test_mask_as_chunked_dask_array():
    rng = _rng(4)
    q, k, v = _qkv(rng, (2, 4, 37, 16), (2, 4, 53, 16))
    mask = rng.random((2, 1, 37, 53)) > 0.3
    _check(q, k, v, (1, 2, 10, 16), (1, 2, 16, 16), mask=mask, mask_chunks=(1, 1, 20, 30),
           is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_lengths(is_causal):
    q, k, v = _qkv(_rng(5), (3, 2, 37, 16), (3, 2, 53, 16))
    _check(q, k, v, (2, 1, 10, 16), (1, 2, 16, 16), is_causal=is_causal,
           key_lengths=[53, 20, 0], query_lengths=[37, 11, 5])


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_gqa(is_causal):
    """Query head chunks (3) not a multiple of the group (4): merged to 8."""
    q, k, v = _qkv(_rng(6), (2, 8, 37, 16), (2, 2, 53, 16), ev=12)
    out = _check(q, k, v, (1, 3, 10, 16), (1, 1, 16, 16), (2, 2, 20, 6), enable_gqa=True,
                 is_causal=is_causal, key_lengths=[40, 7])
    assert out.chunks[1] == (8,)


def test_gqa_head_chunks_kept_when_aligned():
    q, k, v = _qkv(_rng(7), (1, 8, 20, 8), (1, 4, 20, 8))
    out = _check(q, k, v, (1, 4, 20, 8), (1, 1, 20, 8), enable_gqa=True, is_causal=True)
    assert out.chunks[1] == (4, 4)


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_blhd(enable_gqa):
    hk = 2 if enable_gqa else 4
    q, k, v = _qkv(_rng(8, enable_gqa), (2, 37, 4, 16), (2, 53, hk, 16))
    _check(q, k, v, (1, 10, 2, 16), (1, 16, 1, 16), layout="blhd", enable_gqa=enable_gqa,
           is_causal="lower_right", key_lengths=[50, 9], sinks=[0.5, 1.0, -1.0, 2.0])


@pytest.mark.parametrize("case", ["2d", "3d", "3d_blhd", "5d"])
def test_other_ranks(case):
    rng = _rng(9, len(case))
    if case == "2d":
        q, k, v = _qkv(rng, (37, 16), (53, 16))
        _check(q, k, v, (10, 16), (16, 16), is_causal=True, key_lengths=40)
    elif case == "3d":                       # (N, L, E): per-N lengths and sinks
        q, k, v = _qkv(rng, (3, 37, 16), (3, 53, 16))
        _check(q, k, v, (1, 10, 16), (2, 16, 16), is_causal=True, key_lengths=[40, 3, 53],
               sinks=[1.0, 2.0, 3.0])
    elif case == "3d_blhd":
        q, k, v = _qkv(rng, (37, 6, 16), (53, 3, 16))
        _check(q, k, v, (10, 2, 16), (16, 1, 16), layout="blhd", enable_gqa=True,
               is_causal=True, key_lengths=40)
    else:
        q, k, v = _qkv(rng, (2, 3, 2, 37, 16), (2, 3, 2, 53, 16))
        _check(q, k, v, (1, 2, 1, 10, 16), (2, 1, 2, 16, 16), mask=rng.random((3, 1, 37, 53)) > 0.2,
               is_causal=True, key_lengths=[[40, 3, 53], [1, 2, 3]])


VARIANTS = {
    "sinks": dict(sinks=[0.5, 1.0, -1.0, 3.0]),
    "sinks_batch": dict(sinks=np.arange(8.0).reshape(2, 4) - 3),
    "softcap": dict(softcap=2.0),
    "window": dict(window=(5, 3)),
    "window_left": dict(window=(6, None)),
    "alibi": dict(alibi_slopes=[0.1, 0.2, 0.5, 1.0]),
    "all": dict(alibi_slopes=[0.1, 0.2, 0.5, 1.0], window=(4, 2), sinks=[1.0, 2.0, 3.0, 4.0],
                softcap=3.0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_variants_key_chunked(variant, is_causal, mask):
    rng = _rng(10, len(variant), len(str(is_causal)), len(str(mask)))
    q, k, v = _qkv(rng, (2, 4, 37, 16), (2, 4, 53, 16))
    m = None
    if mask == "bool":
        m = rng.random((37, 53)) > 0.2
    elif mask == "float":
        m = rng.standard_normal((2, 1, 37, 53)).astype(np.float32)
    kw = dict(VARIANTS[variant])
    if is_causal is False and ("window" in kw or "alibi_slopes" in kw):
        kw["alignment"] = "lower_right"
    _check(q, k, v, (1, 2, 10, 16), (1, 2, 16, 16), mask=m, is_causal=is_causal,
           key_lengths=[50, 20], **kw)


@pytest.mark.parametrize("chunking", ["queries", "keys", "queries_keys", "all"])
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_alibi_with_sinks_split(chunking, is_causal):
    """ALiBi in blocks wholly on one side of the diagonal (a key term as a small
    mask, the row term moved into the lse) and crossing it, with sinks."""
    q, k, v = _qkv(_rng(18, len(chunking)), (2, 4, 37, 16), (2, 4, 53, 16))
    cq, ck = CHUNKINGS[chunking]
    _check(q, k, v, cq, ck, is_causal=is_causal, alibi_slopes=[0.05, 0.25, 0.5, 1.0],
           sinks=[0.5, 1.0, 2.0, -1.0], query_lengths=[30, 37])


def test_sinks_counted_once_when_a_block_sees_no_key():
    """Rows whose first key block is wholly masked still count their sink once:
    the sink is applied after the merge, not given to one key block."""
    rng = _rng(11)
    q, k, v = _qkv(rng, (1, 2, 20, 8), (1, 2, 40, 8))
    mask = np.ones((20, 40), bool)
    mask[:10, :10] = False                   # rows 0-9 see nothing in key block 0
    mask[15, :] = False                      # row 15 sees no key at all: zeros
    out = _check(q, k, v, (1, 2, 20, 8), (1, 2, 10, 8), mask=mask, sinks=[2.0, -1.0])
    assert not out.compute()[0, :, 15].any()


# ---------------------------------------------------------------- the graph

def _block_tasks(x):
    return [key for key in dict(x.__dask_graph__())
            if isinstance(key, tuple) and str(key[0]).startswith(adask.BLOCK_PREFIX)]


@pytest.mark.parametrize("is_causal,Lq,Lk", [(True, 64, 64), ("lower_right", 64, 64),
                                             ("lower_right", 32, 64), (True, 64, 32)])
def test_causal_graph_skips_blocks_above_diagonal(is_causal, Lq, Lk):
    c = 8
    q, k, v = _qkv(_rng(12, Lq, Lk), (1, 2, Lq, 8), (1, 2, Lk, 8))
    out = _check(q, k, v, (1, 2, c, 8), (1, 2, c, 8), is_causal=is_causal)
    off = Lk - Lq if is_causal == "lower_right" else 0
    expected = {(iq, ik) for iq in range(Lq // c) for ik in range(Lk // c)
                if ik * c <= iq * c + c - 1 + off}       # some key of the block on/below the diagonal
    blocks = _block_tasks(out)
    assert {(key[-2], key[-1]) for key in blocks} == expected
    assert len(blocks) == len(expected) < (Lq // c) * (Lk // c)


def test_window_graph_skips_blocks_outside_band():
    q, k, v = _qkv(_rng(13), (1, 1, 64, 8), (1, 1, 64, 8))
    out = _check(q, k, v, (1, 1, 8, 8), (1, 1, 8, 8), window=(8, 0))
    assert len(_block_tasks(out)) == 8 + 7               # the diagonal and the one left of it


def test_lazy_nothing_computed_before_compute(monkeypatch):
    calls = []
    real = attnx.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attnx, "scaled_dot_product_attention", counting)
    q, k, v = _qkv(_rng(14), (1, 2, 32, 8), (1, 2, 32, 8))
    src = [0]

    def source(a):
        src[0] += 1
        return a
    meta = np.empty((0, 0, 0, 0), np.float32)        # (map_blocks would call source on a meta)
    qd, kd, vd = (da.from_array(a, (1, 2, 8, 8)).map_blocks(source, meta=meta) for a in (q, k, v))
    out = adask.scaled_dot_product_attention(qd, kd, vd, is_causal=True, sinks=[1.0, 2.0])
    assert calls == [] and src == [0]
    got = out.compute()
    assert len(calls) == 4 * 5 // 2 * 1 and src[0] > 0    # on/below-diagonal blocks only
    np.testing.assert_allclose(got, real(q, k, v, is_causal=True, sinks=[1.0, 2.0]),
                               atol=ATOL, rtol=RTOL)


def test_numpy_inputs_and_errors():
    q, k, v = _qkv(_rng(15), (1, 2, 16, 8), (1, 2, 16, 8))
    out = adask.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, da.Array)
    np.testing.assert_allclose(out.compute(), attnx.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="same last dimension E"):
        adask.scaled_dot_product_attention(q, k[..., :4], v)
    with pytest.raises(TypeError, match="attn_mask"):
        adask.scaled_dot_product_attention(q, k, v, attn_mask=da.ones((16, 16), dtype=int))
    with pytest.raises(ValueError, match="attn_mask"):
        adask.scaled_dot_product_attention(q, k, v, attn_mask=np.ones((3, 16), bool))
    with pytest.raises(ValueError, match="softcap"):
        adask.scaled_dot_product_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        adask.scaled_dot_product_attention(q, k, v, sinks=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="dropout_p"):
        adask.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_import_attnx_does_not_import_dask():
    import subprocess
    import sys
    code = "import sys, attnx; assert 'dask' not in sys.modules and 'attnx.dask' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -------------------------------------------------------------- distributed

@pytest.mark.parametrize("is_causal", [True, "lower_right"])
def test_distributed(client, is_causal):
    rng = _rng(16, len(str(is_causal)))
    q, k, v = _qkv(rng, (2, 4, 300, 32), (2, 4, 500, 32))
    mask = rng.random((4, 300, 1)) > 0.1
    out = adask.scaled_dot_product_attention(
        da.from_array(q, (1, 2, 64, 32)), da.from_array(k, (1, 2, 128, 32)),
        da.from_array(v, (1, 2, 128, 32)), attn_mask=mask, is_causal=is_causal,
        key_lengths=[480, 200], sinks=[0.1, 0.2, 0.3, 0.4], alibi_slopes=[0.01, 0.02, 0.04, 0.08])
    got = client.compute(out).result()
    expected = attnx.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, key_lengths=[480, 200],
        sinks=[0.1, 0.2, 0.3, 0.4], alibi_slopes=[0.01, 0.02, 0.04, 0.08])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


def test_distributed_gqa_blhd(client):
    q, k, v = _qkv(_rng(17), (2, 256, 8, 16), (2, 256, 2, 16))
    qd, kd, vd = (da.from_array(a, (1, 64, 4, 16)) for a in (q, k, v))
    out = adask.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True,
                                             layout="blhd", window=(100, None), softcap=5.0)
    got = client.compute(out).result()
    expected = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                  layout="blhd", window=(100, None), softcap=5.0)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("is_causal", [True, "lower_right"])
@pytest.mark.parametrize("shapes", [((37, 53), (10, 16)), ((53, 37), (16, 10)), ((40, 41), (8, 8))])
def test_causal_blocks_off_the_corner_build_no_mask(monkeypatch, is_causal, shapes):
    """Causal blocks whose diagonal is not a corner (chunks of different sizes, or
    Lk - Lq not a multiple of the chunk) are split by rows, not given an
    (lq, lk) mask; with a user mask, lengths and sinks too."""
    def no_mask(*args, **kwargs):
        raise AssertionError("a causal block built a position mask")
    monkeypatch.setattr(attnx._dask_blocks, "_position_mask", no_mask)   # what _block calls
    (Lq, Lk), (cq, ck) = shapes
    rng = _rng(19, Lq, cq, len(str(is_causal)))
    q, k, v = _qkv(rng, (2, 2, Lq, 8), (2, 2, Lk, 8))
    _check(q, k, v, (1, 2, cq, 8), (1, 2, ck, 8), mask=rng.random((2, 1, Lq, Lk)) > 0.2,
           is_causal=is_causal, key_lengths=[Lk - 3, 5], query_lengths=[Lq, Lq // 2],
           sinks=[0.5, -1.0])
