"""varlen_attention(..., block_table=...): keys and values in pages, read in place.

* On one thread, the bits of the same call on the keys gathered into packed
  arrays, for random page orders, block sizes 1, 16 and 256 (and 5: tiles of
  keys across pages), float32/float16/bfloat16 pages, empty sequences, mixed
  decoding rows and prefill chunks, every option.
* On 1-3 threads, against float64 per sequence.
* Bad tables (a page out of range, a negative one, too few columns) raise a
  ValueError naming the sequence, before anything is computed; the core
  refuses them too when called directly.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import assert_close

try:                                  # NumPy's bfloat16 (optional: the [transformers] extra)
    import ml_dtypes
    DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
except ImportError:
    DTYPES = [np.float32, np.float16]


def _paged_case(rng, bs, dtype, lens_q, lens_k, Hq=4, Hk=2, D=16, Dv=None, spare=3):
    """Pools in a random page order (pages of other sequences between), their
    table (garbage past each sequence's last page), and the keys gathered."""
    Dv = D if Dv is None else Dv
    need = [-(-L // bs) for L in lens_k]
    nb = sum(need) + spare
    kp = rng.standard_normal((nb, bs, Hk, D)).astype(dtype)
    vp = rng.standard_normal((nb, bs, Hk, Dv)).astype(dtype)
    perm = rng.permutation(nb)
    table = rng.integers(-7, 10 ** 6, (len(lens_k), max(need + [0]) + 2)).astype(np.int32)
    pos = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[pos:pos + n]
        pos += n

    def gather(pool):
        rows = [np.concatenate([pool[table[i, j]] for j in range(n)])[:L] if n else pool[:0, 0]
                for i, (n, L) in enumerate(zip(need, lens_k))]
        return np.concatenate(rows) if rows else pool[:0, 0]

    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((int(cq[-1]), Hq, D)).astype(np.float32)
    return q, kp, vp, table, cq, ck, gather(kp), gather(vp)


OPTIONS = [
    {},
    {"is_causal": "lower_right"},
    {"is_causal": True},
    {"is_causal": "lower_right", "window": (20, 0), "softcap": 3.0},
    {"sinks": [0.5, -1.0, 0.0, 2.0], "alibi_slopes": [0.25, 0.125, 0.5, 0.0625],
     "is_causal": "lower_right"},
    {"scale": 0.3, "precision": "medium", "alignment": "lower_right", "window": (-1, 3)},
]
LENGTHS = ([1, 5, 0, 3, 200, 1, 2], [300, 5, 7, 0, 400, 1000, 130])  # decoding rows, chunks, empties


@pytest.mark.parametrize("bs", [1, 5, 16, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("opts", OPTIONS, ids=range(len(OPTIONS)))
def test_paged_gives_the_bits_of_gathered_keys(isa, rng, bs, dtype, opts):
    q, kp, vp, table, cq, ck, K, V = _paged_case(rng, bs, dtype, *LENGTHS)
    previous = attnx.get_num_threads()
    attnx.set_num_threads(1)
    try:
        want = attnx.varlen_attention(q, K, V, cq, ck, enable_gqa=True, return_lse=True, **opts)
        kp0, vp0, t0 = kp.copy(), vp.copy(), table.copy()
        got = attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, enable_gqa=True,
                                     return_lse=True, **opts)
    finally:
        attnx.set_num_threads(previous)
    if opts.get("precision") == "medium" and _attnx.bf16_dots() is not None:
        # with bfloat16 dot products a paged prefill stays "highest" where the
        # gathered call rounds its float32 queries (the precision guide)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-2, rtol=2e-2)
    else:
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.array_equal(kp, kp0) and np.array_equal(vp, vp0) and np.array_equal(table, t0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bs", [16, 256])
def test_paged_against_float64(isa, rng, threads, bs):
    lens_q, lens_k = [1, 1, 64, 0, 3], [2000, 17, 700, 9, 3]
    q, kp, vp, table, cq, ck, K, V = _paged_case(rng, bs, np.float32, lens_q, lens_k, Hq=6,
                                                  Hk=2, D=32, Dv=24)
    previous = attnx.get_num_threads()
    attnx.set_num_threads(threads)
    try:
        out, lse = attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, enable_gqa=True,
                                          is_causal="lower_right", return_lse=True)
    finally:
        attnx.set_num_threads(previous)
    assert out.shape == (q.shape[0], 6, 24) and lse.shape == (6, q.shape[0])
    for i in range(len(lens_q)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref = attnx.reference(q[None, qs], K[None, ks], V[None, ks], is_causal="lower_right",
                              enable_gqa=True, layout="blhd")
        assert_close(out[qs], ref[0])


def test_a_sequence_without_keys_gives_zeros(rng):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 16, np.float32, [2, 3], [0, 5])
    out, lse = attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, return_lse=True,
                                      enable_gqa=True)
    assert not out[:2].any() and np.isneginf(lse[:, :2]).all() and out[2:].any()


@pytest.mark.parametrize("bad, words", [
    (lambda t: t.__setitem__((1, 0), 99), r"block_table\[1, 0\] = 99 names no page: the pools "
                                          r"hold \d+ pages"),
    (lambda t: t.__setitem__((2, 1), -1), r"block_table\[2, 1\] = -1 names no page"),
    (lambda t: t.__setitem__((0, 2), 2 ** 31 - 1), r"block_table\[0, 2\] = 2147483647"),
])
def test_a_page_outside_the_pools_is_refused(rng, bad, words):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 1, 1], [12, 3, 8],
                                                 spare=0)
    bad(table)
    with pytest.raises(ValueError, match=words):
        attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, enable_gqa=True)


