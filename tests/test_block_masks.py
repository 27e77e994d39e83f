"""Masks that cost what they keep (issue 45): the core's block maps.

Every masked call classifies its mask in blocks of 64 query rows by 32 keys
(csrc/core/blockmap.c): tiles of keys the mask empties are skipped (no
products, no softmax, no reads of K or V), tiles it keeps whole are not
masked; ``attnx.BlockMask`` classifies once and hands the classes to every
call. Checked here against the float64 ``attnx.reference`` and
``reference_backward`` (random upstream gradients) on every ISA and at 1-3
threads, with masks whose empty, full and partial blocks meet every tile
edge: lengths that are not multiples of the blocks or tiles (1, 31-33, 63-65,
127-129, 200, 300), masks broadcast over batch and heads, a block empty in
one head and full in another, a padding mask (broadcast over queries), fully
masked rows (zeros, lse -inf); non-finite inputs with float masks give the
reference's NaN (the map is not used then).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import GATOL, GRTOL, assert_close, randn

ROWS, KEYS = _attnx.MAP_ROWS, _attnx.MAP_KEYS


def blocky_mask(rng, lead, Lq, Lk, kind="bool", partial=0.3):
    """A mask (lead..., Lq, Lk) made of 16x16 cells, each empty, full or random
    (partial): its 64x32 blocks are all three kinds, with edges inside tiles."""
    cells = rng.choice(3, size=lead + (-(-Lq // 16), -(-Lk // 16)), p=[0.45, 0.55 - partial, partial])
    cell = np.repeat(np.repeat(cells, 16, -2), 16, -1)[..., :Lq, :Lk]
    keep = np.where(cell == 0, False, np.where(cell == 1, True, rng.random(cell.shape) < 0.6))
    if kind == "bool":
        return keep
    vals = np.where(cell == 2, rng.standard_normal(cell.shape), 0.0)
    return np.where(keep, vals, -np.inf).astype(np.float32)


def reference_lse(q, k, mask):
    """log of each row's softmax sum in float64 (-inf for a row that keeps nothing)."""
    s = np.einsum("...qe,...ke->...qk", q.astype(np.float64), k.astype(np.float64))
    s /= np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask
    top = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        safe = np.where(np.isfinite(top), top, 0.0)
        return (safe + np.log(np.exp(s - safe).sum(-1, keepdims=True)))[..., 0]


def run_threads(n, fn):
    previous = attnx.get_num_threads()
    attnx.set_num_threads(n)
    try:
        return fn()
    finally:
        attnx.set_num_threads(previous)


