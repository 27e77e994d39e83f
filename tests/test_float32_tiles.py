"""Float32 scores on AMX tiles (kernels.h, qk_split): on a CPU with AMX-BF16
the forward splits float32 queries and keys exactly into three bfloat16 parts
each and sums six of the nine tile products of parts, where a key tile meets
two query blocks or more (prefill; not decoding). The result is float32-exact
(within the float32 tolerances of the float64 reference), not the FMA path's
bits. ATTNX_BF16_DOTS=none keeps the FMAs. Inputs the split cannot take
(|x| >= 2^100, inf, NaN) and a scale above 1 keep the FMAs: their bits are
the FMA path's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import assert_close, randn, random_bool_mask

# (B, Hq, Hk, Lq, Lk, D, Dv, options): one and two query blocks a head, GQA,
# D around multiples of 32, masks, the weights, causal, a window
CASES = [
    (1, 2, 2, 200, 200, 64, 64, {}),
    (1, 2, 2, 130, 77, 80, 48, {"is_causal": True}),
    (2, 4, 2, 65, 300, 128, 128, {"enable_gqa": True}),
    (1, 2, 1, 100, 150, 32, 16, {"need_weights": True, "enable_gqa": True}),
    (1, 1, 1, 300, 300, 96, 96, {"window": (40, 0)}),
    (1, 3, 3, 129, 129, 47, 47, {"mask": "bool"}),
    (1, 2, 2, 140, 33, 7, 9, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_float32_is_exact_on_every_path(isa, rng, case):
    B, Hq, Hk, Lq, Lk, D, Dv, kw = case
    q, k, v = randn(rng, (B, Hq, Lq, D)), randn(rng, (B, Hk, Lk, D)), randn(rng, (B, Hk, Lk, Dv))
    kw = dict(kw)
    if kw.get("mask") == "bool":
        kw["attn_mask"] = random_bool_mask(rng, (B, 1, Lq, Lk))
        del kw["mask"]
    out = attnx.scaled_dot_product_attention(q, k, v, **kw)
    want = attnx.reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw)
    if kw.get("need_weights"):
        assert_close(out[0], want[0])
        assert_close(out[1], want[1])
    else:
        assert_close(out, want)


_RUN = """
import hashlib, json, sys
import numpy as np, attnx
from attnx import _attnx
rng = np.random.default_rng(11)
def r(*s):
    return rng.standard_normal(s).astype(np.float32)
def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
out = {"dots": _attnx.bf16_dots()}
q, k, v = r(1, 2, 200, 64), r(1, 2, 200, 64), r(1, 2, 200, 64)
sdpa = attnx.scaled_dot_product_attention
out["prefill"] = digest(sdpa(q, k, v))
out["gqa"] = digest(sdpa(r(1, 4, 65, 80), r(1, 2, 90, 80), r(1, 2, 90, 80), enable_gqa=True))
out["decoding"] = digest(sdpa(q[:, :, :1], k, v))
out["one block a key tile"] = digest(sdpa(q[:, :, :64], k, v))
out["scale above 1"] = digest(sdpa(q, k, v, scale=4.0))
for name, value in (("inf", np.inf), ("nan", np.nan), ("2^100", 2.0 ** 100)):
    k2 = k.copy()
    k2[0, 1, 7, 3] = value
    out["key " + name] = digest(sdpa(q, k2, v)[:, 1])   # head 1 holds it
    q2 = q.copy()
    q2[0, 0, 70, 5] = value * 8    # the split takes q times the scale, 1/8
    out["query " + name] = digest(sdpa(q2, k, v)[:, 0, 64:128])   # its block of 64
print(json.dumps(out))
"""


def _run(dots):
    env = dict(os.environ, ATTNX_ISA="avx512")
    env.pop("ATTNX_BF16_DOTS", None)
    if dots:
        env["ATTNX_BF16_DOTS"] = dots
    res = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout)


def test_the_tiles_take_prefill_and_leave_the_rest():
    """With AMX the prefill's scores are on tiles (other bits than the FMAs');
    decoding, a key tile met by one query block, a scale above 1 and inputs
    the split cannot take keep the FMAs' bits, and so do the heads and query
    blocks that hold such a value (the others still take the tiles)."""
    if "avx512" not in _attnx.available_isas():
        pytest.skip("no AVX-512")
    tiles, fmas = _run(None), _run("none")
    assert fmas["dots"] is None
    if tiles["dots"] != "amx":
        assert tiles == dict(fmas, dots=tiles["dots"])      # no split without AMX
        pytest.skip("no AMX here: every path is the FMAs'")
    assert tiles["prefill"] != fmas["prefill"]
    assert tiles["gqa"] != fmas["gqa"]
    for same in ["decoding", "one block a key tile", "scale above 1", "key inf", "key nan",
                 "key 2^100", "query inf", "query nan", "query 2^100"]:
        assert tiles[same] == fmas[same], same
