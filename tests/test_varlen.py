"""Packed variable-length batches: ``attnx.varlen_attention`` and
``attnx.varlen_attention_vjp`` against one ``scaled_dot_product_attention``
call per sequence ("blhd" views) and against the float64 ``attnx.reference`` /
``attnx.reference_backward`` run per sequence, on every ISA: odd lengths,
empty sequences (no queries, no keys, or neither), query and key lengths that
differ per sequence, both causal alignments, GQA, window, sinks (per head and
per sequence, with their gradient), softcap, ALiBi, ``return_lse``; gradients
with random upstream gradients at test_grad.py's tolerances; ``cu_seqlens``
forms accepted and every malformed one refused naming the argument; inputs
never modified; ``attnx.pack``/``attnx.unpack`` round trips and their errors.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import GATOL, GRTOL, assert_close, randn


# Seven sequences: odd lengths across tile edges, no queries (1, 2), no keys
# either (1), no keys but queries (6), more queries than keys (3, 6).
LQ = (5, 0, 0, 17, 1, 33, 3)
LK = (7, 0, 4, 9, 40, 33, 0)
N, HQ, E, EV = len(LQ), 4, 16, 12


def cu(lengths, dtype=np.int64):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


def problem(rng, Hk=HQ, lq=LQ, lk=LK):
    """Packed q (total_q, Hq, E), k (total_k, Hk, E), v (total_k, Hk, Ev), cu_q, cu_k."""
    q = randn(rng, (sum(lq), HQ, E))
    k = randn(rng, (sum(lk), Hk, E))
    v = randn(rng, (sum(lk), Hk, EV))
    return q, k, v, cu(lq), cu(lk)


def sequences(cq, ck):
    """Each sequence's (query rows, key rows) slices."""
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def row(kw, i):
    """Sequence i's options: row i of a per-sequence (N, Hq) sinks or alibi_slopes."""
    kw = dict(kw)
    for name in ("sinks", "alibi_slopes"):
        if kw.get(name) is not None and np.ndim(kw[name]) == 2:
            kw[name] = kw[name][i]
    return kw


def alone(a, s):
    """Rows s of a packed array as its own contiguous (1, L, H, X) array (no view
    of the packed one: the per-sequence calls see nothing of their neighbours)."""
    return np.ascontiguousarray(a[s])[None]


RNG_SINKS = np.random.default_rng(7)
CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "lower_right": dict(is_causal="lower_right"),
    "gqa": dict(enable_gqa=True, is_causal="lower_right"),
    "window": dict(window=(3, 1)),
    "window_lower_right": dict(window=(5, 0), is_causal="lower_right"),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
    "sinks_per_sequence": dict(sinks=RNG_SINKS.standard_normal((N, HQ)).astype(np.float32),
                               is_causal=True),
    "softcap": dict(softcap=1.5, scale=0.6),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "alibi_per_sequence_lower_right": dict(alibi_slopes=RNG_SINKS.random((N, HQ)),
                                           is_causal="lower_right"),
    "all": dict(enable_gqa=True, is_causal="lower_right", window=(6, 0), softcap=3.0,
                alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[1.0, 0.0, -1.0, 2.0]),
}


def case_problem(rng, name):
    return problem(rng, Hk=2 if CASES[name].get("enable_gqa") else HQ)


# ------------------------------------------------------------------ forward