def test_a_table_too_short_is_refused(rng):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 1], [3, 13])
    with pytest.raises(ValueError, match="block_table: sequence 1 has 13 keys, 4 pages of 4 rows, "
                                         "but the table has 3 columns"):
        attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match=r"block_table must be \(num_seqs, max_blocks\)"):
        attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table[:1], enable_gqa=True)
    with pytest.raises(TypeError, match="block_table must be an integer array"):
        attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table.astype(float),
                               enable_gqa=True)


def test_bad_pools_are_refused(rng):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 1], [3, 13])
    with pytest.raises(ValueError, match="must be pages"):
        attnx.varlen_attention(q, kp[0], vp[0], cq, ck, block_table=table, enable_gqa=True)
    with pytest.raises(ValueError, match="key and value pages must agree"):
        attnx.varlen_attention(q, kp, vp[:-1], cq, ck, block_table=table, enable_gqa=True)
    with pytest.raises(ValueError, match="multiple of key/value heads|enable_gqa"):
        attnx.varlen_attention(q[:, :3], kp, vp, cq, ck, block_table=table, enable_gqa=True)


def test_the_core_refuses_a_bad_table_itself(rng):
    """The extension checks every sequence's pages before it runs any (the
    Python checks bypassed): an error, nothing written, no read outside."""
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 2], [5, 13], spare=0)
    q4 = np.ascontiguousarray(q.swapaxes(0, 1))[None]
    out = np.full((1, 4, 3, 16), 7.0, np.float32)
    pools = kp.swapaxes(1, 2), vp.swapaxes(1, 2)
    for entry in (kp.shape[0], -1):
        t = table.copy()
        t[1, 3] = entry
        with pytest.raises(ValueError, match="block_table: sequence 1 names a page outside"):
            _attnx.forward_varlen(q4, *pools, out, None, cq, ck, t, _attnx.CAUSAL_NONE, 0.25)
        assert (out == 7.0).all()
    with pytest.raises(ValueError, match="sequence 1 has 13 keys, more than its 3 pages"):
        _attnx.forward_varlen(q4, *pools, out, None, cq, ck, np.ascontiguousarray(table[:, :3]),
                              _attnx.CAUSAL_NONE, 0.25)
    with pytest.raises(ValueError, match="cu_seqlens_q must be nondecreasing"):
        _attnx.forward_varlen(q4, *pools, out, None, cq[::-1].copy(), ck, table,
                              _attnx.CAUSAL_NONE, 0.25)
    _attnx.forward_varlen(q4, *pools, out, None, cq, ck, table, _attnx.CAUSAL_NONE, 0.25)
    assert not (out == 7.0).any()


def test_pages_are_forward_only_in_the_api():
    """Pages are forward-only: varlen_attention takes a block_table, its vjp
    does not (the C core's refusal of a backward with pages is tests/c's)."""
    import inspect
    assert "block_table" not in inspect.signature(attnx.varlen_attention_vjp).parameters
    assert "block_table" in inspect.signature(attnx.varlen_attention).parameters


