"""Fuzz harness for attnx's public Python API: the forward and its gradients.

Every argument of ``attnx.scaled_dot_product_attention`` is chosen from the
fuzzer's bytes: shapes (0 and 1 included, sizes around vector widths and
tiles), 2-D to 5-D inputs, both layouts, memory arrangements (negative
strides, steps, permuted axes, stride-0 broadcasts, misaligned data,
read-only, byte-swapped, nested lists), dtypes good and bad, masks of every
kind and broadcast shape, lengths (out of range and of bad dtypes too),
causal values, scales (0, huge, inf, NaN, non-numbers), GQA head counts,
need_weights, the instruction set and the thread count.

``run_one(data)`` is the whole check, used both by the fuzzer and by pytest's
replay of the corpus (tests/test_fuzz_corpus.py):

* an exception of a documented kind (TypeError, ValueError, MemoryError) is
  an answer, not a failure; any other exception propagates (a finding);
* a crash or a sanitizer report ends the process (a finding);
* a returned result must have the documented type, dtype and shape, the
  inputs must be unchanged, and, when the inputs are small and finite, it
  must match ``attnx.reference`` (float64) within the project's tolerance;
* then the same call's gradients (``scaled_dot_product_attention_vjp`` with an
  upstream gradient drawn from the output's size) are checked the same way
  against ``attnx.reference_backward``.

The bytes are decoded by a small decoder of our own (``Decoder``), not by
atheris' FuzzedDataProvider, so a corpus file replays identically without
atheris installed. The meaning of a corpus file is the order of reads in
``build()``: append new choices at the end of it (or re-seed the corpus with
fresh inputs) rather than reorder it.

Run the fuzzer (atheris needed; tools/fuzz.sh runs it under ASan+UBSan):

    python tests/fuzz/fuzz_sdpa.py CORPUS_DIR [libFuzzer flags, e.g. -max_total_time=60]

Replay files without atheris:

    python tests/fuzz/fuzz_sdpa.py --replay FILE...
"""

from __future__ import annotations

import collections
import math
import sys
import warnings

import numpy as np

ALLOWED = (TypeError, ValueError, MemoryError)

# Open bugs the fuzzer would otherwise report again and again, hiding others:
# (exception type, text in its message, description). The fuzzer tolerates
# them; tests/test_fuzz_corpus.py marks a corpus entry that hits one as an
# expected failure. Remove an entry when its bug is fixed.
KNOWN_BUGS = [
    # (exception type, text in its message, description); empty: no open bug
]


def known_bug(exc):
    """The description of the open bug ``exc`` is, or None."""
    for kind, text, what in KNOWN_BUGS:
        if isinstance(exc, kind) and text in str(exc):
            return what
    return None
ATOL, RTOL = 1e-5, 5e-6
STATS = collections.Counter()   # what the inputs led to: for tools/fuzz.sh's summary
MAX_WORK = 400_000          # B*H*Lq*Lk*max(E, Ev): keeps one input well under a second


# ----------------------------------------------------------------- decoding

class Decoder:
    """Reads choices from bytes, front to back; past the end every read is 0,
    so a short input means "the first, plainest choice" everywhere."""

    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.pos = 0

    def byte(self) -> int:
        if self.pos < len(self.data):
            b = self.data[self.pos]
            self.pos += 1
            return b
        return 0

    def int(self, lo: int, hi: int) -> int:
        """An int in [lo, hi] (inclusive)."""
        n = hi - lo + 1
        if n <= 1:
            return lo
        x = self.byte()
        if n > 256:
            x = x << 8 | self.byte()
        if n > 65536:
            x = x << 16 | self.byte() << 8 | self.byte()
        return lo + x % n

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def chance(self, k: int) -> bool:
        """True about once in k (and never on exhausted input)."""
        b = self.byte()
        return b != 0 and b % k == 0

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def seed(self) -> int:
        return self.int(0, 2**32 - 1)


# ---------------------------------------------------------- input building

SIZES = (1, 2, 3, 0, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 200)
GOOD_DTYPES = ("float32", "float64", "float16")
BAD_DTYPES = ("int32", "int64", "bool", "complex64", "object", "uint8", "U1", "datetime64[s]")
REGIMES = ("normal", "normal", "small", "tiny", "huge", "special", "zeros", "mixed")