@pytest.mark.parametrize("name", CASES)
def test_forward_matches_per_sequence_calls_and_reference(isa, rng, name):
    """out and lse equal one blhd call per sequence (same bits) and the float64 reference."""
    kw = CASES[name]
    q, k, v, cq, ck = case_problem(rng, name)
    out, lse = attnx.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    assert out.shape == (q.shape[0], HQ, EV) and out.dtype == np.float32
    assert lse.shape == (HQ, q.shape[0]) and lse.dtype == np.float32
    np.testing.assert_array_equal(attnx.varlen_attention(q, k, v, cq, ck, **kw), out)
    for i, (qs, ks) in enumerate(sequences(cq, ck)):
        if qs.start == qs.stop:
            continue
        args = (alone(q, qs), alone(k, ks), alone(v, ks))
        o, l = attnx.scaled_dot_product_attention(*args, layout="blhd", return_lse=True,
                                                  **row(kw, i))
        np.testing.assert_array_equal(out[qs], o[0], err_msg=f"sequence {i}")
        np.testing.assert_array_equal(lse[:, qs], l[0], err_msg=f"sequence {i} lse")
        assert_close(out[qs], attnx.reference(*args, layout="blhd", **row(kw, i))[0],
                     err_msg=f"sequence {i}")
    assert not out[cq[6]:].any() and np.isneginf(lse[:, cq[6]:]).all()   # no keys: zeros


def test_lse_is_the_log_of_each_sequences_softmax_sum(isa, rng):
    """lse (Hq, total_q) against float64 log-sum-exp over each sequence's own keys."""
    q, k, v, cq, ck = problem(rng)
    _, lse = attnx.varlen_attention(q, k, v, cq, ck, return_lse=True)
    want = np.full(lse.shape, -np.inf)
    for qs, ks in sequences(cq, ck):
        s = np.einsum("ihe,jhe->hij", q[qs].astype(np.float64), k[ks].astype(np.float64)) / 4.0
        if s.shape[-1]:
            want[:, qs] = np.log(np.exp(s).sum(-1))
    assert_close(lse, want)


