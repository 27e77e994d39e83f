"""Float32 scores on AMX tiles (kernels.h, qk_split): on a CPU with AMX-BF16
the forward splits float32 queries, keys and values exactly into three
bfloat16 parts each and sums six of the nine tile products of parts, where a
key tile meets 12 query blocks of 64 or more (of the heads that share it:
prefill, not decoding). The result is float32-exact
(within the float32 tolerances of the float64 reference), not the FMA path's
bits. ATTNX_BF16_DOTS=none keeps the FMAs. Inputs the split cannot take
(|x| >= 2^100, inf, NaN, and 0 < |x| < 2^-80, whose parts and products the
tiles would flush) and a scale above 1 keep the FMAs: their bits are the FMA
path's.

The backward takes the same split for its two score-like products, S = Q·Kᵀ
and dP = dO·Vᵀ, where D and Dv are 33 to 64 and a key tile meets 2 query
blocks, a slice of at most 512 keys at a time (plan.c); not with a mask's
gradient."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import attnx
from attnx import _attnx
from attnx._functional import CALL_THREADS
from conftest import assert_close, check_vjp, randn, random_bool_mask

# (B, Hq, Hk, Lq, Lk, D, Dv, options): 12 and 13 query blocks a key tile, by
# the queries of a head or of a GQA group, D around multiples of 32, masks,
# the weights, causal, a window. The heads' parts go through the slots of
# the forward's pipeline (forward.c): 3 slots and 4 heads (B=2, Hk=2), so
# that the fourth head's split reuses the first's slot
CASES = [
    (1, 2, 2, 800, 200, 64, 64, {}),
    (1, 2, 2, 770, 77, 80, 48, {"is_causal": True}),
    (2, 12, 2, 65, 300, 128, 128, {"enable_gqa": True}),
    (1, 12, 1, 50, 150, 32, 16, {"need_weights": True, "enable_gqa": True}),
    (1, 1, 1, 800, 800, 96, 96, {"window": (40, 0)}),
    (1, 3, 3, 769, 129, 47, 47, {"mask": "bool"}),
    (1, 2, 2, 768, 33, 7, 9, {}),
    # a head's parts take 12.7 MiB, more than half of ATTNX_SPLIT_BYTES (16
    # MiB): one slot, each head split before its items
    (1, 2, 2, 768, 4096, 256, 256, {}),
    # 6.4 MiB a head: two slots, and the third head's split waits for the
    # first head's items
    (1, 3, 3, 768, 2048, 256, 256, {}),
]


def inputs(rng, case):
    """q, k, v and the options of a case, "mask": "bool" made a random mask."""
    B, Hq, Hk, Lq, Lk, D, Dv, kw = case
    q, k, v = randn(rng, (B, Hq, Lq, D)), randn(rng, (B, Hk, Lk, D)), randn(rng, (B, Hk, Lk, Dv))
    kw = dict(kw)
    if kw.pop("mask", None) == "bool":
        kw["attn_mask"] = random_bool_mask(rng, (B, 1, Lq, Lk))
    return q, k, v, kw


def check_exact(rng, case):
    """attnx against the float64 reference on a case's inputs."""
    q, k, v, kw = inputs(rng, case)
    out = attnx.scaled_dot_product_attention(q, k, v, **kw)
    want = attnx.reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw)
    if kw.get("need_weights"):
        assert_close(out[0], want[0])
        assert_close(out[1], want[1])
    else:
        assert_close(out, want)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_float32_is_exact_on_every_path(isa, rng, case):
    check_exact(rng, case)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[7], CASES[8]],
                         ids=["2 slots 2 heads", "3 slots 4 heads", "1 slot", "2 slots 3 heads"])
def test_the_pipeline_with_more_threads_than_cores(rng, case):
    """The pipeline's waits (a head's items for its split, a split for the
    items of its slot's last head) with 7 threads for the call
    (CALL_THREADS) on this machine's cores, some of which wait while the one
    they wait for is not running. The items may take key ranges of their
    own (split-K) here."""
    token = CALL_THREADS.set(7)
    try:
        check_exact(rng, case)
    finally:
        CALL_THREADS.reset(token)