SIZES = [(1, 33), (63, 127), (64, 128), (65, 129), (130, 31), (200, 300), (129, 257)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("Lq, Lk", SIZES)
def test_forward_at_every_tile_edge(isa, rng, Lq, Lk, kind, threads):
    q, k, v = randn(rng, (2, 3, Lq, 16)), randn(rng, (2, 3, Lk, 16)), randn(rng, (2, 3, Lk, 8))
    for mshape in [(Lq, Lk), (2, 1, Lq, Lk), (1, 3, Lq, Lk), (2, 3, Lq, Lk)]:
        mask = blocky_mask(rng, mshape[:-2], Lq, Lk, kind)
        for m in (mask, attnx.BlockMask(mask)):
            out, lse = run_threads(threads, lambda: attnx.scaled_dot_product_attention(
                q, k, v, attn_mask=m, return_lse=True))
            ref, ref_lse = attnx.reference(q, k, v, attn_mask=mask), reference_lse(q, k, mask)
            assert_close(out, ref, err_msg=f"{mshape} {type(m).__name__}")
            assert_close(lse, ref_lse, err_msg="lse")


def test_a_block_empty_in_one_head_and_full_in_another(isa, rng):
    L = 200
    mask = np.zeros((1, 4, L, L), bool)
    mask[0, 0, :64, :128] = True          # head 0: one full block, the rest empty
    mask[0, 1] = True                     # head 1: full everywhere
    mask[0, 2] = np.tri(L, dtype=bool)    # head 2: causal
    mask[0, 3, :, 100:] = True            # head 3: keys from 100 on (a tile edge inside)
    q, k, v = (randn(rng, (1, 4, L, 16)) for _ in range(3))
    for m in (mask, attnx.BlockMask(mask)):
        out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
        ref, ref_lse = attnx.reference(q, k, v, attn_mask=mask), reference_lse(q, k, mask)
        assert_close(out, ref)
        assert_close(lse, ref_lse)
    # head 0's rows past 64 keep nothing: zeros, lse -inf
    assert not out[0, 0, 64:].any() and np.isneginf(lse[0, 0, 64:]).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_gradients_at_tile_edges(isa, rng, kind, threads):
    for Lq, Lk, mshape, hk in [(65, 129, (65, 129), 3), (130, 200, (2, 1, 130, 200), 1),
                               (33, 300, (1, 3, 33, 300), 3), (200, 63, (200, 63), 3)]:
        q = randn(rng, (2, 3, Lq, 16))
        k, v = randn(rng, (2, hk, Lk, 16)), randn(rng, (2, hk, Lk, 8))
        mask = blocky_mask(rng, mshape[:-2], Lq, Lk, kind)
        kw = dict(enable_gqa=hk != 3)
        dout = randn(rng, (2, 3, Lq, 8))
        ref = attnx.reference_backward(dout, q, k, v, attn_mask=mask, **kw)
        for m in (mask, attnx.BlockMask(mask)):
            out, vjp = run_threads(threads, lambda: attnx.scaled_dot_product_attention_vjp(
                q, k, v, attn_mask=m, **kw))
            assert_close(out, attnx.reference(q, k, v, attn_mask=mask, **kw))
            got = run_threads(threads, lambda: vjp(dout))
            for name in ("query", "key", "value"):
                assert_close(getattr(got, name), getattr(ref, name), GATOL, GRTOL, err_msg=name)
            if kind == "float":
                terms = np.prod((2, 3, Lq, Lk)) / mask.size
                assert got.attn_mask.shape == mask.shape
                assert_close(got.attn_mask, ref.attn_mask, GATOL * np.sqrt(terms), GRTOL,
                             err_msg="attn_mask")


def test_padding_mask_and_decoding(isa, rng):
    """Masks broadcast over queries (padding), and one query row (GQA decoding,
    folded in the core: its map is classified again)."""
    q, k, v = randn(rng, (2, 8, 1, 16)), randn(rng, (2, 2, 300, 16)), randn(rng, (2, 2, 300, 16))
    pad = np.ones((2, 1, 1, 300), bool)
    pad[0, ..., 150:] = False
    pad[1, ..., :97] = False
    for m in (pad, attnx.BlockMask(pad)):
        out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        assert_close(out, attnx.reference(q, k, v, attn_mask=pad, enable_gqa=True))


def test_non_finite_inputs_with_float_masks_as_the_reference(isa, rng):
    """A float mask's -inf added to an inf or NaN score is NaN, in the reference
    and in attnx: with non-finite queries or keys the float mask's empty blocks
    are computed (the map is not used), so NaN reaches the same rows; with
    finite inputs they are skipped."""
    L = 256
    q, k, v = (randn(rng, (1, 2, L, 16)) for _ in range(3))
    mask = np.full((L, L), -np.inf, np.float32)
    mask[:, :128] = 0.0
    k[..., 200, :] = np.nan
    for m in (mask, attnx.BlockMask(mask)):
        out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
        ref = attnx.reference(q, k, v, attn_mask=mask)
        assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out).all()
    k[..., 200, :] = 1.0
    assert_close(attnx.scaled_dot_product_attention(q, k, v, attn_mask=attnx.BlockMask(mask)),
                 attnx.reference(q, k[..., :128, :], v[..., :128, :]))


def test_block_mask_equals_the_plain_mask_bit_for_bit(rng):
    mask = blocky_mask(rng, (), 300, 400)
    q, k, v = randn(rng, (2, 4, 300, 32)), randn(rng, (2, 4, 400, 32)), randn(rng, (2, 4, 400, 32))
    bm = attnx.BlockMask(mask)
    a = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b = attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm)
    assert a.tobytes() == b.tobytes()
    # reused across calls of other batch sizes and heads
    b2 = attnx.scaled_dot_product_attention(q[:1, :2], k[:1, :2], v[:1, :2], attn_mask=bm)
    assert b2.tobytes() == b[:1, :2].tobytes()