def test_every_row_of_per_sequence_sinks_and_slopes_is_checked(rng):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 1], [3, 6])
    for name in ("sinks", "alibi_slopes"):
        bad = np.zeros((2, 4))
        bad[1, 2] = np.nan
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, enable_gqa=True,
                                   **{name: bad})
        with pytest.raises(ValueError, match=rf"{name} must be \(Hq,\) = \(4,\) or \(N, Hq\)"):
            attnx.varlen_attention(q, kp, vp, cq, ck, block_table=table, enable_gqa=True,
                                   **{name: np.zeros((3, 4))})


def test_no_sequences(rng):
    q, kp, vp, table, _, _, _, _ = _paged_case(rng, 4, np.float32, [1], [3])
    out, lse = attnx.varlen_attention(q[:0], kp, vp, [0], [0], block_table=table[:0],
                                      sinks=[0.0, 1.0, 2.0, 3.0], enable_gqa=True,
                                      return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_the_glue_checks_cu_seqlens_and_pages(rng):
    q, kp, vp, table, cq, ck, _, _ = _paged_case(rng, 4, np.float32, [1, 2], [5, 13])
    q4 = np.ascontiguousarray(q.swapaxes(0, 1))[None]
    out = np.zeros((1, 4, 3, 16), np.float32)
    pools = kp.swapaxes(1, 2), vp.swapaxes(1, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q must be nondecreasing from 0"):
        _attnx.forward_varlen(q4, *pools, out, None, cq + 1, ck, table, _attnx.CAUSAL_NONE, 0.25)
    empty = kp[:, :0].swapaxes(1, 2), vp[:, :0].swapaxes(1, 2)
    with pytest.raises(ValueError, match="pages must hold at least one row"):
        _attnx.forward_varlen(q4, *empty, out, None, cq, ck, table, _attnx.CAUSAL_NONE, 0.25)
    with pytest.raises(ValueError, match="block_table: sequence 0 has 9223372036854775807 keys"):
        _attnx.forward_varlen(q4, *pools, out, None, cq, np.array([0, 2 ** 63 - 1, 2 ** 63 - 1]),
                              table, _attnx.CAUSAL_NONE, 0.25)


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_errors_name_the_arrays_as_passed(rng, kind):
    """Issue 42: shape errors quote the caller's query, pages (and scales) and, for
    an empty pool, say so in words, never an internal zero-row view."""
    pages = rng.standard_normal((6, 8, 2, 16), dtype=np.float32)
    if kind == "int8":
        pages = (np.zeros((6, 8, 2, 16), np.int8), np.ones((6, 8, 2), np.float32))
        shown = r"key \(\(6, 8, 2, 16\), \(6, 8, 2\)\) \(int8 pages, scales\)"
    else:
        shown = r"key \(6, 8, 2, 16\), value \(6, 8, 2, 16\)"
    cu, table = [0, 5], [[0]]
    cases = [(rng.standard_normal((5, 4, 12), dtype=np.float32), {}, "same last dimension E"),
             (rng.standard_normal((5, 3, 16), dtype=np.float32), {"enable_gqa": True},
              r"query heads \(3\) to be a multiple of key/value heads \(2\)"),
             (rng.standard_normal((5, 4, 16), dtype=np.float32), {}, "pass enable_gqa=True")]
    for q, kw, problem in cases:
        got = re.escape(f"got query {tuple(q.shape)} (total, Hq, E), ")
        with pytest.raises(ValueError, match=f"{problem}.*{got}{shown}") as e:
            attnx.varlen_attention(q, pages, pages, cu, cu, block_table=table, **kw)
        assert "(1, " not in str(e.value), e.value
    empty = pages[:0] if kind == "float32" else tuple(a[:0] for a in pages)
    q = rng.standard_normal((5, 2, 16), dtype=np.float32)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 0 names no page: the pools hold "
                                         r"no page \(key and value have num_blocks = 0\), and "
                                         r"sequence 0 has 5 keys") as e:
        attnx.varlen_attention(q, empty, empty, cu, cu, block_table=table)
    assert "-1" not in str(e.value)


def test_packed_errors_name_the_arrays_as_passed(rng):
    """The same for packed batches without pages: (total, H, E) as given."""
    q = rng.standard_normal((5, 4, 12), dtype=np.float32)
    k = rng.standard_normal((7, 2, 16), dtype=np.float32)
    with pytest.raises(ValueError, match=r"same last dimension E; got query \(5, 4, 12\), key "
                                         r"\(7, 2, 16\), value \(7, 2, 16\) \(total, H, E\)$"):
        attnx.varlen_attention(q, k, k, [0, 5], [0, 7])