_RUN = """
import sys
import numpy as np, attnx
from attnx import _attnx
rng = np.random.default_rng(11)
def r(*s):
    return rng.standard_normal(s).astype(np.float32)
out = {"dots": np.array(str(_attnx.bf16_dots()))}
q, k, v = r(1, 2, 800, 64), r(1, 2, 800, 64), r(1, 2, 800, 64)
sdpa = attnx.scaled_dot_product_attention
out["prefill"] = sdpa(q, k, v)
out["gqa"] = sdpa(r(1, 12, 65, 80), r(1, 2, 90, 80), r(1, 2, 90, 80), enable_gqa=True)
out["decoding"] = sdpa(q[:, :, :1], k, v)
out["values 1e-34"] = sdpa(q, k, v * np.float32(1e-34))      # small normal values
out["values 1e-36"] = sdpa(q, k, v * np.float32(1e-36))
out["11 blocks a key tile"] = sdpa(q[:, :, :704], k, v)
out["scale above 1"] = sdpa(q, k, v, scale=4.0)
out["Dv not a multiple of 16"] = sdpa(q, k, v[..., :40])
for name, value in (("inf", np.inf), ("nan", np.nan), ("2^100", 2.0 ** 100), ("1e-30", 1e-30)):
    k2, v2 = k.copy(), v.copy()
    k2[0, 1, 7, 3] = v2[0, 1, 9, 2] = value
    out["key and value " + name] = sdpa(q, k2, v2)[:, 1]      # head 1 holds them
    q2 = q.copy()
    q2[0, 0, 70, 5] = value * 8    # the split takes q times the scale, 1/8
    out["query " + name] = sdpa(q2, k, v)[:, 0, 64:128]       # its block of 64
np.savez(sys.argv[1], **out)
"""


def _run(dots, path, script=_RUN):
    """script's arrays, run in a subprocess on avx512 with ATTNX_BF16_DOTS=dots (None: the best)."""
    env = dict(os.environ, ATTNX_ISA="avx512")
    env.pop("ATTNX_BF16_DOTS", None)
    if dots:
        env["ATTNX_BF16_DOTS"] = dots
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
    return dict(np.load(path))


def test_the_tiles_take_prefill_and_leave_the_rest(tmp_path):
    """With AMX the prefill's scores and P·V are on tiles (other bits than the
    FMAs'); decoding, a key tile met by 11 query blocks, a scale above 1 and
    inputs the split cannot take keep the FMAs' bits: keys and values per
    head (the other head still takes the tiles), queries per block of 64 (its
    scores; its P·V stays on tiles, float32-exact either way)."""
    if "avx512" not in _attnx.available_isas():
        pytest.skip("no AVX-512")
    tiles, fmas = _run(None, tmp_path / "tiles.npz"), _run("none", tmp_path / "fmas.npz")
    assert str(fmas.pop("dots")) == "None"
    dots = str(tiles.pop("dots"))
    same = ["decoding", "11 blocks a key tile", "scale above 1", "values 1e-34",
            "values 1e-36"] + ["key and value " + s for s in ("inf", "nan", "2^100", "1e-30")]
    if dots != "amx":
        same = list(fmas)                                       # no split without AMX
    for name in fmas:
        equal = tiles[name].tobytes() == fmas[name].tobytes()   # a bool: no diff on failure
        if name in same:
            assert equal, name
        else:
            assert not equal, name
            np.testing.assert_allclose(tiles[name], fmas[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)


# (B, Hq, Hk, Lq, Lk, D, Dv, options): the backward's split (D, Dv in 33..64)
# over one and several slices of 512 keys, ranges of keys split across
# threads (one head), GQA, causal, a window, a softcap, a bool mask, D and
# Dv short of 64; and D=128, which keeps the FMAs
BACKWARD_CASES = [
    (1, 2, 2, 300, 200, 64, 64, {}),
    (1, 4, 4, 200, 1100, 64, 64, {}),
    (1, 1, 1, 700, 1500, 64, 64, {"is_causal": True}),
    (2, 8, 2, 100, 600, 64, 48, {"enable_gqa": True}),
    (1, 2, 2, 600, 600, 47, 40, {"window": (100, 20)}),
    (1, 2, 2, 300, 300, 64, 64, {"softcap": 5.0}),
    (1, 3, 3, 260, 129, 64, 64, {"mask": "bool"}),
    (1, 2, 2, 300, 300, 128, 128, {}),
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[str(i) for i in range(len(BACKWARD_CASES))])
def test_backward_float32_is_exact_on_every_path(isa, rng, case):
    q, k, v, kw = inputs(rng, case)
    check_vjp(rng, q, k, v, **kw)


@pytest.mark.parametrize("where", ["key", "value"])
def test_backward_values_the_split_cannot_take(isa, rng, where):
    """A key (or value) of 2^115 in one head: 65537·x overflows, so a split
    of it would be inf and NaN; its item's S (or dP) takes the FMAs, and the
    gradients stay finite and near the float64 oracle's. (Against the
    largest element: the sums with a 2^115 term cancel, and float32 on any
    path loses relative accuracy in the small ones.)"""
    q, k, v = randn(rng, (1, 2, 300, 64)), randn(rng, (1, 2, 300, 64)), randn(rng, (1, 2, 300, 64))
    if where == "key":
        k[0, 1, 7, 3] = 2.0 ** 115
        q *= 2.0 ** -120     # scores stay small, so the gradients stay finite
    else:
        v[0, 1, 9, 2] = 2.0 ** 115
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v)
    dout = randn(rng, out.shape)
    got, ref = vjp(dout), attnx.reference_backward(dout, q, k, v)
    for name in ("query", "key", "value"):
        g, r = getattr(got, name).astype(np.float64), getattr(ref, name)
        assert np.isfinite(g).all(), name
        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max(), name