# ---------------------------------------------------------------- the BlockMask API


def test_blocks_of_a_mask():
    m = np.zeros((130, 70), bool)
    m[:64, :32] = True                    # block (0, 0) full
    m[0, 40] = True                       # block (0, 1) partial
    bm = attnx.BlockMask(m)
    assert bm.blocks.shape == (3, 3) and bm.blocks.dtype == np.uint8
    K, D = bm.KEEP, bm.DROP
    assert bm.blocks.tolist() == [[K, K | D, D], [D, D, D], [D, D, D]]
    assert bm.block_fractions() == pytest.approx((7 / 9, 1 / 9, 1 / 9))
    f = attnx.BlockMask(np.where(m, 0.0, -np.inf))
    assert f.dtype == np.float32 and f.blocks.tolist() == bm.blocks.tolist()
    g = attnx.BlockMask(np.where(m, 0.5, -np.inf))     # kept, but changed: partial
    assert g.blocks[0, 0] == K | D


def test_documents_prefix_lm_and_repr():
    bm = attnx.BlockMask.documents([3, 0, 5])
    doc = np.array([0, 0, 0, 2, 2, 2, 2, 2])
    assert (bm.mask == (doc[:, None] == doc[None, :])).all()
    c = attnx.BlockMask.documents([3, 5], causal=True)
    assert (c.mask == ((doc[:, None] == doc[None, :]) & np.tri(8, dtype=bool))).all()
    p = attnx.BlockMask.prefix_lm(6, 2)
    i, j = np.mgrid[:6, :6]
    assert (p.mask == ((j <= i) | (j < 2))).all()
    assert repr(attnx.BlockMask.documents([256] * 8)) == (
        "BlockMask(shape=(2048, 2048), dtype=bool, kept=12.5%, blocks: 87.5% empty, "
        "12.5% full, 0.0% partial)")
    assert bm.kept_fraction() == pytest.approx((9 + 25) / 64)


def test_a_block_mask_never_changes(rng):
    m = blocky_mask(rng, (), 100, 100)
    bm = attnx.BlockMask(m)
    m[:] = ~m                             # the caller's array: copied
    assert (bm.mask != m).all()
    with pytest.raises(ValueError):
        bm.mask[0, 0] = True
    with pytest.raises(ValueError):
        bm.blocks[0, 0] = 0
    assert np.asarray(bm) is bm.mask


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_block_mask_cannot_be_made_writeable(rng, kind):
    """Issue 56, 5: ``bm.mask.flags.writeable = True`` succeeded (the mask owned
    its memory), and edits then left the block map stale: results wrong. The
    mask, the blocks and every view of them refuse to become writeable, and
    neither can be replaced; nothing is copied when they are read. Pickled or
    copied, a BlockMask stays so."""
    import copy
    import pickle
    m = blocky_mask(rng, (2, 1), 100, 70, kind)
    bm = attnx.BlockMask(m)
    assert bm.mask is bm.mask and bm.blocks is bm.blocks and np.asarray(bm) is bm.mask
    for other in (bm, pickle.loads(pickle.dumps(bm)), copy.deepcopy(bm), copy.copy(bm)):
        np.testing.assert_array_equal(other.mask, bm.mask)
        np.testing.assert_array_equal(other.blocks, bm.blocks)
        for a in (other.mask, other.blocks, np.asarray(other), other.mask[0, :, ::2],
                  other.mask.reshape(-1), other.blocks.T):
            assert not a.flags.writeable
            with pytest.raises(ValueError, match="WRITEABLE"):
                a.setflags(write=True)
            with pytest.raises(ValueError, match="WRITEABLE"):
                a.flags.writeable = True
        with pytest.raises(AttributeError):
            other.mask = np.ones((2, 1, 100, 70), bool)
        with pytest.raises(AttributeError):
            other.blocks = np.zeros_like(bm.blocks)
    q, k = randn(rng, (2, 3, 100, 16)), randn(rng, (2, 3, 70, 16))
    out = attnx.scaled_dot_product_attention(q, k, k, attn_mask=bm)
    assert_close(out, attnx.reference(q, k, k, attn_mask=m))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="mask must be bool"):
        attnx.BlockMask(np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match="at least 2-D"):
        attnx.BlockMask(np.ones(4, bool))
    with pytest.raises(ValueError, match="lengths must be 1-D non-negative"):
        attnx.BlockMask.documents([3, -1])
    with pytest.raises(ValueError, match="prefix must be at most length = 4"):
        attnx.BlockMask.prefix_lm(4, 5)
    q = np.zeros((1, 1, 5, 8), np.float32)
    with pytest.raises(ValueError, match="attn_mask with shape"):
        attnx.scaled_dot_product_attention(q, q, q, attn_mask=attnx.BlockMask(np.ones((4, 4), bool)))


