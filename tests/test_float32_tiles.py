"""Float32 scores on AMX tiles (kernels.h, qk_split): on a CPU with AMX-BF16
the forward splits float32 queries, keys and values exactly into three
bfloat16 parts each and sums six of the nine tile products of parts, where a
key tile meets 12 query blocks of 64 or more (of the heads that share it:
prefill, not decoding). The result is float32-exact
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

# (B, Hq, Hk, Lq, Lk, D, Dv, options): 12 and 13 query blocks a key tile, by
# the queries of a head or of a GQA group, D around multiples of 32, masks,
# the weights, causal, a window
CASES = [
    (1, 2, 2, 800, 200, 64, 64, {}),
    (1, 2, 2, 770, 77, 80, 48, {"is_causal": True}),
    (2, 12, 2, 65, 300, 128, 128, {"enable_gqa": True}),
    (1, 12, 1, 50, 150, 32, 16, {"need_weights": True, "enable_gqa": True}),
    (1, 1, 1, 800, 800, 96, 96, {"window": (40, 0)}),
    (1, 3, 3, 769, 129, 47, 47, {"mask": "bool"}),
    (1, 2, 2, 768, 33, 7, 9, {}),
    # a head's parts take 12.7 MiB, more than half of ATTNX_SPLIT_BYTES (16
    # MiB): one head a group, two groups one after the other
    (1, 2, 2, 768, 4096, 256, 256, {}),
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
out["11 blocks a key tile"] = sdpa(q[:, :, :704], k, v)
out["scale above 1"] = sdpa(q, k, v, scale=4.0)
out["Dv not a multiple of 16"] = sdpa(q, k, v[..., :40])
for name, value in (("inf", np.inf), ("nan", np.nan), ("2^100", 2.0 ** 100)):
    k2, v2 = k.copy(), v.copy()
    k2[0, 1, 7, 3] = v2[0, 1, 9, 2] = value
    out["key and value " + name] = sdpa(q, k2, v2)[:, 1]      # head 1 holds them
    q2 = q.copy()
    q2[0, 0, 70, 5] = value * 8    # the split takes q times the scale, 1/8
    out["query " + name] = sdpa(q2, k, v)[:, 0, 64:128]       # its block of 64
np.savez(sys.argv[1], **out)
"""


def _run(dots, path):
    env = dict(os.environ, ATTNX_ISA="avx512")
    env.pop("ATTNX_BF16_DOTS", None)
    if dots:
        env["ATTNX_BF16_DOTS"] = dots
    subprocess.run([sys.executable, "-c", _RUN, str(path)], env=env, check=True)
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
    same = ["decoding", "11 blocks a key tile", "scale above 1"] + \
        ["key and value " + s for s in ("inf", "nan", "2^100")]
    if dots != "amx":
        same = list(fmas)                                       # no split without AMX
    for name in fmas:
        if name in same:
            assert tiles[name].tobytes() == fmas[name].tobytes(), name
        else:
            assert tiles[name].tobytes() != fmas[name].tobytes(), name
            np.testing.assert_allclose(tiles[name], fmas[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