_RUN_BACKWARD = """
import sys
import numpy as np, attnx
from attnx import _attnx
rng = np.random.default_rng(12)
def r(*s):
    return rng.standard_normal(s).astype(np.float32)
def grads(q, k, v, **kw):
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
    g = vjp(r(*out.shape))
    return np.concatenate([g.query.ravel(), g.key.ravel(), g.value.ravel()])
out = {"dots": np.array(str(_attnx.bf16_dots()))}
q, k, v = r(1, 2, 300, 64), r(1, 2, 300, 64), r(1, 2, 300, 64)
out["D=64"] = grads(q, k, v)
out["D=128"] = grads(r(1, 2, 300, 128), r(1, 2, 300, 128), r(1, 2, 300, 128))
out["float mask"] = grads(q, k, v, attn_mask=r(1, 1, 300, 300))
out["one query block"] = grads(q[:, :1, :64], k[:, :1], v[:, :1])
np.savez(sys.argv[1], **out)
"""


def test_the_backward_takes_the_tiles_where_planned(tmp_path):
    """With AMX, D=64's gradients come from tiles (other bits than the
    FMAs'); D=128, a float mask (whose gradient needs dS the FMA way) and a
    key tile met by one query block keep the FMAs' bits."""
    if "avx512" not in _attnx.available_isas():
        pytest.skip("no AVX-512")
    runs = {dots: _run(dots, tmp_path / f"{dots}.npz", _RUN_BACKWARD) for dots in (None, "none")}
    assert str(runs["none"].pop("dots")) == "None"
    with_amx = str(runs[None].pop("dots")) == "amx"
    for name, fmas in runs["none"].items():
        tiles = runs[None][name]
        same = tiles.tobytes() == fmas.tobytes()   # a bool: no diff of megabytes on failure
        if with_amx and name == "D=64":
            assert not same, name
            np.testing.assert_allclose(tiles, fmas, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            assert same, name


@pytest.mark.parametrize("magnitude", [1e-34, 1e-36, 1e-30])
def test_small_normal_values_keep_float32_accuracy(isa, rng, magnitude):
    """Issue 33, defect 4: values far below 1 but normal lose nothing beyond
    float32 rounding on any path: on AMX tiles their bfloat16 parts (and the
    parts' products) fell below the normal range and were flushed (V ~ 1e-34:
    a relative error of 4.6e-4, 1e-36: 0.04, where the FMAs had 8e-7); such
    heads now keep the FMAs. The error is measured relative to the output's
    size, forward and gradients, with random upstream gradients. On a CPU
    without AMX every path here is the FMAs' (the test then checks those)."""
    q, k, v = (randn(rng, (1, 2, 800, 64)) for _ in range(3))
    small = np.float32(magnitude)
    out = attnx.scaled_dot_product_attention(q, k, v * small)
    ref = attnx.reference(q, k, (v * small).astype(np.float64))
    assert_close(out / small, ref / float(small))
    # the same values in the queries, against keys as large (scores of order 1)
    big = np.float32(1 / magnitude)
    out = attnx.scaled_dot_product_attention(q * small, k * big, v)
    assert_close(out, attnx.reference((q * small).astype(np.float64), k * big, v))
    check_vjp(rng, q[:, :, :200], k[:, :, :200], v[:, :, :200] * small)