def size(dec: Decoder, small: bool = False) -> int:
    return dec.pick(SIZES[:6] if small else SIZES)


def values(rng, shape, regime: str) -> np.ndarray:
    """float64 values of ``shape`` in one magnitude regime."""
    x = rng.standard_normal(shape)
    if regime == "small":
        x *= 0.25
    elif regime == "tiny":
        x *= 1e-30
    elif regime == "huge":
        x *= 1e4
    elif regime == "zeros":
        x[...] = 0.0
    elif regime == "mixed":
        x *= 10.0 ** rng.uniform(-30, 4, shape)
    elif regime == "special":
        r = rng.random(shape)
        x[r < 0.1] = np.nan
        x[(r >= 0.1) & (r < 0.2)] = np.inf
        x[(r >= 0.2) & (r < 0.3)] = -np.inf
    return x


def typed(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in GOOD_DTYPES:
        with np.errstate(all="ignore"):
            return x.astype(dtype)
    if dtype == "object":
        a = np.empty(x.shape, dtype=object)
        a[...] = 0.5
        return a
    if dtype == "U1":
        return np.full(x.shape, "a")
    with np.errstate(all="ignore"):
        return np.nan_to_num(x).astype(dtype)


def arrange(dec: Decoder, x: np.ndarray, rng):
    """``x`` (or values broadcast from part of it) in some memory arrangement.

    Returns an array (or nested list) whose logical shape is ``x.shape``."""
    x = np.asarray(x)
    for _ in range(dec.int(0, 2)):
        kind = dec.pick(("none", "neg", "step", "perm", "broadcast", "misalign",
                         "readonly", "byteswap", "fortran", "list"))
        nd = x.ndim
        if kind == "neg" and nd:
            ax = dec.int(0, nd - 1)
            x = np.flip(np.flip(x, ax).copy(), ax)
        elif kind == "step" and nd:
            ax, k, off = dec.int(0, nd - 1), dec.int(2, 3), dec.int(0, 1)
            shape = list(x.shape)
            shape[ax] = shape[ax] * k + off
            big = np.zeros(shape, dtype=x.dtype)
            sl = [slice(None)] * nd
            sl[ax] = slice(off, off + x.shape[ax] * k, k)
            big[tuple(sl)] = x
            x = big[tuple(sl)]
        elif kind == "perm" and nd > 1:
            perm = rng.permutation(nd)
            x = np.ascontiguousarray(x.transpose(perm)).transpose(np.argsort(perm))
        elif kind == "fortran":
            x = np.asfortranarray(x)
        elif kind == "broadcast" and nd:
            ax = dec.int(0, nd - 1)
            sl = [slice(None)] * nd
            sl[ax] = slice(0, 1)
            part = x[tuple(sl)]
            if part.size or x.size == 0:
                x = np.broadcast_to(part, x.shape)
        elif kind == "misalign" and x.dtype.itemsize > 1 and x.dtype != object and x.size:
            buf = np.zeros(x.nbytes + 1, dtype=np.uint8)
            y = buf[1:].view(x.dtype).reshape(x.shape)
            y[...] = x
            x = y
        elif kind == "readonly":
            x = x.copy() if not x.flags.writeable else x
            x.flags.writeable = False
        elif kind == "byteswap" and x.dtype.kind in "fiuc":
            x = x.astype(x.dtype.newbyteorder())
        elif kind == "list" and x.size <= 64 and x.dtype != object:
            return x.tolist()
    return x


def operand(dec: Decoder, rng, shape, regime: str, bad_dtype_chance: int = 24):
    dtype = dec.pick(BAD_DTYPES) if dec.chance(bad_dtype_chance) else dec.pick(GOOD_DTYPES)
    return arrange(dec, typed(values(rng, shape, regime), dtype), rng)


def mask_shape(dec: Decoder, full):
    """A shape that broadcasts to ``full`` (or, rarely, one that does not)."""
    shape = [n if dec.bool() else 1 for n in full]
    drop = dec.int(0, len(full))
    shape = shape[drop:]
    if dec.chance(16) and shape:
        ax = dec.int(0, len(shape) - 1)
        shape[ax] += dec.int(1, 2)                  # does not broadcast
    if dec.chance(32):
        shape = [1] + [2] + shape                   # more dims than the scores
    return tuple(shape)


def make_mask(dec: Decoder, rng, full):
    kind = dec.pick((None, "bool", "float", "bool", "float", "float16", "float64", "int",
                     "allfalse", "neginf_rows", "object"))
    if kind is None:
        return None
    shape = mask_shape(dec, full)
    if kind == "bool":
        m = rng.random(shape) < dec.pick((0.7, 0.3, 0.0, 1.0, 0.95))
    elif kind == "allfalse":
        m = np.zeros(shape, dtype=bool)
    elif kind in ("float", "float16", "float64"):
        m = rng.standard_normal(shape)
        m[rng.random(shape) < dec.pick((0.2, 0.0, 0.9, 1.0))] = -np.inf
        if dec.chance(8):
            m[rng.random(shape) < 0.1] = dec.pick((np.nan, np.inf, 1e30, -1e30))
        with np.errstate(all="ignore"):
            m = m.astype({"float": np.float32, "float16": np.float16, "float64": np.float64}[kind])
    elif kind == "neginf_rows":
        m = np.zeros(shape, dtype=np.float32)
        if m.ndim >= 2 and m.shape[-2]:
            m[..., 0, :] = -np.inf
    elif kind == "int":
        m = (rng.random(shape) < 0.5).astype(np.int64)
    else:
        m = np.empty(shape, dtype=object)
        m[...] = True
    return arrange(dec, m, rng)


def make_lengths(dec: Decoder, rng, lead, limit):
    kind = dec.pick((None, "good", "good", "edge", "out", "float", "bool", "scalar", "shape",
                     "list", "int32"))
    if kind is None:
        return None
    if kind == "scalar":
        return dec.int(-1, limit + 1)
    lead = tuple(lead)
    if kind == "shape":
        lead = lead + (2,)
    hi = limit + 1
    a = rng.integers(0, hi, size=lead) if hi > 0 else np.zeros(lead, dtype=np.int64)
    if kind == "edge" and a.size:
        a.flat[0] = dec.pick((0, limit))
    elif kind == "out" and a.size:
        a.flat[dec.int(0, a.size - 1)] = dec.pick((-1, limit + 1, 2**62, -(2**62)))
    elif kind == "float":
        return a.astype(np.float64)
    elif kind == "bool":
        return a > 0
    elif kind == "list":
        return a.tolist()
    elif kind == "int32":
        a = a.astype(np.int32)
    if a.ndim and dec.chance(4):
        a = arrange(dec, a, rng)
    return a


CAUSAL = (False, True, "lower_right", "upper_left", False, "top_left", 1, 0, None, "bogus",
          np.bool_(True), "lower_Right")
SCALES = (None, None, 1.0, 0.5, 0.0, -1.0, 1e-30, 1e30, 3, np.float32(0.125), math.inf,
          -math.inf, math.nan, "1.0", True, 10**400, np.float64(2.0), 1e300, 3.4e38, [1.0])
DROPOUT = (0.0, 0.0, 0, 0.5, -0.0, np.float32(0.0), "0", None, math.nan)
LAYOUTS = ("bhld", "blhd", "bhld", "BHLD", None, "bl")


def build(data: bytes):
    """Decode one input into (args, kwargs, meta) for scaled_dot_product_attention."""
    dec = Decoder(data)
    rng = np.random.default_rng(dec.seed())
    meta = {"isa": dec.byte(), "threads": dec.int(1, 3)}

    layout = dec.pick(LAYOUTS)
    nd = dec.pick((4, 3, 2, 4, 5))
    small = dec.int(0, 3) != 0                    # most inputs stay tiny
    nbatch = max(nd - 3, 0)
    batch = tuple(size(dec, True) for _ in range(nbatch))
    Hk = size(dec, True)
    gqa = dec.chance(3)
    Hq = Hk * dec.int(1, 3) if gqa else Hk
    if dec.chance(16):
        Hq = size(dec, True)                      # maybe not a multiple
    Lq, Lk = size(dec, small), size(dec, small)
    E, Ev = size(dec, small), size(dec, small) if dec.bool() else None
    Ev = E if Ev is None else Ev
    if nd == 3:                                   # (N, L, E): no head axis
        batch, Hq, Hk = (), Hk, Hk
    if nd == 2:
        batch, Hq, Hk = (), 1, 1
    work = max(math.prod(batch), 1) * max(Hq, 1) * max(Lq, 1) * max(Lk, 1) * max(E, Ev, 1)
    if work > MAX_WORK:                           # too slow for one input: shrink
        Lq, Lk = min(Lq, 17), min(Lk, 33)

    def shaped(H, L, D):
        if nd == 2:
            return (L, D)
        if nd == 3:
            return (H, L, D) if layout != "blhd" else (L, H, D)   # blhd 3-D: (L, H, D)
        return batch + ((H, L, D) if layout != "blhd" else (L, H, D))

    qshape, kshape, vshape = shaped(Hq, Lq, E), shaped(Hk, Lk, E), shaped(Hk, Lk, Ev)
    if dec.chance(16):                            # a mismatched dimension
        which = dec.int(0, 2)
        shp = list((qshape, kshape, vshape)[which])
        shp[dec.int(0, len(shp) - 1)] += 1
        qshape, kshape, vshape = [tuple(shp) if i == which else s
                                  for i, s in enumerate((qshape, kshape, vshape))]
    regime = dec.pick(REGIMES)
    q = operand(dec, rng, qshape, regime)
    k = operand(dec, rng, kshape, regime if dec.bool() else dec.pick(REGIMES))
    v = operand(dec, rng, vshape, regime if dec.bool() else dec.pick(REGIMES))

    # scores' shape (B..., Hq, Lq, Lk) as the public API states it
    if nd == 2:
        full = (Lq, Lk)
    elif nd == 3 and layout != "blhd":
        full = (Hq, Lq, Lk)
    elif nd == 3:
        full = (Hq, Lq, Lk)
    else:
        full = batch + (Hq, Lq, Lk)
    mask = make_mask(dec, rng, full)
    lead = (Hq,) if (nd == 3 and layout != "blhd") else batch
    kwargs = {}
    if dec.bool():
        kwargs["layout"] = layout
    elif layout != "bhld":
        kwargs["layout"] = layout
    kl = make_lengths(dec, rng, lead, Lk)
    ql = make_lengths(dec, rng, lead, Lq)
    if kl is not None:
        kwargs["key_lengths"] = kl
    if ql is not None:
        kwargs["query_lengths"] = ql
    causal = dec.pick(CAUSAL)
    scale = dec.pick(SCALES)
    dropout = dec.pick(DROPOUT)
    enable_gqa = gqa or dec.chance(8)
    kwargs["need_weights"] = dec.bool()
    args = (q, k, v, mask, dropout, causal, scale, enable_gqa)
    meta.update(regime=regime, small=small)
    meta["helpers"] = (dec.int(-2, 9), dec.int(-2, 9), dec.bool(), dec.byte())
    add_variants(dec, rng, kwargs, Hq)
    return args, kwargs, meta


WINDOW_SIDES = (None, -1, 0, 1, 2, 5, 40, -2, 1.5, 2**62)
SOFTCAPS = (30.0, 1.0, 0.25, 0.0, -1.0, float("nan"), float("inf"), "1", 1e39)
TINY_SOFTCAPS = (1e-40, 2.9e-39, 2.94e-39, 3e-39, 1e-38)
ALIGNMENTS = ("upper_left", "lower_right", None, "middle")


def per_head_values(dec: Decoder, rng, Hq: int, kind: str):
    """(Hq,) values for sinks or ALiBi slopes, sometimes of a wrong shape or kind."""
    n = Hq + (1 if dec.chance(12) else 0)
    if kind == "slopes":
        x = np.ldexp(1.0, -rng.integers(1, 9, size=n)).astype(np.float32)
    else:
        x = (rng.standard_normal(n) * 2).astype(np.float32)
    if dec.chance(16):
        x[...] = np.nan
    if dec.chance(16):
        return np.rint(np.nan_to_num(x)).astype(np.int64)     # integers are taken too
    if dec.chance(16):
        x *= np.float32(2.0 ** dec.int(10, 120))               # far outside any model's range
    return x


def add_variants(dec: Decoder, rng, kwargs, Hq: int) -> None:
    """The attention variants, each now and then (read last: an older corpus
    file, which ends before these reads, decodes to none of them)."""
    if dec.chance(3):
        kwargs["window"] = (dec.pick(WINDOW_SIDES), dec.pick(WINDOW_SIDES))
    if dec.chance(3):
        kwargs["softcap"] = dec.pick(SOFTCAPS)
    if dec.chance(3):
        kwargs["alibi_slopes"] = per_head_values(dec, rng, Hq, "slopes")
    if dec.chance(3):
        kwargs["sinks"] = per_head_values(dec, rng, Hq, "sinks")
    if dec.chance(4):
        kwargs["alignment"] = dec.pick(ALIGNMENTS)
    if dec.chance(8):        # around the smallest softcap with a finite float32 reciprocal
        kwargs["softcap"] = dec.pick(TINY_SOFTCAPS)


# --------------------------------------------------------------- checking

def _snapshot(x):
    if isinstance(x, np.ndarray) and x.dtype != object:
        return (x.shape, x.dtype, x.tobytes())
    return None


def _finite_small(*arrays, neginf_ok=False) -> bool:
    """Every float array finite (or -inf, for masks) and of moderate magnitude."""
    for a in arrays:
        if a is None:
            continue
        a = np.asarray(a)
        if a.dtype.kind != "f":
            continue
        ok = np.isfinite(a) | (np.isneginf(a) if neginf_ok else False)
        if not np.all(ok):
            return False
        fin = np.abs(a[np.isfinite(a)].astype(np.float64))
        if fin.size and (fin.max() > 8.0 or fin[fin != 0].min(initial=1.0) < 1e-20):
            return False
    return True


def _close(actual, expected, what, atol=None, rtol=None):
    ATOL_, RTOL_ = (atol or ATOL), (rtol or RTOL)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != reference {e.shape}"
    assert np.array_equal(np.isnan(a), np.isnan(e)), f"{what}: NaN positions differ from the reference"
    fin = np.isfinite(e)
    assert np.array_equal(np.isinf(a), np.isinf(e)) and np.array_equal(a[~fin & ~np.isnan(e)],
                                                                       e[~fin & ~np.isnan(e)]), \
        f"{what}: infinities differ from the reference"
    err = np.abs(a[fin] - e[fin])
    tol = ATOL_ + RTOL_ * np.abs(e[fin])
    if err.size and not np.all(err <= tol):
        i = int(np.argmax(err - tol))
        raise AssertionError(f"{what}: {int(np.sum(err > tol))} element(s) outside atol={ATOL_}, "
                             f"rtol={RTOL_}; worst |diff| {err[i]:.3g} (reference {e[fin][i]!r})")


def _must_refuse(args, kwargs):
    """Issue 18's rules, None or what the call must refuse: a softcap whose float32
    reciprocal is infinite (0 * inf is NaN), ALiBi slopes whose bias |slope| *
    max |d(i) - j| passes half of float32's range for these lengths."""
    c = kwargs.get("softcap")
    if isinstance(c, float) and 0 < c and np.isfinite(np.float32(c)) and np.float32(c) > 0:
        with np.errstate(over="ignore", divide="ignore"):
            if not np.isfinite(np.float32(1) / np.float32(c)):
                return f"softcap={c!r}: its float32 reciprocal is infinite"
    s = kwargs.get("alibi_slopes")
    try:
        q, k = np.asarray(args[0]), np.asarray(args[1])
        slopes = np.asarray(s, dtype=np.float64)
    except Exception:
        return None
    if s is None or q.ndim < 2 or k.ndim < 2 or not np.isfinite(slopes).all() or not slopes.size:
        return None
    blhd = kwargs.get("layout") == "blhd" and q.ndim >= 3
    Lq, Lk = (q.shape[-3], k.shape[-3]) if blhd else (q.shape[-2], k.shape[-2])
    lower = kwargs.get("alignment") == "lower_right" or args[5] == "lower_right"
    off = Lk - Lq if lower else 0
    dist = max(Lq - 1 + off, Lk - 1 - off, 0) if Lq and Lk else 0
    if np.abs(slopes).max() * dist > float(np.finfo(np.float32).max) / 2:
        return f"alibi_slopes up to {np.abs(slopes).max():g} over distances up to {dist}"
    return None


def _modest_variants(kwargs) -> bool:
    """Sinks and ALiBi slopes of the sizes models use (|x| <= 64): with slopes of
    1e18 the float32 scores keep nothing of q.k, while float64 keeps some, so the
    two answers differ by design, not by a defect."""
    for name in ("sinks", "alibi_slopes"):
        x = kwargs.get(name)
        if x is not None and not (np.abs(np.asarray(x, dtype=np.float64)) <= 64).all():
            return False
    return True


def _expected_shapes(q, k, v, layout, need_weights):
    q, k, v = (np.asarray(x) for x in (q, k, v))
    out_shape = q.shape[:-1] + (v.shape[-1],)
    if q.ndim == 2:
        w_shape = (q.shape[0], k.shape[0])
    elif layout == "blhd":
        w_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3], k.shape[-3])
    else:
        w_shape = q.shape[:-1] + (k.shape[-2],)
    return out_shape, w_shape


