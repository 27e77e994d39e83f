"""Shared fixtures and helpers for the attnx test suite.

* ``isa``: parametrises a test over the instruction sets the C core can run on
  this CPU (``attnx._attnx.available_isas()``), switching the kernels for the
  test and restoring the previous choice afterwards. When the environment sets
  ``ATTNX_ISA`` (as CI does, one job per ISA), only that ISA is used, so each
  CI job runs the whole suite on its own kernels.
* ``rng``: a NumPy Generator seeded from the test's id (reproducible, and
  different for every parametrised case).
* ``randn`` / ``make_qkv``: random float32 inputs; ``random_bool_mask``,
  ``random_float_mask``, ``random_mask``: random masks; ``DLPackOnly``: an
  array reachable through DLPack only.
* ``naive``: an independent float64 attention on explicit, fully materialised
  4-D arrays built by the test itself. ``attnx.reference`` shares the argument
  handling of ``attnx.scaled_dot_product_attention`` (layout, broadcasting,
  lengths), so the tests of that handling check against ``naive`` as well.
* ``assert_close(actual, expected64)``: the project's accuracy bar against the
  float64 reference, atol=1e-5 and rtol=5e-6; NaN positions must match and
  infinities must be equal. ``check_vjp``: a vjp's gradients for a random
  upstream gradient against ``attnx.reference_backward``, at ``GATOL`` and
  ``GRTOL`` (PyTorch's float32 SDPA gradient tolerances).
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest

import attnx
from attnx import _attnx

ATOL = 1e-5
RTOL = 5e-6
# gradients: PyTorch's own float32 tolerances for its CPU SDPA gradients
GATOL, GRTOL = 1.25e-5, 5.25e-6


# --------------------------------------------------------------------- ISAs

def under_asan():
    """True in a process with AddressSanitizer's runtime loaded (tools/sanitize.sh
    preloads it). Its quarantine keeps freed memory resident (256 MiB by default)
    and its shadow memory reserves terabytes of address space, so tests that
    measure or limit memory skip there."""
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def _selected_isas():
    """The ISAs the ``isa`` fixture runs over (respects ATTNX_ISA)."""
    available = list(_attnx.available_isas())
    forced = os.environ.get("ATTNX_ISA", "").strip().lower()
    if forced and forced != "all":
        # A CI job asking for an ISA this CPU lacks should fail loudly in the
        # fixture (it would otherwise silently test another one).
        return [forced]
    return available


ISAS = _selected_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test with the kernels of one instruction set, then restore."""
    name = request.param
    if name not in _attnx.available_isas():
        pytest.fail(f"ATTNX_ISA={name!r} is not available on this CPU; "
                    f"available: {_attnx.available_isas()}")
    previous = _attnx.isa()
    _attnx.set_isa(name)
    try:
        assert _attnx.isa() == name
        yield name
    finally:
        _attnx.set_isa(previous)


@pytest.fixture
def rng(request):
    """A Generator seeded from the test id: reproducible, distinct per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------ inputs

try:            # bfloat16 (the [test] extra installs ml_dtypes; attnx itself never imports it)
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None
#: the storage dtypes besides float32 that attnx computes in float32
LOW_FLOATS = [np.float16] + ([BF16] if BF16 is not None else [])

def randn(rng, shape, dtype=np.float32, scale=1.0):
    """Standard-normal values of ``shape`` (times ``scale``) as ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def random_page_table(rng, need, num_blocks):
    """A block table (N, max(need)) int32: sequence i's need[i] pages drawn
    from num_blocks in a random order, each page used once; 0 past them."""
    order = rng.permutation(num_blocks)
    table = np.zeros((len(need), max(need)), np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n]
        at += n
    return table


def make_qkv(rng, B=(2,), Hq=3, Lq=5, Lk=7, E=16, Ev=None, Hk=None, dtype=np.float32):
    """q (B..., Hq, Lq, E), k (B..., Hk, Lk, E), v (B..., Hk, Lk, Ev)."""
    B = tuple(B)
    Hk = Hq if Hk is None else Hk
    Ev = E if Ev is None else Ev
    q = randn(rng, B + (Hq, Lq, E), dtype)
    k = randn(rng, B + (Hk, Lk, E), dtype)
    v = randn(rng, B + (Hk, Lk, Ev), dtype)
    return q, k, v