def test_the_glue_checks_a_mask_and_its_blocks(rng):
    """The private entry point refuses blocks that do not fit the problem."""
    q = randn(rng, (1, 1, 70, 8))
    out = np.empty_like(q)
    mask = np.ones((1, 1, 70, 70), bool)
    blocks = _attnx.classify_mask(mask, 1)
    _attnx.forward(q, q, q, out, None, (mask, blocks), None, None, 0, 8 ** -0.5)
    assert_close(out, attnx.reference(q, q, q))
    with pytest.raises(TypeError, match="mask map"):
        _attnx.forward(q, q, q, out, None, (mask, blocks.astype(np.int16)), None, None, 0, 8 ** -0.5)
    with pytest.raises(ValueError, match="mask map"):
        _attnx.forward(q, q, q, out, None, (mask, blocks[0]), None, None, 0, 8 ** -0.5)
    with pytest.raises(TypeError, match=r"\(mask, block map\)"):
        _attnx.forward(q, q, q, out, None, (mask,), None, None, 0, 8 ** -0.5)
    # blocks of other extents (here: of another length) are not used: the call classifies
    wrong = np.full((1, 1, 1, 1), _attnx.MAP_KEEP, np.uint8)
    _attnx.forward(q, q, q, out, None, (np.tri(70, dtype=bool)[None, None], wrong), None, None,
                   0, 8 ** -0.5)
    assert_close(out, attnx.reference(q, q, q, attn_mask=np.tri(70, dtype=bool)))


@pytest.mark.parametrize("threads", [2, 3])
def test_key_ranges_follow_the_kept_work(isa, rng, threads):
    """Few heads (the backward cuts each head's keys into ranges) or few query
    rows (the forward's split-K): with a mask whose kept keys crowd into part
    of the range, the ranges are cut to equal kept work instead of equal keys;
    the results stay those of the float64 reference."""
    L = 1100
    prefix = attnx.BlockMask.prefix_lm(L, 700)       # keys < 700 hold most of the work
    q, k, v = randn(rng, (1, 1, L, 16)), randn(rng, (1, 1, L, 16)), randn(rng, (1, 1, L, 8))
    dout = randn(rng, (1, 1, L, 8))
    out, vjp = run_threads(threads, lambda: attnx.scaled_dot_product_attention_vjp(
        q, k, v, attn_mask=prefix))
    got = run_threads(threads, lambda: vjp(dout))
    ref = attnx.reference_backward(dout, q, k, v, attn_mask=prefix.mask)
    assert_close(out, attnx.reference(q, k, v, attn_mask=prefix.mask))
    for name in ("query", "key", "value"):
        assert_close(getattr(got, name), getattr(ref, name), GATOL, GRTOL, err_msg=name)
    # decoding rows against keys of which only the last tenth is kept
    Lk = 4000
    qd, kd, vd = randn(rng, (1, 2, 3, 16)), randn(rng, (1, 2, Lk, 16)), randn(rng, (1, 2, Lk, 16))
    late = np.zeros((3, Lk), bool)
    late[:, -400:] = True
    late[1, 5] = True
    for m in (late, attnx.BlockMask(late)):
        got = run_threads(threads, lambda: attnx.scaled_dot_product_attention(qd, kd, vd,
                                                                               attn_mask=m))
        assert_close(got, attnx.reference(qd, kd, vd, attn_mask=late))


# ---------------------------------------------------------------- attnx.torch

def _torch_grads(fn, q, k, v, dout, mask, **kw):
    """out and the q, k, v gradients of ``fn`` (torch tensors of the arrays,
    float64 where ``q`` is), for the upstream gradient ``dout``."""
    torch = pytest.importorskip("torch")
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = fn(*t, attn_mask=mask, **kw)
    out.backward(torch.tensor(dout, dtype=out.dtype))
    return [out.detach().numpy()] + [x.grad.numpy() for x in t]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mshape", [(130, 200), (2, 1, 130, 200), (1, 4, 130, 200)])