def _helpers(meta):
    """The mask helpers with fuzzed sizes: answers or documented exceptions."""
    import attnx
    a, b, lower, n = meta["helpers"]
    try:
        m = attnx.causal_mask(a, b, lower_right=lower)
        assert m.dtype == np.bool_ and m.shape == (a, b), (m.dtype, m.shape)
    except ALLOWED:
        pass
    try:
        lengths = np.array([n % 7 - 1, a, b])
        m = attnx.padding_mask(lengths, b)
        assert m.dtype == np.bool_, m.dtype
    except ALLOWED:
        pass


def run_one(data: bytes, tolerate_known: bool = False) -> None:
    """Decode ``data``, call attnx, check the answer (see the module docstring).

    With ``tolerate_known``, an exception listed in KNOWN_BUGS passes."""
    import attnx
    from attnx import _attnx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, kwargs, meta = build(data)
        isas = _attnx.available_isas()
        previous_isa, previous_threads = _attnx.isa(), attnx.get_num_threads()
        _attnx.set_isa(isas[meta["isa"] % len(isas)])
        attnx.set_num_threads(meta["threads"])
        snaps = [_snapshot(x) for x in list(args[:4]) + [kwargs.get("key_lengths"),
                                                         kwargs.get("query_lengths")]]
        try:
            try:
                result = attnx.scaled_dot_product_attention(*args, **kwargs)
            except ALLOWED as exc:
                STATS[type(exc).__name__] += 1
                _helpers(meta)
                return
            except Exception as exc:
                if tolerate_known and known_bug(exc):
                    STATS["known bug"] += 1
                    return
                raise
            STATS["returned"] += 1
            refuse = _must_refuse(args, kwargs)
            assert refuse is None, f"accepted {refuse}"
            q, k, v, mask = args[:4]
            need_weights = kwargs["need_weights"]
            layout = kwargs.get("layout", "bhld")
            # the inputs are never modified
            for x, s in zip(list(args[:4]) + [kwargs.get("key_lengths"), kwargs.get("query_lengths")],
                            snaps):
                if s is not None:
                    assert (x.shape, x.dtype, x.tobytes()) == s, "an input was modified"
            out_shape, w_shape = _expected_shapes(q, k, v, layout, need_weights)
            if need_weights:
                assert isinstance(result, tuple) and len(result) == 2, type(result)
                out, w = result
                assert isinstance(w, np.ndarray) and w.dtype == np.float32, "weights: not float32"
                assert w.shape == w_shape, f"weights shape {w.shape}, expected {w_shape}"
            else:
                out, w = result, None
            assert isinstance(out, np.ndarray) and out.dtype == np.float32, "out: not float32"
            assert out.shape == out_shape, f"out shape {out.shape}, expected {out_shape}"

            scale = args[6]
            small_scale = scale is None or (isinstance(scale, (int, float, np.floating))
                                            and not isinstance(scale, bool) and abs(scale) <= 2)
            size = np.asarray(q).size + np.asarray(k).size + np.asarray(v).size
            if small_scale and _finite_small(q, k, v) and _finite_small(mask, neginf_ok=True):
                # finite inputs never give NaN (any sinks, slopes and softcap accepted)
                assert not np.isnan(out).any(), "out: NaN from finite inputs"
                assert w is None or not np.isnan(w).any(), "weights: NaN from finite inputs"
            if small_scale and size <= 20_000 and _finite_small(q, k, v) and \
                    _finite_small(mask, neginf_ok=True) and _modest_variants(kwargs):
                STATS["compared with reference"] += 1
                ref = attnx.reference(*args, **kwargs)
                if need_weights:
                    _close(out, ref[0], "out")
                    _close(w, ref[1], "weights")
                else:
                    _close(out, ref, "out")
            # gradients are compared on well-scaled problems only: a scale up to
            # the default 1/sqrt(E) (a larger one sharpens the softmax) and head
            # dimensions up to 64 (longer float32 dot products drift past
            # PyTorch's absolute tolerance where the exact gradient cancels to 0,
            # e.g. dQ with a single key): float32 rounding, not defects
            E = np.shape(np.asarray(q))[-1] if np.ndim(np.asarray(q)) else 0
            Ev = np.shape(np.asarray(v))[-1] if np.ndim(np.asarray(v)) else 0
            well_scaled = max(E, Ev) <= 64 and (
                scale is None or (small_scale and abs(scale) <= 1 / math.sqrt(max(E, 1))))
            compare = well_scaled and size <= 20_000 and _finite_small(q, k, v) and \
                _finite_small(mask, neginf_ok=True) and _modest_variants(kwargs)
            _check_backward(args, kwargs, out, compare)
            _helpers(meta)
        finally:
            _attnx.set_isa(previous_isa)
            attnx.set_num_threads(previous_threads)