class DLPackOnly:
    """Exposes its data through DLPack only (``np.asarray`` gives an object array)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def random_bool_mask(rng, shape, p=0.7):
    """A bool mask with roughly ``p`` of its entries True (= may attend)."""
    return rng.random(shape) < p


def random_float_mask(rng, shape, p_inf=0.2):
    """A float32 additive mask: normal values with ~``p_inf`` of them -inf."""
    m = rng.standard_normal(shape).astype(np.float32)
    m[rng.random(shape) < p_inf] = -np.inf
    return m


def random_mask(rng, kind, shape):
    """A random mask of ``kind`` "bool" or "float"; a 0-d bool mask is True and
    a 0-d float mask finite (either would otherwise block every key)."""
    if kind == "bool":
        m = random_bool_mask(rng, shape)
        if shape == ():
            m = np.array(True)
        return m
    return random_float_mask(rng, shape, p_inf=0.0 if shape == () else 0.2)


# ------------------------------------------------------------------ oracle

def naive(q, k, v, allowed=None, add=None, scale=None, row_ok=None):
    """Independent float64 attention on explicit 4-D arrays with finite inputs.

    q (B, H, Lq, E), k (B, H, Lk, E), v (B, H, Lk, Ev) (same heads);
    ``allowed``: bool broadcastable to the scores; ``add``: float added to
    them; ``row_ok``: bool (B, H, Lq, 1), rows that are False give zeros.
    A row with nothing allowed (or only -inf scores) gives zeros.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    E = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    s = np.einsum("bhie,bhje->bhij", q, k) * scale
    if add is not None:
        s = s + np.asarray(add, dtype=np.float64)
    ok = np.ones(s.shape, dtype=bool)
    if allowed is not None:
        ok &= np.broadcast_to(allowed, s.shape)
    ok &= s > -np.inf
    s = np.where(ok, s, -np.inf)
    if s.shape[-1]:
        m = s.max(axis=-1, keepdims=True)
    else:
        m = np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(ok, np.exp(s - m), 0.0)
    tot = p.sum(axis=-1, keepdims=True)
    w = np.divide(p, tot, out=np.zeros_like(p), where=tot > 0)
    if row_ok is not None:
        w = w * row_ok
    return np.einsum("bhij,bhjd->bhid", w, v), w


# -------------------------------------------------------------- assertions

def assert_close(actual, expected64, atol=ATOL, rtol=RTOL, check_dtype=True, err_msg=""):
    """``actual`` (float32 from attnx) matches ``expected64`` (float64 oracle).

    Shapes must be equal; NaN must appear exactly where the reference has NaN;
    infinities must be equal (same place, same sign); every other element must
    satisfy |actual - expected| <= atol + rtol * |expected|.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected64)
    prefix = (err_msg + ": ") if err_msg else ""
    if check_dtype:
        assert actual.dtype == np.float32, f"{prefix}expected float32 result, got {actual.dtype}"
    assert actual.shape == expected.shape, (
        f"{prefix}shape {actual.shape} != expected {expected.shape}")
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)

    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        bad = np.argwhere(nan_a != nan_e)
        idx = tuple(bad[0])
        raise AssertionError(
            f"{prefix}NaN positions differ at {len(bad)} element(s); first at {idx}: "
            f"actual {a[idx]!r}, expected {e[idx]!r}")
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    if not np.array_equal(inf_a, inf_e) or not np.array_equal(a[inf_e], e[inf_e]):
        bad = np.argwhere((inf_a != inf_e) | (inf_e & (a != e)))
        idx = tuple(bad[0])
        raise AssertionError(
            f"{prefix}infinities differ at {len(bad)} element(s); first at {idx}: "
            f"actual {a[idx]!r}, expected {e[idx]!r}")

    fin = np.isfinite(e)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - e)
    tol = atol + rtol * np.abs(e)
    bad = fin & ~(err <= tol)
    if bad.any():
        where = np.argwhere(bad)
        idx = tuple(where[0])
        worst = tuple(np.unravel_index(np.argmax(np.where(fin, err - tol, -np.inf)), e.shape))
        raise AssertionError(
            f"{prefix}{len(where)} of {e.size} element(s) outside atol={atol}, rtol={rtol}; "
            f"first at {idx}: actual {a[idx]!r}, expected {e[idx]!r}; "
            f"worst at {worst}: actual {a[worst]!r}, expected {e[worst]!r}, "
            f"|diff| {err[worst]:.3g}")


def assert_grads(got, ref, float_mask=False):
    for name in ("query", "key", "value"):
        assert_close(getattr(got, name), getattr(ref, name), GATOL, GRTOL, err_msg=name)
    if float_mask:
        assert_close(got.attn_mask, ref.attn_mask, GATOL, GRTOL, err_msg="attn_mask")
    else:
        assert got.attn_mask is None


def check_vjp(rng, q, k, v, **kw):
    """vjp against the float64 oracle for a random upstream gradient; returns the grads."""
    out, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
    assert_close(out, attnx.reference(q, k, v, **kw), err_msg="output")
    dout = randn(rng, out.shape)
    got = vjp(dout)
    ref = attnx.reference_backward(dout, q, k, v, **kw)
    m = kw.get("attn_mask")
    assert_grads(got, ref, float_mask=m is not None and np.asarray(m).dtype != np.bool_)
    return got


def check_against_reference(*args, need_weights=False, **kwargs):
    """Run attnx and the float64 reference on the same arguments and compare.

    Returns attnx's result (``out`` or ``(out, weights)``).
    """
    got = attnx.scaled_dot_product_attention(*args, need_weights=need_weights, **kwargs)
    ref = attnx.reference(*args, need_weights=need_weights, **kwargs)
    if need_weights:
        assert_close(got[0], ref[0], err_msg="output")
        assert_close(got[1], ref[1], err_msg="weights")
    else:
        assert_close(got, ref, err_msg="output")
    return got