def test_torch_takes_a_block_mask(rng, kind, mshape):
    """attnx.torch takes an attnx.BlockMask (it raised TypeError): the output
    and the query, key and value gradients (random upstream gradient) are
    torch autograd's (float64) with the plain mask tensor; a float BlockMask
    gets no gradient (no tensor holds it)."""
    torch = pytest.importorskip("torch")
    import attnx.torch as at

    Lq, Lk = mshape[-2:]
    q, k, v = randn(rng, (2, 4, Lq, 16)), randn(rng, (2, 2, Lk, 16)), randn(rng, (2, 2, Lk, 8))
    mask = blocky_mask(rng, mshape[:-2], Lq, Lk, kind)
    mask[..., :, :3] = True if kind == "bool" else 0.0       # every row keeps a key
    dout = randn(rng, (2, 4, Lq, 8))
    bm = attnx.BlockMask(mask)
    got = _torch_grads(at.scaled_dot_product_attention, q, k, v, dout, bm, enable_gqa=True)
    want = _torch_grads(torch.nn.functional.scaled_dot_product_attention,
                        *(a.astype(np.float64) for a in (q, k, v)), dout,
                        torch.tensor(mask if kind == "bool" else mask.astype(np.float64)),
                        enable_gqa=True)
    assert_close(got[0], want[0], err_msg="out")
    assert_close(got[0], attnx.scaled_dot_product_attention(q, k, v, attn_mask=bm, enable_gqa=True)
                 .astype(np.float64), err_msg="vs NumPy")
    for g, w, name in zip(got[1:], want[1:], ("query", "key", "value")):
        assert_close(g, w, GATOL, GRTOL, err_msg=name)
    with torch.no_grad():                          # inference: no autograd node
        out = at.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v)), attn_mask=bm,
                                              enable_gqa=True)
    assert_close(out.numpy(), want[0], err_msg="no_grad")


def test_torch_block_mask_map_reaches_the_numpy_calls(rng, monkeypatch):
    """The BlockMask itself goes to the NumPy forward and backward (its map is
    used, the mask not classified again), with no mask gradient asked for;
    float64 tensors give float64 results; other masks are still refused by name."""
    torch = pytest.importorskip("torch")
    import attnx.torch as at

    seen = []
    fwd, bwd = at._sdpa, at._sdpa_backward

    def forward(*args, **kw):
        seen.append(("forward", kw["attn_mask"]))
        return fwd(*args, **kw)

    def backward(*args, **kw):
        seen.append(("backward", kw["attn_mask"], kw["mask_grad"]))
        return bwd(*args, **kw)
    monkeypatch.setattr(at, "_sdpa", forward)
    monkeypatch.setattr(at, "_sdpa_backward", backward)
    bm = attnx.BlockMask.prefix_lm(100, 30)
    bm_f = attnx.BlockMask(np.where(bm.mask, 0.5, -np.inf))
    q = torch.tensor(randn(rng, (1, 2, 100, 8)), dtype=torch.float64, requires_grad=True)
    for m in (bm, bm_f):
        out = at.scaled_dot_product_attention(q, q, q, attn_mask=m)
        assert out.dtype == torch.float64
        out.backward(torch.randn(out.shape, dtype=torch.float64))
        assert seen == [("forward", m), ("backward", m, False)]
        assert q.grad.dtype == torch.float64 and torch.isfinite(q.grad).all()
        want = attnx.reference_backward(np.ones((1, 2, 100, 8)), *(q.detach().numpy(),) * 3,
                                        attn_mask=m.mask)
        q.grad = None
        seen.clear()
        at.scaled_dot_product_attention(q, q, q, attn_mask=m).sum().backward()
        g = want.query + want.key + want.value                  # q is query, key and value
        assert_close(q.grad.numpy().astype(np.float32), g, GATOL, GRTOL)
        q.grad = None
        seen.clear()
    with pytest.raises(TypeError, match=r"attn_mask must be a torch.Tensor; got ndarray \(or an "
                                        r"attnx.BlockMask;"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=bm.mask)
