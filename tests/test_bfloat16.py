"""bfloat16 inputs (``ml_dtypes.bfloat16``, and torch's bfloat16 tensors), computed in float32.

attnx recognises the dtype by name without importing ml_dtypes; keys and
values in bfloat16 are read in place by the kernels (a 16-bit shift per
element, in registers when decoding, tile by tile otherwise), so the result
is the float32 computation on the bfloat16 values: the same bits as the
float32 arrays holding those values, and within the float64 reference on
them. Every ISA; forward over every option, gradients with random upstream
gradients, torch tensors with and without ml_dtypes installed.

The one exception, the bfloat16 dot products: with q, k and v all bfloat16
on a CPU with AVX512_BF16 and the AVX-512 kernels (``_attnx.bf16_dots()``),
blocks of more than a few query rows compute Q·Kᵀ with vdpbf16ps, or AMX's
tiles where the CPU has them (another order of the sums, the scale applied
to them, subnormals flushed to zero), and with AMX P·V too (P split exactly
into three bfloat16 parts, summed in another order):
within the float64 reference by the same tolerances, but not the float32
call's bits. Which of the two a case checks is spelled out in it
(``_dots_path``); ``test_the_bfloat16_dot_path_is_used`` fails where the CPU
has the instructions and the path is not taken.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import GATOL, GRTOL, assert_close, randn, random_bool_mask, random_float_mask

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf(x):
    return np.asarray(x).astype(BF16)


def f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


# (B, Hq, Hk, Lq, Lk, E, Ev, options): decoding shapes (the kernels that
# convert in registers, split-K), tiles (converted in scratch), every option
CASES = [
    (1, 4, 4, 1, 700, 64, 64, {}),
    (2, 8, 2, 3, 300, 40, 24, {"enable_gqa": True}),
    (2, 2, 2, 70, 150, 33, 17, {"is_causal": True}),
    (1, 3, 3, 130, 260, 16, 16, {"is_causal": "lower_right", "key_lengths": [200]}),
    (2, 2, 1, 65, 129, 8, 8, {"enable_gqa": True, "window": (20, 3)}),
    (1, 2, 2, 2, 90, 24, 24, {"sinks": [0.5, -1.0], "softcap": 5.0}),
    (1, 2, 2, 40, 90, 24, 24, {"alibi_slopes": [0.25, 0.0625]}),
    (2, 2, 2, 33, 47, 8, 8, {"layout": "blhd"}),
]


def cpu_flags():
    """The flags /proc/cpuinfo lists (None where there is no such file); in
    the test build whose AVX-512 kernels run on SIMDe (tools/emulate.sh),
    with AVX-512's and AVX512_BF16's, and never AMX's."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    if _attnx.EMULATED_AVX512:
        flags = (flags | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}) - {"amx_bf16"}
    return flags


def tiles_granted():
    """Whether Linux has granted this process AMX's tile state
    (arch_prctl(ARCH_GET_XCOMP_PERM) lists XTILEDATA, bit 18); the core asks
    for it when it first picks its dot products, and Linux refuses while a
    thread's signal stack is too small for the tiles (under a sanitizer's
    own stack, say)."""
    import ctypes
    if "avx512" in _attnx.available_isas():     # the core's probe has run
        previous = _attnx.isa()
        _attnx.set_isa("avx512")
        _attnx.bf16_dots()
        _attnx.set_isa(previous)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(0)
        if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:    # x86-64 SYS_arch_prctl
            return False
    except (OSError, AttributeError):
        return False
    return bool(mask.value >> 18 & 1)


#: the dot products ATTNX_BF16_DOTS names, best first: a CPU that has one has
#: every later one
DOTS = ("amx", "avx512_bf16", "none")
#: named only, never the best: amx.c on the tile unit's model, wherever
#: there is AVX512_BF16
ASKED_ONLY = ("amx_emulated",)


def expected_dots(ask):
    """The bfloat16 dot products the AVX-512 kernels should have here, with
    ATTNX_BF16_DOTS=ask (None: unset): the one asked for if the CPU has it,
    else the best it has: AMX's tiles on a CPU with AMX-BF16 where Linux
    granted the tile state, vdpbf16ps on a CPU with AVX512_BF16, or none.
    None where the flags cannot be read."""
    flags = cpu_flags()
    if flags is None:
        return None
    if "avx512_bf16" not in flags:
        best = "none"
    elif {"amx_bf16", "amx_tile"} <= flags and sys.platform.startswith("linux") and tiles_granted():
        best = "amx"
    else:
        best = "avx512_bf16"
    if ask in ASKED_ONLY and best != "none":
        return ask
    return ask if ask in DOTS and DOTS.index(ask) >= DOTS.index(best) else best