def test_sequences_do_not_see_each_other(rng):
    """Changing one sequence's keys and values changes that sequence's rows only."""
    q, k, v, cq, ck = problem(rng)
    out = attnx.varlen_attention(q, k, v, cq, ck, is_causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[ck[3]:ck[4]] += 1.0
    v2[ck[3]:ck[4]] *= -2.0
    out2 = attnx.varlen_attention(q, k2, v2, cq, ck, is_causal=True)
    changed = np.flatnonzero((out != out2).any(axis=(1, 2)))
    assert changed.min() >= cq[3] and changed.max() < cq[4] and changed.size > 0


def test_packed_batch_equals_the_padded_call(isa, rng):
    """pack -> varlen_attention -> unpack equals the padded batch with lengths."""
    lengths = np.array([7, 1, 0, 20], np.int32)
    B, L = len(lengths), 20
    q, k, v = (randn(rng, (B, L, 2, 8)) for _ in range(3))
    (pq, c), (pk, _), (pv, _) = (attnx.pack(x, lengths) for x in (q, k, v))
    out = attnx.unpack(attnx.varlen_attention(pq, pk, pv, c, c, is_causal=True), c, max_len=L)
    want = attnx.reference(q, k, v, layout="blhd", is_causal=True, key_lengths=lengths,
                           query_lengths=lengths)
    assert_close(out, want)


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("name", CASES)
def test_vjp_matches_per_sequence_reference_backward(isa, rng, name):
    """Gradients for a random upstream gradient against reference_backward run per
    sequence; the sinks' gradient summed over the sequences (H,) or one row each (N, H)."""
    kw = CASES[name]
    q, k, v, cq, ck = case_problem(rng, name)
    out, vjp = attnx.varlen_attention_vjp(q, k, v, cq, ck, **kw)
    np.testing.assert_array_equal(out, attnx.varlen_attention(q, k, v, cq, ck, **kw))
    dout = randn(rng, out.shape)
    g = vjp(dout)
    want = {n: np.zeros(a.shape) for n, a in (("query", q), ("key", k), ("value", v))}
    sinks = []
    for i, (qs, ks) in enumerate(sequences(cq, ck)):
        r = attnx.reference_backward(alone(dout, qs), alone(q, qs), alone(k, ks), alone(v, ks),
                                     layout="blhd", **row(kw, i))
        want["query"][qs], want["key"][ks], want["value"][ks] = r.query[0], r.key[0], r.value[0]
        sinks.append(r.sinks)
    for n in ("query", "key", "value"):
        got = getattr(g, n)
        assert got.dtype == np.float32
        assert_close(got, want[n], GATOL, GRTOL, err_msg=n)
    assert g.attn_mask is None
    if kw.get("sinks") is None:
        assert g.sinks is None
    else:
        given = np.asarray(kw["sinks"])
        want_s = np.stack(sinks) if given.ndim == 2 else np.sum(sinks, axis=0)
        assert g.sinks.shape == given.shape
        assert_close(g.sinks, want_s, GATOL, GRTOL, err_msg="sinks")
    # keys no query sees (sequence 2 has no queries) get nothing
    assert not g.key[ck[2]:ck[3]].any() and not g.value[ck[2]:ck[3]].any()


def test_vjp_dout_is_checked(rng):
    q, k, v, cq, ck = problem(rng)
    out, vjp = attnx.varlen_attention_vjp(q, k, v, cq, ck)
    with pytest.raises(ValueError, match="dout"):
        vjp(np.zeros((out.shape[0] + 1,) + out.shape[1:], np.float32))
    with pytest.raises(TypeError, match="dout"):
        vjp(np.zeros(out.shape, np.int32))


# ---------------------------------------------------------------- cu_seqlens

@pytest.mark.parametrize("form", ["int32", "int64", "uint16", "list", "tuple"])
def test_cu_seqlens_forms_give_the_same_result(rng, form):
    q, k, v, cq, ck = problem(rng)
    want = attnx.varlen_attention(q, k, v, cq, ck, is_causal=True)
    conv = {"int32": lambda c: c.astype(np.int32), "int64": lambda c: c.astype(np.int64),
            "uint16": lambda c: c.astype(np.uint16), "list": lambda c: c.tolist(),
            "tuple": lambda c: tuple(int(x) for x in c)}[form]
    got = attnx.varlen_attention(q, k, v, conv(cq), conv(ck), is_causal=True)
    np.testing.assert_array_equal(got, want)
    out, vjp = attnx.varlen_attention_vjp(q, k, v, conv(cq), conv(ck), is_causal=True)
    np.testing.assert_array_equal(out, want)


BAD_CU = {   # name: (cu_seqlens from the good one, exception, words)
    "wrong_start": (lambda c: np.concatenate([[1], c[1:]]), ValueError, "start at 0"),
    "decreasing": (lambda c: np.array([0, c[-1] + 1, c[-1]]), ValueError, "non-decreasing"),
    "end_short": (lambda c: np.concatenate([c[:-1], [c[-1] - 1]]), ValueError, "end at"),
    "end_long": (lambda c: np.concatenate([c[:-1], [c[-1] + 1]]), ValueError, "end at"),
    "float": (lambda c: c.astype(np.float64), TypeError, "integer"),
    "bool": (lambda c: np.array([False, True, True]), TypeError, "integer"),
    "2-D": (lambda c: c[None], ValueError, "1-D"),
    "empty": (lambda c: np.zeros(0, np.int64), ValueError, "at least one"),
}


@pytest.mark.parametrize("fn", [attnx.varlen_attention, attnx.varlen_attention_vjp],
                         ids=["forward", "vjp"])
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad", BAD_CU)
def test_malformed_cu_seqlens_refused_naming_it(rng, fn, which, bad):
    q, k, v, cq, ck = problem(rng, lq=(3, 4), lk=(6, 2))
    make, exc, words = BAD_CU[bad]
    args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    args[which] = make(args[which])
    with pytest.raises(exc) as e:
        fn(q, k, v, **args)
    assert str(e.value).startswith(f"{which} must") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("fn", [attnx.varlen_attention, attnx.varlen_attention_vjp],
                         ids=["forward", "vjp"])
def test_different_numbers_of_sequences_refused(rng, fn):
    q, k, v, cq, ck = problem(rng, lq=(3, 4), lk=(6, 2))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k.*3 and 4"):
        fn(q, k, v, cq, np.array([0, 2, 6, 8]))


@pytest.mark.parametrize("kw, exc, words", [
    (dict(query=np.zeros((1, 7, 4, 16), np.float32)), ValueError, "query must be packed"),
    (dict(key=np.zeros((9, 4, 16), np.float32)), ValueError, "cu_seqlens_k must end"),
    (dict(value=np.zeros((7, 4, 12), np.float32)), ValueError, "key and value"),
    (dict(query=np.zeros((7, 4, 16), np.int32)), TypeError, "query"),
    (dict(sinks=np.zeros((3, 4))), ValueError, "sinks"),
    (dict(alibi_slopes=np.zeros((5, 4))), ValueError, "alibi_slopes"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(return_lse="no"), TypeError, "return_lse"),
])
def test_other_arguments_refused_naming_them(rng, kw, exc, words):
    q, k, v, cq, ck = problem(rng, lq=(3, 4), lk=(6, 2))
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    args.update(kw)
    with pytest.raises(exc, match=words):
        attnx.varlen_attention(**args)


def test_inputs_are_not_modified(rng):
    """Every argument, forward and vjp, compared with a copy taken before the calls."""
    q, k, v, cq, ck = problem(rng)
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cq.astype(np.int32), cu_seqlens_k=ck,
                sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32),
                alibi_slopes=RNG_SINKS.random((N, HQ)), is_causal="lower_right")
    before = {n: np.array(a, copy=True) for n, a in args.items() if isinstance(a, np.ndarray)}
    attnx.varlen_attention(**args, return_lse=True)
    out, vjp = attnx.varlen_attention_vjp(**args)
    dout = randn(rng, out.shape)
    dout0 = dout.copy()
    g = vjp(dout)
    for n, a in before.items():
        np.testing.assert_array_equal(args[n], a, err_msg=n)
    np.testing.assert_array_equal(dout, dout0)
    assert not any(np.shares_memory(x, y) for x in g[:3] for y in (q, k, v, dout))


