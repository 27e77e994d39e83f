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
from conftest import assert_close  # noqa: E402

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


# ------------------------------------------------------------- BlockMask

def _block_mask_check(q, k, v, q_chunks, k_chunks, bm, **kw):
    """The dask call with the BlockMask ``bm`` (lazy: nothing computed) equals
    the NumPy call with it and the float64 reference on its mask
    (``assert_close``); returns the dask array and its result."""
    out = adask.scaled_dot_product_attention(
        da.from_array(q, q_chunks), da.from_array(k, k_chunks), da.from_array(v, k_chunks),
        attn_mask=bm, **kw)
    assert isinstance(out, da.Array)
    got = out.compute()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm, **kw),
                               atol=ATOL, rtol=RTOL)
    assert_close(got, attnx.reference(q, k, v, attn_mask=bm.mask, **kw))
    return out, got


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_block_mask_every_chunking(chunking, kind, is_causal):
    """A BlockMask is cut into blocks as a plain mask is (it raised TypeError
    inside dask): every chunking of the plain-mask tests, every mask shape."""
    rng = _rng(20, len(chunking), len(kind), len(str(is_causal)))
    q, k, v = _qkv(rng, (2, 4, 37, 16), (2, 4, 53, 16))
    cq, ck = CHUNKINGS[chunking]
    for mask_shape in [(2, 4, 37, 53), (37, 53), (2, 1, 37, 53), (4, 1, 53), (1, 37, 1)]:
        if kind == "bool":
            mask = rng.random(mask_shape) > 0.3
        else:
            mask = rng.standard_normal(mask_shape).astype(np.float32)
            mask[rng.random(mask_shape) < 0.2] = -np.inf
        _block_mask_check(q, k, v, cq, ck, attnx.BlockMask(mask), is_causal=is_causal)


def _pairs(out):
    """The (query chunk, key chunk) of every block task of ``out``."""
    return {(key[-2], key[-1]) for key in _block_tasks(out)}