#: blocks of at most this many query rows are decoded with the row kernels,
#: on the float32 path (the AVX-512 kernels' dot_max_nq)
ROWS_MAX = 8


def _dots_path(which, Lq):
    """Whether an all-bfloat16 (``which == "all"``) forward with Lq query rows
    takes the bfloat16 dot products for some of its blocks."""
    return which == "all" and _attnx.bf16_dots() and Lq > ROWS_MAX


def _inputs(rng, case):
    B, Hq, Hk, Lq, Lk, E, Ev, kw = case
    q, k, v = randn(rng, (B, Hq, Lq, E)), randn(rng, (B, Hk, Lk, E)), randn(rng, (B, Hk, Lk, Ev))
    if kw.get("layout") == "blhd":
        q, k, v = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    return q, k, v, dict(kw)


@pytest.mark.parametrize("which", ["all", "kv"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_forward_is_float32_on_the_bfloat16_values(isa, rng, case, which):
    q, k, v, kw = _inputs(rng, case)
    qb = bf(q) if which == "all" else q
    kb, vb = bf(k), bf(v)
    q32 = qb.astype(np.float32)
    k32, v32 = kb.astype(np.float32), vb.astype(np.float32)
    out = attnx.scaled_dot_product_attention(qb, kb, vb, **kw)
    assert out.dtype == np.float32
    assert_close(out, attnx.reference(f64(qb), f64(kb), f64(vb), **kw))
    if _dots_path(which, case[3]):
        return      # bfloat16 dot products: within the reference, not the float32 bits
    # the same float operations on the same values: the bits of the float32 call
    assert out.tobytes() == attnx.scaled_dot_product_attention(q32, k32, v32, **kw).tobytes()


def test_the_bfloat16_dot_path_is_used(rng):
    """On a CPU with AMX-BF16 or AVX512_BF16 the AVX-512 kernels have the
    bfloat16 dot products (the best of the two, unless ATTNX_BF16_DOTS asks),
    and an all-bfloat16 forward uses them (its bits are not the float32
    call's); on every other CPU and ISA they are absent. A CPU whose flags
    cannot be read is not guessed at."""
    want = expected_dots(os.environ.get("ATTNX_BF16_DOTS"))
    if want is None:
        pytest.skip("no /proc/cpuinfo to tell whether the CPU has AVX512_BF16")
    has = want != "none"
    previous = _attnx.isa()
    try:
        for name in _attnx.available_isas():
            _attnx.set_isa(name)
            assert _attnx.bf16_dots() == (want if has and name == "avx512" else None), name
        if not (has and "avx512" in _attnx.available_isas()):
            return
        _attnx.set_isa("avx512")
        q, k, v = (bf(randn(rng, (1, 2, 128, 64))) for _ in range(3))
        out = attnx.scaled_dot_product_attention(q, k, v)
        q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
        assert out.tobytes() != attnx.scaled_dot_product_attention(q32, k32, v32).tobytes()
        assert_close(out, attnx.reference(f64(q), f64(k), f64(v)))
        # keys and values alone in bfloat16 keep the float32 path
        out_kv = attnx.scaled_dot_product_attention(q32, k, v)
        assert out_kv.tobytes() == attnx.scaled_dot_product_attention(q32, k32, v32).tobytes()
    finally:
        _attnx.set_isa(previous)


_CHOSEN = """
import numpy as np, attnx, ml_dtypes
from attnx import _attnx
rng = np.random.default_rng(5)
worst = 0.0
# D a multiple of 32 and 16 keys or more: AMX's tiles for the scores (1 and
# 2 key and query tiles a block, keys left over); D=80: vdpbf16ps under AMX
# too; P·V on AMX's tiles for Dv a multiple of 16 (1 and 2 dim tiles), Dv=40
# not; with the weights (their second pass), and split-K (two rows, long keys)
for Lq, Lk, D, Dv, weights in [(9, 16, 32, 32, False), (64, 47, 64, 48, True),
                               (130, 200, 128, 128, False), (33, 300, 96, 96, True),
                               (64, 40, 80, 80, False), (40, 70, 64, 40, False),
                               (9, 5000, 64, 64, False)]:
    q, k, v = (rng.standard_normal((1, 2, L, E)).astype(ml_dtypes.bfloat16)
               for L, E in ((Lq, D), (Lk, D), (Lk, Dv)))
    kw = dict(is_causal=Lq == 64, need_weights=weights)
    out = attnx.scaled_dot_product_attention(q, k, v, **kw)
    ref = attnx.reference(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    for o, r in zip(*((out, ref) if weights else ((out,), (ref,)))):
        worst = max(worst, float(np.max(np.abs(o - r) / (1e-5 + 5e-6 * np.abs(r)))))
print(_attnx.bf16_dots(), worst)
"""


@pytest.mark.parametrize("ask", DOTS + ASKED_ONLY)
def test_the_bfloat16_dot_products_can_be_chosen(ask):
    """ATTNX_BF16_DOTS picks one of the dot products the CPU has (or none);
    one it lacks gives the best it has. Each gives the reference's values
    (within float32's tolerances) over the sizes AMX's tiles take and leave."""
    pytest.importorskip("ml_dtypes")
    want = expected_dots(ask)
    if want is None or "avx512" not in _attnx.available_isas():
        pytest.skip("no /proc/cpuinfo, or no AVX-512")
    env = dict(os.environ, ATTNX_BF16_DOTS=ask, ATTNX_ISA="avx512")
    res = subprocess.run([sys.executable, "-c", _CHOSEN], env=env, capture_output=True,
                         text=True, check=True)
    name, worst = res.stdout.split()
    assert name == ("None" if want == "none" else want)
    assert float(worst) <= 1.0, res.stdout


def test_values_of_inf_on_the_bfloat16_dot_path(isa, rng):
    """A value of inf gives inf in the rows that weigh it, as on the float32
    path, and the other columns keep their values. (AMX's P·V splits each
    probability into three bfloat16 parts, where 0 · inf would be NaN: its
    kernel takes FMAs for a tile with inf or NaN values, which
    tests/c/test_kernels.c checks; here rows that come out inf or NaN are
    recomputed exactly anyway.)"""
    q, k, v = (bf(randn(rng, (1, 2, 64, 64))) for _ in range(3))
    v[0, 0, 6, 3] = np.inf
    v[0, 1, 9, 5] = -np.inf
    out = attnx.scaled_dot_product_attention(q, k, v)
    out32 = attnx.scaled_dot_product_attention(*(a.astype(np.float32) for a in (q, k, v)))
    assert np.isposinf(out[0, 0, :, 3]).all() and np.isneginf(out[0, 1, :, 5]).all()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(out32))
    finite = np.isfinite(out32)
    assert_close(out[finite], out32[finite].astype(np.float64))


def test_subnormals_are_flushed_on_the_bfloat16_dot_path(isa, rng):
    """vdpbf16ps reads a subnormal bfloat16 as 0 (and flushes a subnormal sum
    to 0): queries of subnormal values alone, with a scale large enough to
    make their scores count on the float32 path (2^-130 · k · 2^127), score
    exactly 0 on the bfloat16 path: every key weighs the same, and each output
    row is the mean of the values."""
    q = bf(np.ldexp(rng.choice([-1.0, 1.0], (1, 1, 16, 8)), -130))     # bfloat16 subnormals
    k, v = bf(randn(rng, (1, 1, 32, 8))), bf(randn(rng, (1, 1, 32, 8)))
    scale = 2.0 ** 127
    out = attnx.scaled_dot_product_attention(q, k, v, scale=scale)
    mean = np.broadcast_to(f64(v).mean(axis=2, keepdims=True), out.shape)
    if _dots_path("all", q.shape[2]):
        assert_close(out, mean)
        assert_close(out, attnx.reference(np.zeros(q.shape), f64(k), f64(v), scale=scale))
    else:       # the float32 path keeps them: scores of order 1, not a uniform mean
        assert_close(out, attnx.reference(f64(q), f64(k), f64(v), scale=scale))
        assert np.abs(out - mean).max() > 0.1


def test_a_query_flag_that_does_not_hold_is_checked(isa, rng):
    """The core is told that q holds bfloat16 values, and checks it: a block of
    queries with another value takes a float32 path (here every block), never
    a truncated q. (With the flag, the blocks take the FMAs; without it, on an
    AMX CPU, the float32 products on tiles: both float32-exact, not the same
    bits.)"""
    q = randn(rng, (1, 2, 100, 16))                                    # not bfloat16 values
    k, v = bf(randn(rng, (1, 2, 50, 16))), bf(randn(rng, (1, 2, 50, 16)))
    want = attnx.reference(f64(q), f64(k), f64(v), scale=0.25)
    truncated = (q.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    wrong = attnx.reference(f64(truncated), f64(k), f64(v), scale=0.25)
    assert np.abs(want - wrong).max() > 1e-4                           # a truncated q shows
    for flag in (True, False):
        out = np.empty((1, 2, 100, 16), np.float32)
        _attnx.forward(q, k.view(np.uint16), v.view(np.uint16), out, None, None, None, None, 0,
                       0.25, None, None, 0, flag)
        assert_close(out, want)


@pytest.mark.parametrize("mask", ["bool", "float32", "bfloat16"])
def test_masks(isa, rng, mask):
    q, k, v = (bf(randn(rng, (2, 3, 20, 16))) for _ in range(3))
    m = random_bool_mask(rng, (2, 1, 20, 20)) if mask == "bool" else \
        random_float_mask(rng, (20, 20)).astype(np.float32 if mask == "float32" else BF16)
    out, w = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, need_weights=True)
    mref = m if mask == "bool" else f64(m)
    assert_close(out, attnx.reference(f64(q), f64(k), f64(v), attn_mask=mref))
    assert_close(w, attnx.reference(f64(q), f64(k), f64(v), attn_mask=mref, need_weights=True)[1])


@pytest.mark.parametrize("case", CASES[1:4] + CASES[5:6], ids=["gqa", "causal", "lengths", "sinks"])
def test_gradients(isa, rng, case):
    q, k, v, kw = _inputs(rng, case)
    q, k, v = bf(q), bf(k), bf(v)
    mask = random_float_mask(rng, (q.shape[-2], k.shape[-2])).astype(BF16)
    kw["attn_mask"] = mask
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
    dout = randn(rng, out.shape)
    got = vjp(dout)
    ref = attnx.reference_backward(dout, f64(q), f64(k), f64(v), **{**kw, "attn_mask": f64(mask)})
    for name in ("query", "key", "value", "attn_mask"):
        g = getattr(got, name)
        assert g.dtype == np.float32 and g.shape == getattr(ref, name).shape
        tol = GATOL * (np.sqrt(np.prod(q.shape[:-1])) if name == "attn_mask" else 1)
        assert_close(g, getattr(ref, name), tol, GRTOL, err_msg=name)


def test_keys_and_values_are_read_in_place(rng):
    """Decoding over a bfloat16 cache of 16 MiB allocates no float32 copy of it."""
    k = bf(randn(rng, (1, 8, 8192, 128)))
    v = bf(randn(rng, (1, 8, 8192, 128)))
    q = randn(rng, (1, 8, 1, 128))
    attnx.scaled_dot_product_attention(q, k, v)
    tracemalloc.start()
    try:
        attnx.scaled_dot_product_attention(q, k, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak            # a float32 copy of K would be 32 MiB


def test_inputs_are_not_modified(rng):
    q, k, v = (bf(randn(rng, (1, 2, 30, 8))) for _ in range(3))
    before = [a.copy() for a in (q, k, v)]
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    vjp(randn(rng, out.shape))
    for a, b in zip((q, k, v), before):
        assert a.dtype == BF16 and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("with_ml_dtypes", [True, False])
def test_torch_bfloat16_tensors(rng, monkeypatch, with_ml_dtypes):
    """torch's bfloat16 tensors, which NumPy cannot read, are read through their
    bits: as ml_dtypes.bfloat16 when installed (no copy), else as float32."""
    torch = pytest.importorskip("torch")
    if not with_ml_dtypes:
        monkeypatch.setitem(sys.modules, "ml_dtypes", None)      # import ml_dtypes fails
    q = torch.randn(2, 3, 9, 16).bfloat16()
    kv = torch.randn(2, 3, 40, 16).bfloat16()[:, :, ::2]        # a strided view
    out = attnx.scaled_dot_product_attention(q, kv, kv, is_causal="lower_right")
    ref = attnx.reference(q.double().numpy(), kv.double().numpy(), kv.double().numpy(),
                          is_causal="lower_right")
    assert_close(out, ref)