def _check_backward(args, kwargs, out, compare):
    """The gradients of the same call, for an upstream gradient drawn from the
    output's size: documented exceptions are answers; shapes and dtypes as
    documented; equal to attnx.reference_backward when the inputs are small
    and finite (at PyTorch's float32 gradient tolerances)."""
    import attnx

    kw = {k: v for k, v in kwargs.items() if k != "need_weights"}
    dout = np.random.default_rng(out.size).standard_normal(out.shape).astype(np.float32)
    snaps = [_snapshot(x) for x in args[:4]]
    try:
        _, vjp = attnx.scaled_dot_product_attention_vjp(*args, **kw)
        grads = vjp(dout)
    except ALLOWED as exc:
        STATS["backward: " + type(exc).__name__] += 1
        return
    STATS["backward returned"] += 1
    for x, s in zip(args[:4], snaps):
        if s is not None:
            assert (x.shape, x.dtype, x.tobytes()) == s, "an input was modified by the backward"
    for name, x in zip(("query", "key", "value"), args[:3]):
        g = getattr(grads, name)
        assert g.dtype == np.float32 and g.shape == np.shape(np.asarray(x)), \
            f"grads.{name}: {g.dtype} {g.shape}, input {np.shape(np.asarray(x))}"
    mask = args[3]
    if mask is not None and np.asarray(mask).dtype.kind == "f":
        assert grads.attn_mask is not None and grads.attn_mask.shape == np.shape(mask)
    else:
        assert grads.attn_mask is None
    if compare:
        STATS["backward compared with reference"] += 1
        ref = attnx.reference_backward(dout, *args, **kw)
        # an element of dQ sums Lk terms, one of dK or dV the Lq rows of each query
        # head of its group, each with its own float32 rounding, and the sums cancel
        # where the exact gradient is 0 (dS = P (dP - D), with dP = D exactly for a
        # single key): PyTorch's tolerance for one term, grown as a random walk,
        # plus float32's rounding of the terms themselves (_rounding_bounds)
        qshape, kshape = np.shape(np.asarray(args[0])), np.shape(np.asarray(args[1]))
        lq_axis = -3 if kwargs.get("layout") == "blhd" else -2
        Lq = qshape[lq_axis] if len(qshape) >= 2 else 1
        Lk = kshape[lq_axis] if len(kshape) >= 2 else 1
        # query heads per key/value head: q.size / k.size = (Hq Lq) / (Hk Lk), E shared
        group = max(1, round(ref.query.size * Lk / max(1, ref.key.size * Lq)))
        terms = {"query": max(1, Lk), "key": max(1, Lq * group), "value": max(1, Lq * group)}
        bound = _rounding_bounds(args, kwargs, dout, Lq, Lk)
        for name in ("query", "key", "value"):
            extra = bound[name] * (1 if name == "query" else terms[name])
            _close(getattr(grads, name), getattr(ref, name), "grads." + name,
                   1.25e-5 * math.sqrt(terms[name]) + extra, 5.25e-6)
        if ref.sinks is not None:
            # a sink's gradient sums over every query row of its head
            rows = max(1, out.size // max(1, out.shape[-1]) // max(1, ref.sinks.size))
            _close(grads.sinks, ref.sinks, "grads.sinks",
                   (1.25e-5 + bound["scores"]) * rows, 5.25e-6)
        if ref.attn_mask is not None:
            # each element of a broadcast mask's gradient sums n scores' gradients,
            # each within the tolerance (and the sums cancel: a row's dS adds up to 0)
            n = max(1, out.size // max(1, out.shape[-1]) * Lk // max(1, ref.attn_mask.size))
            _close(grads.attn_mask, ref.attn_mask, "grads.attn_mask",
                   (1.25e-5 + bound["scores"]) * n, 5.25e-6)


def _rounding_bounds(args, kwargs, dout, Lq, Lk):
    """How far float32 arithmetic may move one term of each gradient, from the
    sizes of the inputs (a first-order bound, times 2): a score s = scale q.k
    carries an error of u |s|max (u = 2^-24), so P = exp(s - lse) a relative
    error of u (1 + |s|max); dP and D sum Ev products dO.v, so
    dS = P (dP - D) is off by up to u (1 + |s|max) 2 Ev |dO| |v| even where it
    is exactly 0 (one key: dP = D, as computed they differ). dQ = scale dS K
    sums P-weighted terms (their weights add up to 1); dK and dV sum over
    query rows (the caller multiplies by their number)."""
    def mag(x):
        a = np.asarray(x, dtype=np.float64) if x is not None else np.zeros(1)
        a = a[np.isfinite(a)]
        return float(np.abs(a).max()) if a.size else 0.0
    q, k, v, mask = args[0], args[1], args[2], args[3]
    E = np.shape(np.asarray(q))[-1] if np.ndim(np.asarray(q)) else 1
    Ev = np.shape(np.asarray(v))[-1] if np.ndim(np.asarray(v)) else 1
    scale = kwargs.get("scale")
    scale = abs(float(scale)) if scale is not None else 1.0 / math.sqrt(max(E, 1))
    mq, mk, mv, mdo = mag(q), mag(k), mag(v), mag(dout)
    smax = scale * E * mq * mk + (mag(mask) if mask is not None and
                                  np.asarray(mask).dtype.kind == "f" else 0.0)
    if kwargs.get("alibi_slopes") is not None:
        smax += mag(kwargs["alibi_slopes"]) * max(Lq, Lk)
    u = 2.0 ** -24
    rel_p = 2 * u * (1 + smax)
    ds = rel_p * 2 * max(Ev, 1) * mdo * mv
    return {"query": scale * mk * ds, "key": scale * mq * ds, "value": rel_p * mdo, "scores": ds}


# ----------------------------------------------------------------- drivers

def describe(data: bytes) -> str:
    """A readable account of what an input decodes to (for bug reports)."""
    args, kwargs, meta = build(data)

    def d(x):
        if isinstance(x, np.ndarray):
            return (f"ndarray(shape={x.shape}, dtype={x.dtype}, strides={x.strides}, "
                    f"aligned={x.flags.aligned}, writeable={x.flags.writeable})")
        if isinstance(x, list):
            return f"list(len={len(x)})"
        return repr(x)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    lines = [f"{n} = {d(a)}" for n, a in zip(names, args)]
    lines += [f"{n} = {d(a)}" for n, a in kwargs.items()]
    lines.append(f"meta = {meta}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1 and argv[1] in ("--replay", "--describe"):
        for path in argv[2:]:
            with open(path, "rb") as f:
                data = f.read()
            print(f"== {path}")
            print(describe(data))
            if argv[1] == "--replay":
                run_one(data)
                print("ok")
        return
    import atheris
    with atheris.instrument_imports(include=["attnx"]):
        import attnx  # noqa: F401  (instrumented for coverage of the Python side)
    atheris.instrument_func(build)
    atheris.Setup(argv, lambda data: run_one(data, tolerate_known=True))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