def test_no_sequences(rng):
    """cu_seqlens [0]: empty output, lse and gradients, shaped from the inputs."""
    q = np.zeros((0, 3, 8), np.float32)
    k, v = np.zeros((0, 3, 8), np.float32), np.zeros((0, 3, 5), np.float32)
    out, lse = attnx.varlen_attention(q, k, v, [0], [0], return_lse=True)
    assert out.shape == (0, 3, 5) and lse.shape == (3, 0)
    out, vjp = attnx.varlen_attention_vjp(q, k, v, [0], [0], sinks=np.zeros((0, 3)))
    g = vjp(out)
    assert g.query.shape == q.shape and g.value.shape == v.shape and g.sinks.shape == (0, 3)


@pytest.mark.parametrize("fn", [attnx.varlen_attention, attnx.varlen_attention_vjp])
@pytest.mark.parametrize("cu", [[0], [0, 0, 0]])
@pytest.mark.parametrize("kw, exc, words", [
    (dict(key=np.zeros((0, 3, 4), np.float32)), ValueError, "key"),
    (dict(key=np.zeros((0, 2, 8), np.float32), value=np.zeros((0, 2, 5), np.float32)),
     ValueError, "heads"),
    (dict(value=np.zeros((0, 1, 5), np.float32)), ValueError, "value"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(window=(1, 2, 3)), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(is_causal="upper"), ValueError, "is_causal"),
    (dict(sinks=np.zeros(4)), ValueError, "sinks"),
])
def test_no_queries_still_checks_the_arguments(fn, cu, kw, exc, words):
    """With no sequence, or only empty ones, nothing is computed, but every
    argument is checked as it is for a batch with queries."""
    args = dict(query=np.zeros((0, 3, 8), np.float32), key=np.zeros((0, 3, 8), np.float32),
                value=np.zeros((0, 3, 5), np.float32), cu_seqlens_q=cu, cu_seqlens_k=cu)
    args.update(kw)
    with pytest.raises(exc, match=words):
        fn(**args)


