"""Property tests (hypothesis): attnx against the float64 ``attnx.reference``.

Hypothesis draws whole problems: shapes with sizes 0 and 1 and sizes around
the vector widths and tiles, 2-D to 5-D inputs in both layouts, GQA, every
mask kind (bool, float16/32/64, bfloat16) broadcast along any axis, key/query lengths of
several integer dtypes, the causal variants, the scale, float16/32/64 and bfloat16 inputs,
and the memory each array lives in: strided, transposed, negatively strided,
and misaligned (a view at byte offset 1..3 of a uint8 buffer, which attnx
must copy or refuse clearly, never misread).

Values come in three regimes, each with its own comparison:

* ``normal``: standard-normal inputs (a float mask is normal with some
  -inf): the project's accuracy bar, ``assert_close`` (atol 1e-5, rtol 5e-6).
* ``extreme``: q, k, v, mask each scaled by 10**x, x in {-30 ... 4}. The bar
  is meaningless there (an atol of 1e-5 passes anything for values of 1e-30,
  and a float32 score of 1e9 cannot resolve differences of 1), so the check
  is relative to what float32 can do: with delta the bound on the error of a
  float32 score of the row, ``(4 + E) * eps32 * max_j(|scale| |q_i|.|k_j| +
  |mask_ij|)``, every weight is within a factor exp(+-2 delta) of the exact
  one, so ``|w - w_ref| <= atol + rtol|w_ref| + expm1(2 delta) w_ref`` and the
  output ``|o - o_ref| <= atol * min(1, max|v|) + rtol|o_ref| + (expm1(2
  delta) + (Lk + 4) eps32) * sum_j w_ref |v_j|``. Where delta is large the
  bound says little, so the structure is checked as well: weights in [0, 1],
  rows summing to 1 or being zero exactly where the reference's are, outputs
  inside the range of the values, no NaN/inf from finite inputs.
* ``nonfinite``: normal inputs with inf, -inf and NaN sprinkled into q, k,
  v and a float mask: NaN and inf must sit exactly where the reference has
  them (same sign), the finite elements meet the bar. One exception,
  documented in ``_compare``: an output element whose reference gets an
  inf/NaN value through a weight too small for float32 (< 1e-30) is not
  compared (float32 rounds that weight to 0 and drops the key, float64 does
  not: both are right for their precision).

In every regime: the inputs are never modified, the results are fresh arrays,
a valid call never raises, and a fully masked row gives exact zeros.

A second property drives the private ``_attnx.forward`` directly with arrays
the Python layer would have copied (misaligned, last axis strided, masks
broadcast with zero strides): it must give the reference's answer or raise
TypeError/ValueError, and it must accept every aligned, unit-last-stride view.

Profiles (tests/hypothesis_profiles.py): ``ci`` (default) is derandomised
with a modest number of examples; ``HYPOTHESIS_PROFILE=dev`` runs thousands.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import hypothesis_profiles  # noqa: E402,F401  (registers and loads the profiles)
from hypothesis import assume, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attnx  # noqa: E402
from attnx import _attnx  # noqa: E402
from attnx._args import attention_args  # noqa: E402
from conftest import ATOL, LOW_FLOATS, RTOL, assert_close  # noqa: E402

EPS32 = 2.0 ** -24
FLOATS = (np.float32, *LOW_FLOATS, np.float64)   # float32 first: shrinks towards it
F16_MAX = 60000.0

# ------------------------------------------------------------ strategies

# sizes: 0 is drawn now and then (it empties the whole problem, so not often)
small = st.sampled_from([1, 2, 3, 1, 2, 1, 3, 2, 1, 0])
lengths_ = st.one_of(st.integers(1, 9),
                     st.sampled_from([0, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 200]))
dims_ = st.one_of(st.integers(1, 9), st.sampled_from([0, 15, 16, 17, 31, 32, 33, 64, 65]))


@st.composite
def memory(draw, ndim, aligned_only=False):
    """How an array lives in memory: axis order, step per axis, byte offset.

    The storage order keeps the last axis innermost three times in four (a
    transposed last axis is copied by the Python layer and refused by the
    glue, so it says less); offsets 1..3 (misaligned) one time in four."""
    perm = draw(st.permutations(range(ndim)))
    if ndim and draw(st.sampled_from([True, True, True, False])):
        perm = [a for a in perm if a != ndim - 1] + [ndim - 1]
    steps = tuple(draw(st.sampled_from([1, 1, 2, -1, -2])) for _ in range(ndim - 1))
    if ndim:                 # the last axis: mostly unit steps (any other is copied)
        steps += (draw(st.sampled_from([1, 1, 1, -1, 2])),)
    offset = 0 if aligned_only else draw(st.sampled_from([0] * 9 + [1, 2, 3]))
    return perm, steps, offset


def place(values, dtype, mem):
    """A view of ``dtype`` holding ``values`` with the memory layout ``mem``:
    storage axes in the order ``perm``, every axis strided by ``steps`` (negative:
    reversed), the data starting ``offset`` bytes into a uint8 buffer."""
    perm, steps, offset = mem
    values = np.asarray(values)
    shape = values.shape
    store = tuple(shape[a] * abs(steps[a]) for a in perm)
    itemsize = np.dtype(dtype).itemsize
    buf = np.zeros(int(np.prod(store)) * itemsize + offset + 16, np.uint8)
    base = np.ndarray(store, dtype=dtype, buffer=buf, offset=offset)
    view = base.transpose(np.argsort(perm))
    if steps:                                  # (indexing a 0-d array by () gives a scalar)
        view = view[tuple(slice(None, None, s) for s in steps)]
    assert view.shape == shape
    view[...] = values
    if offset % itemsize:
        assert not view.flags.aligned or view.size <= 1 or itemsize == 1
    return view


def fill(rng, shape, regime, mag, dtype, specials=0.0):
    """float64 values for an input: normal * 10**mag, NaN/inf sprinkled in."""
    x = np.asarray(rng.standard_normal(shape) * (10.0 ** mag))
    if dtype == np.float16:
        x = np.asarray(np.clip(x, -F16_MAX, F16_MAX))   # (0-d arrays come back as scalars)
    if specials and x.size:
        where = rng.random(shape) < specials
        x[where] = rng.choice([np.inf, -np.inf, np.nan], size=int(where.sum()))
    return x


@st.composite
def problems(draw):
    """One call of scaled_dot_product_attention: (args, kwargs, info)."""
    layout = draw(st.sampled_from(["bhld", "blhd"]))
    nd = draw(st.integers(3 if layout == "blhd" else 2, 5))
    lead = tuple(draw(st.lists(small, min_size=max(nd - 3, 0), max_size=max(nd - 3, 0))))
    if nd == 2:
        Hk = group = 1
    else:
        Hk = draw(small)
        group = draw(st.sampled_from([1, 1, 2, 3])) if Hk else 1
    Hq = Hk * group
    enable_gqa = group > 1 or draw(st.booleans())
    Lq, Lk = draw(lengths_), draw(lengths_)
    E, Ev = draw(dims_), draw(dims_)
    B = math.prod(lead)
    assume(B * Hq * Lq * Lk * max(E, Ev, 1) <= 400_000)

    def shape(H, L, D):
        if nd == 2:
            return (L, D)
        return lead + ((L, H, D) if layout == "blhd" else (H, L, D))

    regime = draw(st.sampled_from(["normal", "extreme", "nonfinite"]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    mags = {n: 0 for n in "qkvm"}
    if regime == "extreme":
        mags = {n: draw(st.sampled_from([0, -30, -20, -10, -3, 1, 2, 3, 4])) for n in "qkvm"}
    specials = {n: 0.0 for n in "qkvm"}
    if regime == "nonfinite":
        specials = {n: draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5])) for n in "qkvm"}

    arrays = {}
    for name, shp in (("query", shape(Hq, Lq, E)), ("key", shape(Hk, Lk, E)),
                      ("value", shape(Hk, Lk, Ev))):
        dt = draw(st.sampled_from(FLOATS))
        vals = fill(rng, shp, regime, mags[name[0]], dt, specials[name[0]])
        arrays[name] = place(vals, dt, draw(memory(len(shp))))

    # mask: broadcastable to the scores (lead..., Hq, Lq, Lk) ((1, Lq, Lk) for 2-D)
    full = (lead + (Hq,) if nd > 2 else (1,)) + (Lq, Lk)
    kind = draw(st.sampled_from([None, "bool", "float"]))
    mask = None
    if kind is not None:
        keep = draw(st.integers(0, len(full)))
        mshape = tuple(n if draw(st.booleans()) else 1 for n in full[len(full) - keep:])
        if kind == "bool":
            p = draw(st.sampled_from([1.0, 0.7, 0.3, 0.0]))
            mvals, mdt = rng.random(mshape) < p, np.bool_
        else:
            mdt = draw(st.sampled_from(FLOATS))
            mvals = fill(rng, mshape, regime, mags["m"], mdt, specials["m"])
            p_inf = draw(st.sampled_from([0.0, 0.2, 1.0]))
            mvals[rng.random(mshape) < p_inf] = -np.inf
        mask = place(mvals, mdt, draw(memory(len(mshape))))
        if keep == 0 and draw(st.booleans()):
            mask = mask[()]                      # a 0-d array as the mask

    # lengths: one per leading index ((N,) for 3-D "bhld", where N is the head axis)
    lshape = (Hq,) if (nd == 3 and layout == "bhld") else lead
    lens = {}
    for name, L in (("key_lengths", Lk), ("query_lengths", Lq)):
        if draw(st.booleans()):
            continue
        dt = draw(st.sampled_from([np.int64, np.int32, np.int16, np.uint8, np.intp]))
        if L > np.iinfo(dt).max:
            dt = np.int64
        vals = rng.integers(0, L + 1, size=lshape)
        if draw(st.booleans()) and lshape:
            vals = rng.integers(0, L + 1, size=(1,) * len(lshape))   # broadcast lengths
        # aligned only: misaligned lengths have their own test,
        # test_misaligned_lengths below
        lens[name] = place(vals, dt, draw(memory(vals.ndim, aligned_only=True)))

    kwargs = dict(
        attn_mask=mask,
        is_causal=draw(st.sampled_from([False, True, "upper_left", "lower_right"])),
        scale=draw(st.sampled_from([None, None, 1.0, 0.5, 0.0, -1.0, 2.0, 1e-3])),
        enable_gqa=enable_gqa, layout=layout,
        need_weights=draw(st.booleans()), **lens)
    info = dict(regime=regime, nd=nd, lead=lead, Hq=Hq, Hk=Hk, Lq=Lq, Lk=Lk, E=E, Ev=Ev,
                mags=mags, specials=specials, seed=seed)
    return (arrays["query"], arrays["key"], arrays["value"]), kwargs, info


# ------------------------------------------------------------ comparison

def _canonical_out(out, info, layout):
    """An output in (B, Hq, Lq, Ev), whatever the layout and dimensionality."""
    out = np.asarray(out, dtype=np.float64)
    if layout == "blhd":
        out = np.swapaxes(out, -2, -3)
    return out.reshape(math.prod(info["lead"]), info["Hq"], info["Lq"], info["Ev"])


def _compare(got_out, got_w, ref_out, ref_w, args, kwargs, info):
    regime, layout = info["regime"], kwargs["layout"]
    if regime == "normal":
        assert_close(got_out, ref_out, err_msg="output")
        if got_w is not None:
            assert_close(got_w, ref_w, err_msg="weights")
    B, Hq, Lq, Lk = math.prod(info["lead"]), info["Hq"], info["Lq"], info["Lk"]
    a_o = _canonical_out(got_out, info, layout)
    e_o = _canonical_out(ref_out, info, layout)
    e_w = np.asarray(ref_w, dtype=np.float64).reshape(B, Hq, Lq, Lk)
    a_w = None if got_w is None else np.asarray(got_w, dtype=np.float64).reshape(B, Hq, Lq, Lk)

    # the same problem as the core sees it: (B, H, L, E) float64 views
    kw = {k: v for k, v in kwargs.items() if k != "need_weights"}
    p = attention_args(*args, kw["attn_mask"], 0.0, kw["is_causal"], kw["scale"], kw["enable_gqa"],
                       layout=layout, key_lengths=kw.get("key_lengths"),
                       query_lengths=kw.get("query_lengths")).astype(np.float64)
    p_q, p_k, p_v, p_mask = p.folded()
    group = Hq // p_k.shape[1] if p_k.shape[1] else 1
    k = np.repeat(p_k, group, axis=1)
    v = np.repeat(p_v, group, axis=1)
    fin = lambda x: np.where(np.isfinite(x), np.abs(x), 0.0)  # noqa: E731
    with np.errstate(over="ignore", invalid="ignore"):
        absdot = abs(p.scale) * np.matmul(fin(p_q), np.swapaxes(fin(k), -1, -2))
        if p_mask is not None and p_mask.dtype != np.bool_:
            absdot = absdot + fin(p_mask)
    E = p_q.shape[-1]
    delta = (4 + E) * EPS32 * (absdot.max(-1, keepdims=True) if Lk else np.zeros((B, Hq, Lq, 1)))
    rel = np.expm1(np.minimum(2 * delta, 50.0))                                   # (B,H,Lq,1)
    # the bar for the finite elements of well-scaled problems (inf/NaN sprinkled
    # into normal values included); the float32 bound only for extreme ones
    strict = regime != "extreme"

    # Rows where float32 may legitimately drop a key that float64 keeps: the
    # reference weight is tiny (< 1e-30, or the row's scores are too uncertain
    # to say) and the key's value is inf/NaN, so float64 gives inf/NaN
    # (w * inf) and float32 gives a finite number (the key's weight rounds to
    # 0 and zero-weight keys are left out by design). Not compared.
    bad_v = ~np.isfinite(v)                                                         # (B,H,Lk,Ev)
    shaky = (e_w > 0) & ((e_w < 1e-30) | (rel > 1e-3))                              # (B,H,Lq,Lk)
    skip_o = np.matmul(shaky.astype(np.float64), bad_v.astype(np.float64)) > 0     # (B,H,Lq,Ev)

    # NaN and inf: the same places, the same signs
    for name, a, e, skip in (("output", a_o, e_o, skip_o), ("weights", a_w, e_w, None)):
        if a is None:
            continue
        keep = np.ones(a.shape, bool) if skip is None else ~skip
        nan_a, nan_e = np.isnan(a) & keep, np.isnan(e) & keep
        assert np.array_equal(nan_a, nan_e), (
            f"{name}: NaN positions differ, first at {np.argwhere(nan_a != nan_e)[0]}")
        inf_a, inf_e = np.isinf(a) & keep, np.isinf(e) & keep
        assert np.array_equal(inf_a, inf_e) and np.array_equal(a[inf_e], e[inf_e]), (
            f"{name}: infinities differ, first at {np.argwhere((inf_a != inf_e) | (inf_e & (a != e)))[0]}")

    # finite elements: within what float32 scores allow (see the module doc)
    if a_w is not None:
        both = np.isfinite(a_w) & np.isfinite(e_w)
        tol = ATOL + RTOL * np.abs(e_w) + (0 if strict else 1.01 * rel * np.abs(e_w))
        bad = both & ~(np.abs(a_w - e_w) <= tol)
        assert not bad.any(), (
            f"weights: {bad.sum()} element(s) off, first at {np.argwhere(bad)[0]}: "
            f"{a_w[bad][0]!r} vs {e_w[bad][0]!r} (tol {tol[bad][0]:.3g})")
    sv = float(fin(v).max()) if v.size else 0.0
    wv = np.matmul(np.where(np.isfinite(e_w), e_w, 0.0), fin(v))                  # (B,H,Lq,Ev)
    if strict:
        tol = ATOL + RTOL * np.abs(e_o)
    else:
        tol = (ATOL * min(1.0, sv) + 1e-37 + RTOL * np.abs(e_o)
               + 1.01 * (rel + (Lk + 4) * EPS32) * wv)
    both = np.isfinite(a_o) & np.isfinite(e_o) & ~skip_o
    bad = both & ~(np.abs(a_o - e_o) <= tol)
    assert not bad.any(), (
        f"output: {bad.sum()} element(s) off, first at {np.argwhere(bad)[0]}: "
        f"{a_o[bad][0]!r} vs {e_o[bad][0]!r} (tol {tol[bad][0]:.3g})")

    # structure: a row the reference leaves empty (fully masked, padded query,
    # all scores -inf) is exactly zero; weights of finite problems are a
    # distribution; outputs of finite problems lie within the values' range
    empty = (e_w == 0).all(-1)                                                   # (B,H,Lq)
    assert (a_o[empty] == 0).all(), "a fully masked row is not zero in the output"
    if a_w is not None:
        assert (a_w[empty] == 0).all(), "a fully masked row is not zero in the weights"
    finite_problem = all(np.isfinite(x).all() for x in (p.q, p.k, p.v)) and (
        p.mask is None or p.mask.dtype == np.bool_ or not np.isnan(p.mask).any()
        and not np.isposinf(p.mask).any())
    if finite_problem:
        assert np.isfinite(a_o).all(), "finite inputs gave a non-finite output"
        if a_w is not None:
            assert np.isfinite(a_w).all() and (a_w >= 0).all() and (a_w <= 1 + 1e-6).all()
            sums = a_w.sum(-1)
            assert np.all((sums == 0) == empty), "zero rows of the weights differ from the reference"
            assert np.all(empty | (np.abs(sums - 1) <= 1e-5 * max(1, Lk / 64))), "weights do not sum to 1"
        if Lk and v.size:
            lo = v.min(axis=2, keepdims=True)
            hi = v.max(axis=2, keepdims=True)
            slack = 1e-5 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-37
            inside = (a_o >= np.minimum(lo, 0) - slack) & (a_o <= np.maximum(hi, 0) + slack)
            assert inside.all(), "an output lies outside the range of the values"


def _snapshot(objs):
    return [(o, o.copy(), o.__array_interface__["data"][0]) for o in objs
            if isinstance(o, np.ndarray)]


# ------------------------------------------------------------- properties

@given(problems())
def test_matches_reference(isa, problem):
    """Any valid problem: attnx agrees with the float64 reference (per regime)."""
    args, kwargs, info = problem
    note(f"info={info}")
    note("shapes/strides/aligned: " + repr([(a.shape, a.dtype.str, a.strides, a.flags.aligned)
                                            for a in args]))
    inputs = list(args) + [kwargs.get(k) for k in ("attn_mask", "key_lengths", "query_lengths")]
    before = _snapshot(inputs)
    got = attnx.scaled_dot_product_attention(*args, **kwargs)
    ref = attnx.reference(*args, **dict(kwargs, need_weights=True))
    for o, copy, _ in before:
        assert o.dtype == copy.dtype and o.tobytes() == copy.tobytes(), "an input was modified"
    got_out, got_w = got if kwargs["need_weights"] else (got, None)
    for r in (got_out, got_w):
        if r is not None:
            assert isinstance(r, np.ndarray) and r.dtype == np.float32
            assert r.flags.writeable and r.flags.aligned
            assert not any(np.may_share_memory(r, o) for o, _, _ in before), "result aliases an input"
    assert got_out.shape == ref[0].shape
    if got_w is not None:
        assert got_w.shape == ref[1].shape
    _compare(got_out, got_w, ref[0], ref[1], args, kwargs, info)


@st.composite
def forward_calls(draw):
    """Arguments of the private _attnx.forward, with memory the Python layer
    would have normalised away (misaligned, non-unit last strides, ...)."""
    B, Hk = draw(small), draw(small)
    group = draw(st.sampled_from([1, 2]))
    Hq = Hk * group
    Lq, Lk, E, Ev = (draw(st.integers(1, 9) | st.sampled_from([0, 17, 33, 65])) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    arr = {}
    for name, shp in (("q", (B, Hq, Lq, E)), ("k", (B, Hk, Lk, E)), ("v", (B, Hk, Lk, Ev))):
        arr[name] = place(rng.standard_normal(shp), np.float32, draw(memory(4)))
    full = (B, Hq, Lq, Lk)
    mask = None
    kind = draw(st.sampled_from([None, "bool", "float"]))
    if kind:
        mshape = tuple(n if draw(st.booleans()) else 1 for n in full)
        if kind == "bool":
            vals, dt = rng.random(mshape) < 0.7, np.bool_
        else:
            vals, dt = np.where(rng.random(mshape) < 0.2, -np.inf, rng.standard_normal(mshape)), np.float32
        mask = np.broadcast_to(place(vals, dt, draw(memory(4))), full)   # zero strides
    lens = []
    for L in (Lk, Lq):
        if draw(st.booleans()):
            lens.append(None)
            continue
        vals = rng.integers(0, L + 1, size=(B, Hq))
        lens.append(place(vals, np.int64, draw(memory(2))))
    out = np.zeros((B, Hq, Lq, Ev), np.float32)
    weights = np.zeros(full, np.float32) if draw(st.booleans()) else None
    causal = draw(st.sampled_from([0, 1, 2]))
    return arr, mask, lens, out, weights, causal


def _acceptable(a):
    """Arrays the core documents as readable in place."""
    return a.size == 0 or (a.flags.aligned and (a.shape[-1] <= 1 or a.strides[-1] == a.itemsize)
                           and all(s % a.itemsize == 0 for s in a.strides))


@given(forward_calls())
def test_forward_reads_views_or_refuses(isa, call):
    """The glue reads any aligned view with a unit last stride correctly, and
    refuses (TypeError/ValueError, out untouched) what it cannot read."""
    arr, mask, (kl, ql), out, weights, causal = call
    q, k, v = arr["q"], arr["k"], arr["v"]
    note(repr([(a.shape, a.strides, a.flags.aligned) for a in (q, k, v)]))
    readable = all(_acceptable(a) for a in (q, k, v))
    readable &= mask is None or mask.size == 0 or mask.flags.aligned
    readable &= all(x is None or x.size == 0 or x.flags.aligned for x in (kl, ql))
    try:
        _attnx.forward(q, k, v, out, weights, mask, kl, ql, causal, 0.375)
    except (TypeError, ValueError) as exc:
        assert str(exc), "an error without a message"
        assert not readable, f"refused a readable view: {exc}"
        assert not out.any(), "out was written before the error"
        return
    assert readable or out.size == 0 or q.size == 0 or k.size == 0 or v.size == 0, (
        "an unreadable (misaligned or strided) view was accepted")
    causal_s = {0: False, 1: True, 2: "lower_right"}[causal]
    ref_out, ref_w = attnx._reference.reference_attention(q, k, v, mask, causal_s, 0.375, kl, ql)
    assert_close(out, ref_out, err_msg="output")
    if weights is not None:
        assert_close(weights, ref_w, err_msg="weights")


def _misaligned(x, dtype, offset):
    """``x`` as ``dtype`` in a view ``offset`` bytes into a uint8 buffer."""
    buf = np.zeros(x.size * np.dtype(dtype).itemsize + offset, np.uint8)
    a = np.ndarray(x.shape, dtype, buffer=buf, offset=offset)
    a[...] = x
    assert a.flags.aligned == (offset % np.dtype(dtype).itemsize == 0) or a.size <= 1
    return a


@given(st.integers(1, 3), st.sampled_from(FLOATS),
       st.integers(1, 40), st.integers(1, 40), st.integers(1, 20))
def test_misaligned_views_are_read_correctly(isa, offset, dtype, Lq, Lk, E):
    """q, k, v and a float mask in views at byte offset 1..3 of a uint8 buffer
    (misaligned for float32/64, and for float16 at odd offsets) give exactly
    what aligned copies give."""
    rng = np.random.default_rng(Lq * 1000 + Lk * 10 + E)
    views = [_misaligned(rng.standard_normal((2, s, E)), dtype, offset) for s in (Lq, Lk, Lk)]
    mask = _misaligned(rng.standard_normal((Lq, Lk)), np.float32, offset)
    got = attnx.scaled_dot_product_attention(*views, attn_mask=mask)
    aligned = attnx.scaled_dot_product_attention(*(np.array(a) for a in views),
                                                 attn_mask=np.array(mask))
    np.testing.assert_array_equal(got, aligned)
    assert_close(got, attnx.reference(*views, attn_mask=mask))


@pytest.mark.parametrize("offset", [1, 2, 3, 4])
@pytest.mark.parametrize("which", ["key_lengths", "query_lengths"])
def test_misaligned_lengths(offset, which):
    """int64 lengths in a misaligned view are read (copied) like any other
    input, not refused with an error about strides the caller never chose."""
    q = np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32)
    lengths = _misaligned(np.array([5, 2]), np.int64, offset)
    got = attnx.scaled_dot_product_attention(q, q, q, **{which: lengths})
    assert_close(got, attnx.reference(q, q, q, **{which: np.array(lengths)}))