@pytest.mark.parametrize("chunk", [64, 50, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_documents_graph_skips_empty_chunks(chunk, causal):
    """Packed documents: the key chunks a bool BlockMask's map empties for a
    query chunk are not in the graph (where chunks fall on the map's 64x32
    blocks, exactly the chunks the mask keeps nothing of; else a superset);
    a float BlockMask of the same documents keeps every block."""
    L = 320
    q, k, v = _qkv(_rng(21, chunk, causal), (2, 4, L, 16), (2, 4, L, 16))
    bm = attnx.BlockMask.documents([100, 60, 32, 128], causal=causal)
    out, _ = _block_mask_check(q, k, v, (1, 2, chunk, 16), (1, 2, chunk, 16), bm)
    n = -(-L // chunk)
    c = [(i * chunk, min(L, (i + 1) * chunk)) for i in range(n)]
    kept = {(iq, ik) for iq in range(n) for ik in range(n)
            if bm.mask[c[iq][0]:c[iq][1], c[ik][0]:c[ik][1]].any()}
    got = _pairs(out)
    assert kept <= got < {(iq, ik) for iq in range(n) for ik in range(n)}
    if chunk % bm.MAP_ROWS == 0:
        assert got == kept
    assert len(_block_tasks(out)) == 2 * 2 * len(got)     # batch and head chunks alike
    fm = attnx.BlockMask(np.where(bm.mask, 0.0, -np.inf))
    out_f, _ = _block_mask_check(q, k, v, (1, 2, chunk, 16), (1, 2, chunk, 16), fm)
    assert len(_pairs(out_f)) == n * n


def test_block_mask_graph_keeps_a_chunk_any_head_keeps():
    """A block of heads (and batch) keeps a key chunk that one of its heads
    keeps; head chunks that keep nothing of it leave it out."""
    L, c = 128, 64
    mask = np.zeros((2, 4, L, L), bool)
    mask[..., :, :c] = True                    # every head: the first key chunk
    mask[1, 3, c:, c:] = True                  # batch 1, head 3 only: the second, late rows
    q, k, v = _qkv(_rng(22), (2, 4, L, 8), (2, 4, L, 8))
    out, _ = _block_mask_check(q, k, v, (1, 2, c, 8), (1, 2, c, 8), attnx.BlockMask(mask))
    tasks = {key[1:] for key in _block_tasks(out)}
    heavy = {(1, 1, 1, 1)}                     # (batch chunk, head chunk, query chunk, key chunk)
    assert tasks == {(b, h, iq, 0) for b in range(2) for h in range(2) for iq in range(2)} | heavy


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_block_mask_variants_gqa_blhd(variant, kind):
    """With lengths, GQA, the blhd layout and every variant (sinks join rows
    that some skipped chunks leave empty once, after the merge)."""
    rng = _rng(23, len(variant), len(kind))
    Lq, Lk = 150, 200
    q, k, v = _qkv(rng, (2, Lq, 4, 16), (2, Lk, 2, 16))
    keep = attnx.BlockMask.documents([70, 80, 50]).mask[-Lq:]     # lower-right rows
    keep = keep & (rng.random((2, 1, Lq, Lk)) > 0.1)
    keep[0, 0, :5] = False                     # rows that keep no key: zeros
    mask = keep if kind == "bool" else np.where(keep, rng.standard_normal(keep.shape), -np.inf)
    kw = dict(VARIANTS[variant])
    if "window" in kw or "alibi_slopes" in kw:
        kw["alignment"] = "lower_right"
    _block_mask_check(q, k, v, (1, 64, 2, 16), (1, 32, 1, 16), attnx.BlockMask(mask),
                      layout="blhd", enable_gqa=True, key_lengths=[190, 120], **kw)


def test_block_mask_padding_broadcast_over_queries():
    """A padding BlockMask (B, 1, 1, Lk): its map's one row covers every query
    chunk; key chunks wholly in a sequence's padding are left out."""
    q, k, v = _qkv(_rng(27), (2, 2, 200, 8), (2, 2, 256, 8))
    pad = np.ones((2, 1, 1, 256), bool)
    pad[0, ..., 150:] = False
    pad[1, ..., 40:] = False
    out, _ = _block_mask_check(q, k, v, (1, 2, 64, 8), (1, 2, 64, 8), attnx.BlockMask(pad))
    tasks = {(key[1], key[-1]) for key in _block_tasks(out)}       # (batch, key chunk)
    assert tasks == {(0, 0), (0, 1), (0, 2), (1, 0)}


def test_block_mask_one_key_chunk_with_sinks():
    """One key chunk (sinks given to attnx with the block): a query chunk whose
    only key chunk the map empties is zeros, as attnx gives rows without keys."""
    q, k, v = _qkv(_rng(24), (1, 2, 128, 8), (1, 2, 128, 8))
    mask = np.zeros((128, 128), bool)
    mask[:64] = True
    out, got = _block_mask_check(q, k, v, (1, 2, 64, 8), (1, 2, 128, 8), attnx.BlockMask(mask),
                                 sinks=[1.0, -2.0])
    assert _pairs(out) == {(0, 0)} and not got[..., 64:, :].any()


def test_float_block_mask_nan_behind_inf_as_numpy():
    """A float BlockMask's -inf added to a NaN score is NaN, in attnx and so in
    dask: its empty chunks stay in the graph. A bool one's do not (its False
    entries never reach a row)."""
    L = 256
    q, k, v = _qkv(_rng(25), (1, 2, L, 8), (1, 2, L, 8))
    k[..., 200, :] = np.nan
    fm = np.full((L, L), -np.inf, np.float32)
    fm[:, :128] = 0.0
    _, got = _block_mask_check(q, k, v, (1, 2, 64, 8), (1, 2, 64, 8), attnx.BlockMask(fm))
    assert np.isnan(got).all()
    out, got = _block_mask_check(q, k, v, (1, 2, 64, 8), (1, 2, 64, 8), attnx.BlockMask(fm == 0))
    assert np.isfinite(got).all() and {ik for _, ik in _pairs(out)} == {0, 1}


def test_block_mask_distributed(client):
    rng = _rng(26)
    q, k, v = _qkv(rng, (1, 4, 300, 16), (1, 4, 300, 16))
    bm = attnx.BlockMask.documents([120, 80, 100], causal=True)
    out = adask.scaled_dot_product_attention(
        da.from_array(q, (1, 2, 64, 16)), da.from_array(k, (1, 2, 128, 16)),
        da.from_array(v, (1, 2, 128, 16)), attn_mask=bm, sinks=[0.1, 0.2, 0.3, 0.4])
    got = client.compute(out).result()
    np.testing.assert_allclose(
        got, attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm, sinks=[0.1, 0.2, 0.3, 0.4]),
        atol=ATOL, rtol=RTOL)
    assert_close(got, attnx.reference(q, k, v, attn_mask=bm.mask, sinks=[0.1, 0.2, 0.3, 0.4]))


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