# ---------------------------------------------------------------- pack / unpack

@pytest.mark.parametrize("form", ["list", "tuple", "int32", "int64"])
def test_pack_unpack_round_trip(rng, form):
    x = rng.standard_normal((4, 6, 2, 3))
    lengths = [3, 0, 6, 1]
    given = {"list": lengths, "tuple": tuple(lengths), "int32": np.array(lengths, np.int32),
             "int64": np.array(lengths, np.int64)}[form]
    packed, c = attnx.pack(x, given)
    assert packed.shape == (10, 2, 3) and packed.dtype == x.dtype
    assert c.dtype == np.int64 and c.tolist() == [0, 3, 3, 9, 10]
    np.testing.assert_array_equal(packed, np.concatenate([x[b, :n] for b, n in enumerate(lengths)]))
    for max_len, L in ((None, 6), (9, 9)):
        y = attnx.unpack(packed, c, max_len=max_len)
        assert y.shape == (4, L, 2, 3) and y.dtype == x.dtype
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(y[b, :n], x[b, :n])
            assert not y[b, n:].any(), f"padding of sequence {b} is not zero"
    np.testing.assert_array_equal(attnx.pack(attnx.unpack(packed, c.tolist()), given)[0], packed)


def test_unpack_defaults_to_the_longest_sequence():
    packed = np.arange(5, dtype=np.float32)
    y = attnx.unpack(packed, np.array([0, 2, 2, 5], np.int32))
    np.testing.assert_array_equal(y, [[0, 1, 0], [0, 0, 0], [2, 3, 4]])


def test_pack_of_an_empty_batch_and_of_empty_sequences():
    packed, c = attnx.pack(np.zeros((0, 4, 2), np.float16), np.zeros(0, int))
    assert packed.shape == (0, 2) and packed.dtype == np.float16 and c.tolist() == [0]
    assert attnx.unpack(packed, c).shape == (0, 0, 2)
    packed, c = attnx.pack(np.zeros((0, 4, 2), np.float32), [])      # NumPy reads [] as float64
    assert packed.shape == (0, 2) and c.tolist() == [0]
    packed, c = attnx.pack(np.ones((2, 4, 2)), [0, 0])
    assert packed.shape == (0, 2) and c.tolist() == [0, 0, 0]
    assert attnx.unpack(packed, c, max_len=3).shape == (2, 3, 2)


@pytest.mark.parametrize("x, lengths, exc, words", [
    (np.zeros((2, 3, 4)), [1, 4], ValueError, r"lengths must lie in \[0, L\]"),
    (np.zeros((2, 3, 4)), [1, -1], ValueError, r"lengths must lie in \[0, L\]"),
    (np.zeros((2, 3, 4)), [1, 1, 1], ValueError, r"lengths must be \(B,\)"),
    (np.zeros((2, 3, 4)), [[1, 1]], ValueError, r"lengths must be \(B,\)"),
    (np.zeros((2, 3, 4)), [1.0, 2.0], TypeError, "lengths must be an integer"),
    (np.zeros(3), [1, 1, 1], ValueError, r"x must be \(B, L"),
])
def test_pack_errors(x, lengths, exc, words):
    with pytest.raises(exc, match=words):
        attnx.pack(x, lengths)


@pytest.mark.parametrize("c, max_len, exc, words", [
    ([0, 1, 4], 2, ValueError, r"max_len \(2\) is shorter"),
    ([0, 1, 5], None, ValueError, "cu_seqlens must end at the packed length 4"),
    ([0, 3, 1, 4], None, ValueError, "cu_seqlens must be non-decreasing"),
    ([0.0, 4.0], None, TypeError, "cu_seqlens must be an integer"),
])
def test_unpack_errors(c, max_len, exc, words):
    with pytest.raises(exc, match=words):
        attnx.unpack(np.zeros((4, 3)), c, max_len=max_len)
