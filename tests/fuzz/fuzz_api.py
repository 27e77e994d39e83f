"""Fuzz harness for the attnx entry points around the forward: the backward
from saved tensors, merge_attention, packed variable-length batches and the
KV cache.

``fuzz_sdpa.py`` fuzzes every argument of ``scaled_dot_product_attention`` and
checks the gradients of each fuzzed call, but always hands the backward the
forward's own ``out``/``lse`` and a well-formed ``dout``. This harness fuzzes
what it does not reach. The first byte picks one of four paths:

* ``backward``: ``scaled_dot_product_attention_backward`` on a valid problem
  (2-D to 5-D, both layouts, GQA, masks, causal, lengths, the variants) whose
  ``dout``, ``out`` and ``lse`` are each kept, re-laid out (negative strides,
  steps, permuted axes, stride-0 broadcasts, misaligned, read-only,
  byte-swapped, lists), converted (float64, float16), spoiled (NaN, inf,
  -inf rows, shifted lse, values beyond float32), reshaped, given a bad dtype
  or replaced by a non-array; now and then query/key/value no longer match
  the saved tensors, or the keywords differ from the forward's;
* ``merge``: ``merge_attention`` on the outputs of attention over chunks of
  the keys (empty chunks too) or on arbitrary ``outs``/``lses`` (any number,
  shape, dtype, layout, container, NaN and infinities);
* ``varlen``: ``varlen_attention`` (with and without ``return_lse``) and
  ``varlen_attention_vjp`` with arbitrary ``cu_seqlens_q``/``cu_seqlens_k``:
  every integer dtype and some others, lists, wrapped values, not starting at
  0, decreasing, not ending at the packed length, of different lengths, 0-d
  and 2-D; and the variants per head or per sequence; then, now and then,
  ``varlen_attention`` over int8 page pools with a ``block_table`` (pages in
  a random order, unused table entries arbitrary): ``(pages, scales)``,
  ``(pages, scales, rotation)`` (``attnx.int8_rotation(E)``, None, the
  identity, a random or an integer matrix) and, for keys, ``(pages, scales,
  rotation, centers)``; scales zero, subnormal, huge; pools re-laid out, or
  malformed (pages not int8, scales of another shape or kind, rotations of
  another shape or NaN, too many items, centers of another shape or NaN, a
  value array beside key tuples), softcap with centres;
* ``kvcache``: a ``KVCache`` built from fuzzed arguments, then a sequence of
  ``append``, ``attend`` and assignments to its public ``lengths``, with
  arbitrary shapes, dtypes, token counts and options; then, now and then, a
  second session with an int8 cache (``center_keys`` True or False), whose
  rows are at the end handed to ``varlen_attention`` as pages (with its
  rotations and, mostly, its centres).

``run_one(data)`` is the whole check (as in fuzz_sdpa.py, also used by pytest's
replay of tests/fuzz/corpus_api/ in tests/test_fuzz_corpus.py):

* a crash or a sanitizer report ends the process (a finding);
* an exception must be TypeError, ValueError or MemoryError, and (but for
  MemoryError) its message must name one of the arguments the input spoiled
  (a call whose arguments are all valid must not raise at all); anything
  else is a finding;
* a call given arguments the API documents as wrong (a shape, a dtype, a
  malformed ``cu_seqlens``) must raise;
* a returned result must have the documented types, dtypes and shapes, the
  inputs must be unchanged, and:
  - backward: the gradients equal, bit for bit, those of the same call on
    C-contiguous float32 copies of its arguments (the layout of an argument
    does not change its value), and those of
    ``scaled_dot_product_attention_vjp`` when the saved tensors are the
    forward's own;
  - merge: within float32 rounding of the float64 formula on the same inputs,
    and, for chunks of the keys, of attention over all of them;
  - varlen: each sequence equal, bit for bit, to one ``blhd`` call over its
    slices as the ``cu_seqlens`` values say (their gradients likewise), and
    within the tolerance of ``attnx.reference`` on small finite inputs;
  - kvcache: ``append`` writes in place exactly what the harness's own
    record expects, and nothing at all when it raises; ``attend`` equals
    ``attnx.reference`` per sequence over that record (lower-right causal).
    An int8 cache's record is what it stored: each appended row, rotated
    (``y = R (x - centre)``), within the documented ``max|y| / 254`` of
    ``scale * q``, no value -128, each sequence's centre the mean of its
    first keys; NaN, inf and rows too long for float32 once rotated refused;
    ``attend`` against ``attnx.reference`` over the rows the record stands
    for, ``(scale * q) @ R`` plus the centre (softcap refused with centres);
  - int8 pages: each sequence against ``attnx.reference`` over its pages'
    rows as they stand, ``(scale * q) @ R`` plus its centre, gathered
    through the block table.

The bytes are read with fuzz_sdpa.py's decoder and array builders (imported,
not copied: a change there changes this corpus's meaning too). Reads never
depend on what attnx returned, so a file decodes to the same calls whatever
attnx does; unlike fuzz_sdpa.py the reads are interleaved with the calls
(the backward's ``out`` and ``lse`` exist only after the forward), so
``--describe`` runs the input and prints each call as it is made (it needs
an importable attnx; under the sanitizers, the same environment as the
fuzzer). Append new choices at the end of a path's reads, never reorder
them.

    python tests/fuzz/fuzz_api.py CORPUS_DIR [libFuzzer flags]   # fuzz (atheris)
    python tests/fuzz/fuzz_api.py --replay FILE...               # without atheris
    python tests/fuzz/fuzz_api.py --describe FILE...
"""

from __future__ import annotations

import collections
import importlib.util
import math
import operator
import os
import re
import sys
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_base():
    """fuzz_sdpa.py (the decoder, the array builders, the tolerances), by path."""
    mod = sys.modules.get("fuzz_sdpa")
    if mod is None:
        spec = importlib.util.spec_from_file_location("fuzz_sdpa", os.path.join(HERE, "fuzz_sdpa.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fuzz_sdpa"] = mod
        spec.loader.exec_module(mod)
    return mod


base = _load_base()
Decoder, values, typed, arrange = base.Decoder, base.values, base.typed, base.arrange
ALLOWED = base.ALLOWED
GOOD_DTYPES, BAD_DTYPES, REGIMES = base.GOOD_DTYPES, base.BAD_DTYPES, base.REGIMES
STATS = collections.Counter()
F32_MAX = float(np.finfo(np.float32).max)

# Open bugs the fuzzer would otherwise report again and again, hiding others:
# (exception type, text in its message, a function its traceback (or its
# cause's) passes through or None, description). The fuzzer tolerates them;
# tests/test_fuzz_corpus.py marks a corpus entry that hits one as an expected
# failure. Remove an entry when its bug is fixed.
KNOWN_BUGS: list = [
    # (exception type, text in its message, a function its traceback passes through,
    #  what the bug is); the eight findings of the first runs are fixed, and the
    #  ninth (int8 pools with misaligned float32 scales refused, issue 56)
]


def _functions(exc):
    """The functions the traceback of ``exc`` and of its causes pass through."""
    names, seen = set(), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            names.add(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return names


def known_bug(exc):
    """The description of the open bug ``exc`` is, or None."""
    for kind, text, where, what in KNOWN_BUGS:
        if isinstance(exc, kind) and text in str(exc) and (where is None or where in _functions(exc)):
            return what
    return None


# ------------------------------------------------------------------ tracing

class Trace:
    """What an input did, call by call: kept for --describe and failure messages."""

    def __init__(self, echo=False):
        self.echo = echo
        self.lines = []

    def __call__(self, line):
        self.lines.append(line)
        if self.echo:
            print(line, flush=True)


def show(x):
    """A short account of an argument."""
    if isinstance(x, np.ndarray):
        extra = "" if x.dtype == object or x.size > 6 or x.dtype.kind not in "iub" else f", {x.tolist()}"
        return (f"ndarray(shape={x.shape}, dtype={x.dtype}, strides={x.strides}, "
                f"aligned={x.flags.aligned}, writeable={x.flags.writeable}{extra})")
    if isinstance(x, (list, tuple)):
        if len(x) <= 6 and all(isinstance(e, (int, float, np.integer, np.floating)) for e in x):
            return repr(x)
        return f"{type(x).__name__}(len={len(x)}: {', '.join(show(e) for e in x[:4])}{', ...' if len(x) > 4 else ''})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={show(v)}" for k, v in x.items()) + "}"
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


# ---------------------------------------------------------------- the oracle

def _named(msg, names):
    """The names among ``names`` that ``msg`` mentions as words."""
    return [n for n in names
            if re.search(r"(?<![A-Za-z0-9_])" + re.escape(n) + r"(?![A-Za-z0-9_])", msg)]


def attempt(T, what, fn, names):
    """``fn()``: (True, result), or (False, exc) for a documented exception that
    names one of ``names`` (the arguments the input spoiled). An empty ``names``
    means every argument is valid: any exception but MemoryError is a finding."""
    try:
        result = fn()
    except MemoryError as exc:
        STATS[what + ": MemoryError"] += 1
        T(f"  -> MemoryError: {exc}")
        return False, exc
    except ALLOWED as exc:
        T(f"  -> {type(exc).__name__}: {str(exc)[:400]}")
        if not names:
            raise AssertionError(f"{what}: a valid call raised {type(exc).__name__}: {exc}") from exc
        if not _named(str(exc), names):
            raise AssertionError(f"{what}: {type(exc).__name__} names none of the arguments at fault "
                                 f"{sorted(names)}: {exc}") from exc
        STATS[f"{what}: {type(exc).__name__}"] += 1
        return False, exc
    STATS[what + ": returned"] += 1
    T("  -> returned")
    return True, result


def snapshot(x):
    if isinstance(x, np.ndarray) and x.dtype != object:
        return (x.shape, x.dtype, x.tobytes())
    return None


def check_unchanged(pairs, what):
    for name, x, s in pairs:
        if s is not None:
            assert (x.shape, x.dtype, x.tobytes()) == s, f"{what}: {name} was modified"


def canonical(x):
    """``x`` as the C-contiguous native float32 array attnx computes with."""
    with np.errstate(all="ignore"):
        return np.ascontiguousarray(np.asarray(x), dtype=np.float32)


def is_canonical(x):
    return (type(x) is np.ndarray and x.dtype == np.dtype(np.float32) and x.flags.c_contiguous
            and x.flags.aligned)


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_same(actual, expected, what):
    """Bit for bit (NaN payloads aside: NaN where the other is NaN)."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape}, expected {e.shape}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype}, expected {e.dtype}"
    nan = np.isnan(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool)
    ok = (nan == (np.isnan(e) if e.dtype.kind == "f" else False))
    both = ~nan
    ok &= np.where(both, a.view(f"u{a.itemsize}") == e.view(f"u{e.itemsize}") if a.dtype.kind == "f"
                   else a == e, True)
    if not ok.all():
        i = np.flatnonzero(~ok.ravel())[0]
        raise AssertionError(f"{what}: {int((~ok).sum())} element(s) differ; first at flat index {i}: "
                             f"{a.ravel()[i]!r} != {e.ravel()[i]!r}")


def float_problem(x, want, half=False):
    """Why ``x`` is not an acceptable float array of shape ``want`` (None: it
    is); ``half``: stored in float16, where a finite value must stay finite."""
    if x is None:
        return "None"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = np.asarray(x)
    except Exception:
        return "not array-like"
    if a.dtype.type not in (np.float16, np.float32, np.float64):
        return f"dtype {a.dtype}"
    if a.shape != tuple(want):
        return f"shape {a.shape} instead of {tuple(want)}"
    if a.dtype == np.float64 and a.size:
        fin = a[np.isfinite(a)]
        if fin.size and np.abs(fin).max() > F32_MAX:
            return "float64 values beyond float32's range"
    if half and a.size:
        with np.errstate(all="ignore"):
            if (np.isinf(a.astype(np.float16)) & np.isfinite(a)).any():
                return "finite values beyond float16's range"
    return None


def float_shape(x):
    """The shape of ``x`` if it is an acceptable float array of some shape, else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shape = np.shape(np.asarray(x))
    except Exception:
        return None
    return shape if float_problem(x, shape) is None else None


def finite_small(*arrays):
    return base._finite_small(*arrays)


def modest(kw):
    return base._modest_variants(kw)


# ----------------------------------------------------------- shared builders

SMALL = (1, 2, 3, 0, 4, 5, 7, 8, 9, 16, 17)


def dim(dec, wide=False):
    return dec.pick(SMALL if wide else SMALL[:6])


def f32(x):
    with np.errstate(all="ignore"):
        return np.asarray(x, dtype=np.float32)


def problem(dec, rng, T, plain=False):
    """A valid attention problem of small sizes: q, k, v (float32) and keywords.

    ``plain``: no causal mode, lengths or variants (merge's chunks of keys)."""
    layout = dec.pick(("bhld", "blhd", "bhld"))
    nd = dec.pick((4, 3, 2, 4, 5))
    if nd == 2 and layout == "blhd":
        nd = 3
    heads_are_batch = nd == 3 and layout == "bhld"
    batch = tuple(dim(dec) for _ in range(max(nd - 3, 0)))
    Hk = dim(dec)
    g = dec.int(1, 3) if dec.chance(3) else 1
    if nd == 2 or heads_are_batch:
        g = 1
    if nd == 2:
        Hk = 1
    Hq = Hk * g
    Lq, Lk = dim(dec, True), dim(dec, True)
    E = dim(dec)
    Ev = dim(dec) if dec.bool() else E

    def shaped(H, L, D):
        if nd == 2:
            return (L, D)
        return batch + ((L, H, D) if layout == "blhd" else (H, L, D))

    regime = dec.pick(REGIMES)
    q = f32(values(rng, shaped(Hq, Lq, E), regime))
    k = f32(values(rng, shaped(Hk, Lk, E), regime if dec.bool() else dec.pick(REGIMES)))
    v = f32(values(rng, shaped(Hk, Lk, Ev), regime if dec.bool() else dec.pick(REGIMES)))
    kw = {}
    if layout != "bhld" or dec.bool():
        kw["layout"] = layout
    if g > 1 or dec.chance(6):
        kw["enable_gqa"] = True
    mask = dec.pick((None, None, "bool", "float"))
    if mask == "bool":
        kw["attn_mask"] = rng.random((Lq, Lk)) < 0.8
    elif mask == "float":
        m = rng.standard_normal((Lq, Lk)).astype(np.float32)
        m[rng.random((Lq, Lk)) < 0.2] = -np.inf
        kw["attn_mask"] = m
    scale = dec.pick((None, None, 0.5, 0.125, 1.0))
    if scale is not None:
        kw["scale"] = scale
    lead = (Hq,) if heads_are_batch else batch
    if not plain:
        causal = dec.pick((False, True, "lower_right", False))
        if causal is not False:
            kw["is_causal"] = causal
        if dec.chance(4):
            kw["key_lengths"] = rng.integers(0, Lk + 1, size=lead)
        if dec.chance(6):
            kw["query_lengths"] = rng.integers(0, Lq + 1, size=lead)
        if dec.chance(4):
            kw["window"] = (dec.pick((None, 0, 1, 3)), dec.pick((None, 0, 2)))
        if dec.chance(5):
            kw["softcap"] = dec.pick((1.0, 5.0, 30.0))
        if dec.chance(4):
            kw["sinks"] = rng.standard_normal(Hq).astype(np.float32)
        if dec.chance(5):
            kw["alibi_slopes"] = np.ldexp(1.0, -rng.integers(1, 9, size=Hq)).astype(np.float32)
        if causal is False and dec.chance(6):
            kw["alignment"] = dec.pick(("upper_left", "lower_right"))
    info = dict(layout=layout, nd=nd, batch=batch, Hq=Hq, Hk=Hk, Lq=Lq, Lk=Lk, E=E, Ev=Ev,
                regime=regime)
    T(f"problem: {info}")
    T(f"  query {show(q)}, key {show(k)}, value {show(v)}")
    T(f"  keywords {show(kw)}")
    return q, k, v, kw, info


def rows_shape(out_shape, layout):
    """lse's shape (B..., H, Lq) for an output of ``out_shape`` in ``layout``."""
    if layout == "blhd":
        return out_shape[:-3] + (out_shape[-2], out_shape[-3])
    return out_shape[:-1]


def spoil_values(dec, rng, x):
    """``x`` (float32) with NaN, infinities, huge values or values beyond float32
    in places (float64 then), or all shifted or set to one value (for lse: the
    log-sums of other rows, -inf as if no key were allowed, +inf, NaN)."""
    x = np.array(x, dtype=np.float64)
    kind = dec.pick(("nan", "inf", "-inf", "huge", "beyond", "zero", "shift", "all"))
    if not x.size:
        return x.astype(np.float32)
    where = rng.random(x.shape) < dec.pick((0.1, 0.5, 1.0))
    if kind == "shift":
        x = x + dec.pick((-100.0, -1.0, 0.5, 50.0, 1e4, -1e30))
    elif kind == "all":
        x[...] = dec.pick((-np.inf, np.inf, np.nan, 0.0))
    else:
        x[where] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38, "beyond": 1e300,
                    "zero": 0.0}[kind]
    if kind == "beyond":
        return x                       # float64 beyond float32's range: refused
    return f32(x)


def reshaped(dec, rng, x):
    """An array shaped differently from ``x`` (now and then, by chance, the same)."""
    x = np.asarray(x)
    kind = dec.pick(("lead", "trail", "drop", "grow", "swap", "scalar", "flat", "empty"))
    if kind == "lead":
        return x[None]
    if kind == "trail":
        return x[..., None]
    if kind == "drop" and x.ndim:
        ax = dec.int(0, x.ndim - 1)
        return np.take(x, 0, axis=ax) if x.shape[ax] else np.zeros(x.shape[:ax] + x.shape[ax + 1:],
                                                                     np.float32)
    if kind == "grow" and x.ndim:
        shape = list(x.shape)
        shape[dec.int(0, x.ndim - 1)] += dec.int(1, 2)
        return f32(rng.standard_normal(shape))
    if kind == "swap" and x.ndim >= 2:
        return np.swapaxes(x, -1, -2)
    if kind == "scalar":
        return np.float32(1.5)
    if kind == "flat":
        return x.ravel()
    return np.zeros((0,) + x.shape[1:], np.float32)


NON_ARRAYS = (None, "lse", 3.0, [[1.0, 2.0], [3.0]], {"a": 1}, object(), b"\x00\x01")


def spoil(dec, rng, name, x, T):
    """One saved tensor (or dout), maybe changed: (value, how)."""
    how = dec.pick(("keep", "keep", "keep", "keep", "keep", "arrange", "arrange", "float64",
                    "float16", "values", "shape", "dtype", "object", "list"))
    if how == "arrange":
        x = arrange(dec, x, rng)
    elif how == "float64":
        x = arrange(dec, x.astype(np.float64), rng)
    elif how == "float16":
        with np.errstate(all="ignore"):
            x = arrange(dec, x.astype(np.float16), rng)
    elif how == "values":
        x = spoil_values(dec, rng, x)
    elif how == "shape":
        x = reshaped(dec, rng, x)
    elif how == "dtype":
        x = typed(np.asarray(x, dtype=np.float64), dec.pick(BAD_DTYPES))
    elif how == "object":
        x = dec.pick(NON_ARRAYS)
    elif how == "list":
        x = np.asarray(x).tolist()
    if how != "keep":
        T(f"  {name}: {how} -> {show(x)}")
    return x, how


# ------------------------------------------------------------------- backward

def mode_backward(dec, rng, T):
    import attnx

    q, k, v, kw, info = problem(dec, rng, T)
    layout = info["layout"]
    out_shape = q.shape[:-1] + (v.shape[-1],)
    lse_shape = rows_shape(out_shape, layout) if info["nd"] >= 3 else out_shape[:-1]
    dout = f32(values(rng, out_shape, dec.pick(("normal", "normal", "small", "special", "huge",
                                                "zeros"))))
    T(f"forward: scaled_dot_product_attention(query, key, value, return_lse=True, **keywords)")
    ok, res = attempt(T, "forward", lambda: attnx.scaled_dot_product_attention(
        q, k, v, return_lse=True, **kw), ())
    out, lse = res
    assert out.shape == out_shape and lse.shape == lse_shape, \
        f"forward: out {out.shape}, lse {lse.shape}; expected {out_shape}, {lse_shape}"

    args = {"dout": dout, "out": out, "lse": lse}
    hows = {}
    for name in ("dout", "out", "lse"):
        args[name], hows[name] = spoil(dec, rng, name, args[name], T)

    # query, key, value that no longer match the saved tensors; keywords that differ
    qkv = {"query": q, "key": k, "value": v}
    mismatched = False
    if dec.chance(8):
        name = dec.pick(("query", "key", "value"))
        how = dec.pick(("grow", "fresh", "float16", "float64", "arrange", "heads"))
        x = qkv[name]
        if how == "grow" and x.ndim:
            ax = -3 if (layout == "blhd" and x.ndim >= 3) else -2
            shape = list(x.shape)
            shape[ax] += 1
            x = f32(rng.standard_normal(shape))
            mismatched = True
        elif how == "heads" and x.ndim >= 3:
            ax = -2 if layout == "blhd" else -3
            shape = list(x.shape)
            shape[ax] += 1
            x = f32(rng.standard_normal(shape))
            mismatched = True
        elif how == "fresh":
            x = f32(rng.standard_normal(x.shape))
        elif how == "float16":
            with np.errstate(all="ignore"):
                x = x.astype(np.float16)
        elif how == "float64":
            x = x.astype(np.float64)
        else:
            x = arrange(dec, x, rng)
            how = "arrange"
        if np.shape(np.asarray(x)) != qkv[name].shape:     # a list of an empty array is 1-D
            mismatched = True
        qkv[name] = x
        T(f"  {name}: {how} -> {show(x)}")
    kw2, kw_changed = dict(kw), False
    if dec.chance(8):
        change = dec.pick(("scale", "attn_mask", "key_lengths", "query_lengths", "sinks",
                           "softcap", "window", "alibi_slopes"))
        if change == "scale":
            kw2["scale"] = 0.25 if kw.get("scale") is None else None
        else:
            kw2.pop(change, None)
        kw_changed = True
        T(f"  keywords: {change} changed -> {show(kw2)}")

    # what the documentation refuses: dout, out not shaped like the output, lse not
    # (B..., H, Lq), or not float arrays (float64 beyond float32's range included)
    want = {"dout": out_shape, "out": out_shape, "lse": lse_shape}
    faults = {n: float_problem(args[n], want[n]) for n in ("dout", "out", "lse")}
    names = {n for n in faults if faults[n] or hows[n] in ("shape", "dtype", "object")}
    if mismatched:
        names |= {"query", "key", "value", "out", "dout", "lse", "attn_mask", "key_lengths",
                  "query_lengths", "sinks", "alibi_slopes"}
    refused = None if mismatched else next((f"{n}: {f}" for n, f in faults.items() if f), None)

    call_args = (args["dout"], qkv["query"], qkv["key"], qkv["value"], args["out"], args["lse"])
    snaps = [(n, x, snapshot(x)) for n, x in
             zip(("dout", "query", "key", "value", "out", "lse"), call_args)]
    snaps += [(n, x, snapshot(x)) for n, x in kw2.items()]
    T("backward: scaled_dot_product_attention_backward(dout, query, key, value, out, lse, **keywords)")
    ok, grads = attempt(T, "backward", lambda: attnx.scaled_dot_product_attention_backward(
        *call_args, **kw2), names)
    if not ok:
        return
    assert refused is None, f"backward: accepted {refused}"
    check_unchanged(snaps, "backward")
    assert isinstance(grads, attnx.AttentionGrads), type(grads)
    for name in ("query", "key", "value"):
        g, x = getattr(grads, name), qkv[name]
        assert isinstance(g, np.ndarray) and g.dtype == np.float32 and g.shape == np.shape(x), \
            f"backward: grads.{name} {getattr(g, 'dtype', None)} {np.shape(g)}, input {np.shape(x)}"
    m = kw2.get("attn_mask")
    if m is not None and m.dtype.kind == "f":
        assert grads.attn_mask is not None and grads.attn_mask.shape == m.shape, "grads.attn_mask"
    else:
        assert grads.attn_mask is None, "grads.attn_mask given for a bool mask or none"
    s = kw2.get("sinks")
    if s is not None:
        assert grads.sinks is not None and grads.sinks.shape == s.shape, "grads.sinks"
    else:
        assert grads.sinks is None, "grads.sinks given without sinks"

    # the layout and dtype of an argument do not change its value: the same call
    # on C-contiguous float32 copies gives the same bits
    if not all(is_canonical(x) for x in call_args):
        STATS["backward compared with canonical arguments"] += 1
        T("  backward compared with canonical arguments")
        plain = [canonical(x) for x in call_args]
        again = attnx.scaled_dot_product_attention_backward(*plain, **kw2)
        for name in ("query", "key", "value", "attn_mask", "sinks"):
            a, b = getattr(grads, name), getattr(again, name)
            if a is not None:
                assert_same(a, b, f"backward: grads.{name} against C-contiguous float32 arguments")
    # the forward's own saved tensors (whatever their layout): the vjp's gradients
    if not kw_changed and all(same_bits(canonical(x), y) for x, y in
                         zip(call_args, (dout, q, k, v, out, lse))):
        STATS["backward compared with the vjp"] += 1
        T("  backward compared with the vjp")
        _, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, **kw)
        expected = vjp(dout)
        for name in ("query", "key", "value", "attn_mask", "sinks"):
            a, b = getattr(grads, name), getattr(expected, name)
            if a is not None:
                assert_same(a, b, f"backward: grads.{name} against the vjp")
    if dec.chance(4):                          # (read last: older files decode to none of it)
        vjp_after_inplace(dec, rng, T, q, k, v, kw, dout)


def vjp_after_inplace(dec, rng, T, q, k, v, kw, dout):
    """Issue 18: between the forward and the vjp, the returned output or an input
    is modified in place. The output's change is harmless (the vjp keeps its
    own copy): the same gradients, bit for bit. An input's raises RuntimeError
    naming it (the vjp keeps a reference and a fingerprint)."""
    import attnx

    arrays = {"query": np.array(q), "key": np.array(k), "value": np.array(v)}
    m = kw.get("attn_mask")
    kw = dict(kw)
    if isinstance(m, np.ndarray):
        kw["attn_mask"] = arrays["attn_mask"] = np.array(m)
    out, vjp = attnx.scaled_dot_product_attention_vjp(arrays["query"], arrays["key"],
                                                      arrays["value"], **kw)
    g0 = vjp(dout)
    name = dec.pick(("out",) + tuple(arrays))
    x = out if name == "out" else arrays[name]
    if x.size == 0:
        return
    i = int(rng.integers(x.size))
    flat = x.reshape(-1) if x.flags.c_contiguous else None
    if flat is None:
        return
    if x.dtype == np.bool_:
        flat[i] = not flat[i]
    else:
        flat[i] = 1.0 if not np.isfinite(flat[i]) or flat[i] == 0 else -2.0 * flat[i]
    T(f"  vjp after {name}.flat[{i}] was modified in place")
    STATS["vjp after an in-place change"] += 1
    if name == "out":
        g1 = vjp(dout)
        for n in ("query", "key", "value", "attn_mask", "sinks"):
            a, b = getattr(g1, n), getattr(g0, n)
            if a is not None:
                assert_same(a, b, f"vjp after out was modified: grads.{n}")
        return
    try:
        vjp(dout)
    except RuntimeError as exc:
        assert f"{name} was modified in place" in str(exc), f"vjp after {name} changed: {exc}"
        return
    raise AssertionError(f"vjp after {name} was modified in place returned gradients")


# --------------------------------------------------------------------- merge

def merge64(outs, lses, layout):
    """merge_attention's formula in float64 on float32 inputs (outs S-list of
    (B..., H, Lq, Ev) or blhd, lses of (B..., H, Lq))."""
    L = np.stack([np.asarray(x, np.float64) for x in lses])
    M = L.max(axis=0)
    Msub = np.where(np.isneginf(M), 0.0, M)
    with np.errstate(all="ignore"):
        f = np.exp(L - Msub)
        den = f.sum(axis=0)
        fo = f if layout == "bhld" else np.swapaxes(f, -1, -2)
        num = sum(fs[..., None] * np.where(fs[..., None] == 0, 0.0, np.asarray(o, np.float64))
                  for fs, o in zip(fo, outs))
        dn = den if layout == "bhld" else np.swapaxes(den, -1, -2)
        out = np.where(dn[..., None] == 0, 0.0, num / np.where(dn == 0, 1, dn)[..., None])
        lse = np.where(den == 0, -np.inf, Msub + np.log(np.where(den == 0, 1, den)))
    return out, lse


def close(actual, expected, what, atol, rtol):
    base._close(actual, expected, what, atol, rtol)


def container(dec, items, T):
    how = dec.pick(("list", "tuple", "ndarray", "list", "list", "list")) if not dec.chance(16) else \
        dec.pick(("generator", "none", "dict"))
    if how == "tuple":
        return tuple(items)
    if how == "ndarray":
        try:
            return np.stack([np.asarray(x) for x in items])
        except Exception:
            return list(items)
    if how == "generator":
        return (x for x in items)
    if how == "none":
        return None
    if how == "dict":
        return {i: x for i, x in enumerate(items)}
    return list(items)


def merge_faults(c_outs, c_lses, layout):
    """What merge_attention's documentation refuses in these arguments, as the
    names of the arguments at fault (empty: a valid call); and the parts as
    merge_attention sees them (None when it cannot)."""
    faults = set()
    if layout not in ("bhld", "blhd"):
        faults.add("layout")
    parts = {}
    for name, c in (("outs", c_outs), ("lses", c_lses)):
        if isinstance(c, (list, tuple)) or (isinstance(c, np.ndarray) and c.ndim):
            parts[name] = list(c)
            faults |= {f"{name}[{i}]" for i, x in enumerate(parts[name]) if float_shape(x) is None}
        else:
            faults.add(name)
    if len(parts) < 2:
        return faults, None
    outs, lses = parts["outs"], parts["lses"]
    if not outs or len(outs) != len(lses):
        return faults | {"outs", "lses"}, None
    shape = float_shape(outs[0])
    if shape is None or len(shape) < (3 if layout == "blhd" else 2):
        return faults | {"outs[0]", "lses[0]"}, None
    rows = rows_shape(shape, layout)
    for i, (o, l) in enumerate(zip(outs, lses)):
        if float_shape(o) not in (None, shape):
            faults.add(f"outs[{i}]")
        if float_shape(l) not in (None, rows):
            faults.add(f"lses[{i}]")
    return faults, (outs, lses)


def mode_merge(dec, rng, T):
    import attnx

    if dec.int(0, 2):
        merge_chunks(dec, rng, T)
    else:
        merge_arbitrary(dec, rng, T)


def merge_chunks(dec, rng, T):
    """Attention over chunks of the keys (some empty), merged: attention over all."""
    import attnx

    q, k, v, kw, info = problem(dec, rng, T, plain=True)
    layout, nd, Lk = info["layout"], info["nd"], info["Lk"]
    S = dec.int(1, 4)
    cuts = [0] + sorted(int(c) for c in rng.integers(0, Lk + 1, size=S - 1)) + [Lk]
    T(f"merge of {S} chunk(s) of the keys: {cuts}")
    ax = -3 if layout == "blhd" else -2
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        sl = [slice(None)] * k.ndim
        sl[ax] = slice(a, b)
        kwc = dict(kw)
        if "attn_mask" in kw:
            kwc["attn_mask"] = kw["attn_mask"][:, a:b]
        ok, (o, l) = attempt(T, "merge: chunk", lambda: attnx.scaled_dot_product_attention(
            q, k[tuple(sl)], v[tuple(sl)], return_lse=True, **kwc), ())
        outs.append(o)
        lses.append(l)
    ok, (o_all, l_all) = attempt(T, "merge: all keys", lambda: attnx.scaled_dot_product_attention(
        q, k, v, return_lse=True, **kw), ())
    orig = [canonical(x) for x in outs + lses]
    if dec.chance(4):                          # each part re-laid out or converted
        for i in range(S):
            how = dec.pick(("keep", "arrange", "float64", "float16"))
            for name, seq in (("outs", outs), ("lses", lses)):
                x = seq[i]
                if how == "arrange":
                    seq[i] = arrange(dec, x, rng)
                elif how == "float64":
                    seq[i] = x.astype(np.float64)
                elif how == "float16":
                    with np.errstate(all="ignore"):
                        seq[i] = x.astype(np.float16)
                if how != "keep":
                    T(f"  {name}[{i}]: {how} -> {show(seq[i])}")
    merge_layout = layout if nd >= 3 else "bhld"
    call_kw = {"layout": merge_layout} if (merge_layout != "bhld" or dec.bool()) else {}
    c_outs, c_lses = container(dec, outs, T), container(dec, lses, T)
    # (a list of an empty array is 1-D: refused)
    faults, seen = merge_faults(c_outs, c_lses, merge_layout)
    T(f"merge_attention(outs={show(c_outs)}, lses={show(c_lses)}, {call_kw})")
    names = faults | {n.split("[")[0] for n in faults}
    ok, res = attempt(T, "merge", lambda: attnx.merge_attention(c_outs, c_lses, **call_kw), names)
    if not ok:
        return
    assert not faults, f"merge: accepted {sorted(faults)}"
    outs, lses = seen
    out, lse = res
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == o_all.shape, \
        f"merge: out {out.dtype} {out.shape}, expected float32 {o_all.shape}"
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == l_all.shape, \
        f"merge: lse {lse.dtype} {lse.shape}, expected float32 {l_all.shape}"
    parts_o = [canonical(x) for x in outs]
    parts_l = [canonical(x) for x in lses]
    if finite_small(*parts_o):
        e_out, e_lse = merge64(parts_o, parts_l, merge_layout)
        scale_o = max([1.0] + [float(np.abs(x).max()) for x in parts_o if x.size])
        close(out, e_out, "merge: out against the float64 formula", 2e-6 * scale_o, 2e-6)
        close(lse, e_lse, "merge: lse against the float64 formula", 2e-6, 2e-6)
        STATS["merge compared with the formula"] += 1
        T("  merge compared with the formula")
    if finite_small(q, k, v) and all(same_bits(canonical(x), y) for x, y in zip(outs + lses, orig)):
        # attention over all the keys at once: each part carries float32 rounding
        close(out, o_all, "merge: out against attention over all keys", 2e-5, 2e-5)
        close(lse, l_all, "merge: lse against attention over all keys", 2e-5, 2e-5)
        STATS["merge compared with attention over all keys"] += 1
        T("  merge compared with attention over all keys")
    if dec.chance(3):                          # (read last: older files decode to none of it)
        merge_sinks(rng, T, q, k, v, kw, orig[:S], orig[S:], layout, nd, merge_layout)


def merge_sinks(rng, T, q, k, v, kw, outs, lses, layout, nd, merge_layout):
    """The parts (computed without sinks) merged with sinks=: attention over all
    the keys with the sinks, each sink counted once (issue 18)."""
    import attnx

    H = (q.shape[-3] if layout == "bhld" else q.shape[-2]) if nd >= 3 else None
    sinks = f32(rng.standard_normal(H) if H is not None else rng.standard_normal())
    T(f"merge_attention(parts without sinks, sinks={show(sinks)}, layout={merge_layout!r})")
    ok, (o_s, l_s) = attempt(T, "merge: all keys with sinks", lambda: attnx.scaled_dot_product_attention(
        q, k, v, return_lse=True, sinks=sinks, **kw), ())
    out, lse = attnx.merge_attention(outs, lses, sinks=sinks, layout=merge_layout)
    assert out.dtype == np.float32 and out.shape == o_s.shape and lse.shape == l_s.shape, \
        f"merge with sinks: out {out.shape}, lse {lse.shape}; expected {o_s.shape}, {l_s.shape}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(l_s)), "merge with sinks: the empty rows"
    if finite_small(q, k, v):
        close(out, o_s, "merge with sinks: out against attention over all keys", 2e-5, 2e-5)
        close(lse, l_s, "merge with sinks: lse against attention over all keys", 2e-5, 2e-5)
        STATS["merge with sinks compared with attention over all keys"] += 1


def merge_arbitrary(dec, rng, T):
    """Arbitrary outs and lses: any number, shape, dtype, layout and container."""
    import attnx

    S = dec.pick((1, 2, 3, 2, 0, 4))
    nd = dec.pick((4, 3, 2, 1, 5, 4))
    shape = tuple(dim(dec, True) for _ in range(nd))
    layout = dec.pick(("bhld", "blhd", None, "BHLD", 1))
    lay = "bhld" if layout is None else layout
    if lay == "blhd" and nd >= 3:
        rows = shape[:-3] + (shape[-2], shape[-3])
    else:
        rows = shape[:-1]
    outs, lses = [], []
    for i in range(S):
        dt = dec.pick(BAD_DTYPES) if dec.chance(16) else dec.pick(GOOD_DTYPES)
        o = typed(values(rng, shape, dec.pick(("normal", "small", "special", "zeros", "huge"))), dt)
        lk = dec.pick(("normal", "normal", "spread", "neginf", "special", "big"))
        l = np.array(rng.standard_normal(rows) * 3, dtype=np.float64)
        if lk == "spread":
            l *= 30
        elif lk == "neginf":
            l[rng.random(rows) < 0.5] = -np.inf
        elif lk == "special":
            l[rng.random(rows) < 0.3] = dec.pick((np.nan, np.inf, -np.inf))
        elif lk == "big":
            l *= 1e30
        ldt = dec.pick(BAD_DTYPES) if dec.chance(16) else dec.pick(GOOD_DTYPES)
        l = typed(l, ldt)
        if dec.chance(8):                       # one part of another shape
            if dec.int(0, 1) == 0:
                o = reshaped(dec, rng, o)
            else:
                l = reshaped(dec, rng, l)
        if dec.chance(4):
            o = arrange(dec, o, rng)
        if dec.chance(4):
            l = arrange(dec, l, rng)
        T(f"  outs[{i}] {show(o)}, lses[{i}] {show(l)}")
        outs.append(o)
        lses.append(l)
    if S and dec.chance(10):                    # one lse more or fewer
        if dec.bool():
            lses = lses[:-1]
        else:
            lses = lses + [lses[-1]]
    c_outs, c_lses = container(dec, outs, T), container(dec, lses, T)
    call_kw = {} if layout is None else {"layout": layout}
    faults, seen = merge_faults(c_outs, c_lses, lay)
    T(f"merge_attention(outs={show(c_outs)}, lses={show(c_lses)}, {call_kw})")
    names = faults | {n.split("[")[0] for n in faults}
    ok, res = attempt(T, "merge", lambda: attnx.merge_attention(c_outs, c_lses, **call_kw), names)
    if not ok:
        return
    assert not faults, f"merge: accepted {sorted(faults)}"
    outs, lses = seen
    out, lse = res
    shape = np.shape(np.asarray(outs[0]))       # (a part of another shape when there is one)
    rows = rows_shape(shape, lay)
    assert out.dtype == np.float32 and out.shape == shape, f"merge: out {out.dtype} {out.shape}"
    assert lse.dtype == np.float32 and lse.shape == rows, f"merge: lse {lse.dtype} {lse.shape}"
    parts_o = [canonical(x) for x in outs]
    parts_l = [canonical(x) for x in lses]
    e_out, e_lse = merge64(parts_o, parts_l, lay)
    if finite_small(*parts_o) and all(np.all(np.isneginf(x) | (np.abs(x) <= 100))
                                      for x in parts_l):
        scale_o = max([1.0] + [float(np.abs(x).max()) for x in parts_o if x.size])
        close(out, e_out, "merge: out against the float64 formula", 2e-6 * scale_o, 4e-6)
        close(lse, e_lse, "merge: lse against the float64 formula", 1e-5, 2e-6)
        STATS["merge compared with the formula"] += 1
        T("  merge compared with the formula")
    else:
        # rows with no allowed key anywhere: zeros and -inf, whatever the outputs hold
        L = np.stack(parts_l)
        none = np.isneginf(L).all(axis=0)
        assert np.isneginf(lse[none]).all(), "merge: a row with every lse -inf has a finite lse"
        z = none if lay == "bhld" else np.swapaxes(none, -1, -2)
        assert not out[z].any(), "merge: a row with every lse -inf has a non-zero output"


# -------------------------------------------------------------------- varlen

CU_KINDS = ("int32", "int8", "uint8", "uint64", "int16", "list",
            "tuple", "float64", "bool", "object", "scalar", "2d", "empty", "start", "decreasing",
            "end", "huge", "wrap", "repartition", "arrange", "longer", "none")


def spoil_cu(dec, rng, name, cu, total, T):
    """cu_seqlens (int64) in some form, maybe malformed: (value, how)."""
    how = dec.pick(CU_KINDS) if dec.chance(2) else "keep"
    c = np.array(cu, dtype=np.int64)
    if how in ("int32", "int8", "uint8", "uint64", "int16"):
        with np.errstate(all="ignore"):
            x = c.astype(how)                 # int8/uint8 wrap past their range
    elif how == "list":
        x = c.tolist()
    elif how == "tuple":
        x = tuple(int(e) for e in c)
    elif how == "float64":
        x = c.astype(np.float64)
    elif how == "bool":
        x = c > 0
    elif how == "object":
        x = c.astype(object)
    elif how == "scalar":
        x = np.int64(total)
    elif how == "2d":
        x = c[None]
    elif how == "empty":
        x = np.zeros(0, np.int64)
    elif how == "start":
        x = c.copy()
        x[0] = dec.pick((1, -1, 2**40))
    elif how == "decreasing" and c.size >= 2:
        x = c.copy()
        i = dec.int(1, c.size - 1)
        x[i] = x[i - 1] - dec.int(1, 3)
    elif how == "end":
        x = c.copy()
        x[-1] += dec.pick((1, -1, 7))
    elif how == "huge":
        x = c.copy()
        x[-1] = dec.pick((2**62, 2**63 - 1, -(2**63)))
    elif how == "wrap":
        x = c.astype(np.uint64)
        x[dec.int(0, x.size - 1)] = np.uint64(2**64 - 1)
    elif how == "repartition":            # another valid split of the same rows
        inner = np.sort(rng.integers(0, total + 1, size=c.size - 2)) if c.size > 2 else []
        x = np.concatenate([[0], inner, [total]]).astype(np.int64) if c.size >= 2 else c
    elif how == "arrange":
        x = arrange(dec, c, rng)
    elif how == "longer":
        x = np.concatenate([c, [total]])
    elif how == "none":
        x = None
    else:
        x = c
        how = "keep"
    if how != "keep":
        T(f"  {name}: {how} -> {show(x)}")
    return x, how


def cu_meaning(x, total):
    """The sequence boundaries ``x`` documents (Python ints), or None when it is malformed."""
    if isinstance(x, (list, tuple)):
        if not all(isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_))
                   for e in x):
            return None
        c = [int(e) for e in x]
    else:
        if not isinstance(x, np.ndarray) or x.dtype == np.bool_ or x.dtype.kind not in "iu" \
                or x.ndim != 1:
            return None
        c = [int(e) for e in x.tolist()]
    if not c or c[0] != 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] != total:
        return None
    return c


def per_seq_value(dec, rng, name, N, Hq, T):
    """sinks or alibi_slopes for varlen: (Hq,), (N, Hq), (1,), (N, 1), 0-d, or wrong."""
    form = dec.pick(("heads", "sequences", "one", "column", "scalar", "wrong", "3d"))
    shape = {"heads": (Hq,), "sequences": (N, Hq), "one": (1,), "column": (N, 1), "scalar": (),
             "wrong": (N + 1, Hq), "3d": (1, N, Hq)}[form]
    if name == "alibi_slopes":
        x = np.ldexp(1.0, -rng.integers(1, 9, size=shape)).astype(np.float32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    T(f"  {name}: {form} {show(x)}")
    return x, form


def seq_option(x, i, N):
    """Sequence i's value of a per-head (H,) or per-sequence (N, H) option."""
    if x is None:
        return None
    a = np.asarray(x)
    return a[i] if a.ndim == 2 else x


def mode_varlen(dec, rng, T):
    varlen_packed(dec, rng, T)
    if dec.chance(3):                          # (read last: older files decode to none of it)
        varlen_int8_pages(dec, rng, T)


def varlen_packed(dec, rng, T):
    import attnx

    N = dec.int(0, 4)
    Hk = dec.pick((1, 2, 3, 1, 0))
    g = dec.int(1, 3) if dec.chance(3) else 1
    Hq = Hk * g
    E, Ev = dim(dec), dim(dec)
    lens = (0, 1, 2, 3, 5, 8, 9, 17, 1, 4)
    qlens = [dec.pick(lens) for _ in range(N)]
    klens = [dec.pick(lens) for _ in range(N)]
    cq = np.concatenate([[0], np.cumsum(qlens, dtype=np.int64)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(klens, dtype=np.int64)]).astype(np.int64)
    tq, tk = int(cq[-1]), int(ck[-1])
    regime = dec.pick(REGIMES)
    q = f32(values(rng, (tq, Hq, E), regime))
    k = f32(values(rng, (tk, Hk, E), regime))
    v = f32(values(rng, (tk, Hk, Ev), regime))
    T(f"varlen: N={N}, Hq={Hq}, Hk={Hk}, E={E}, Ev={Ev}, query lengths {qlens}, key lengths "
      f"{klens}, regime {regime}")
    names = set()
    qkv = {"query": q, "key": k, "value": v}
    if dec.chance(6):                                  # a packed input out of shape or kind
        name = dec.pick(("query", "key", "value"))
        how = dec.pick(("2d", "4d", "dtype", "heads", "total", "width", "arrange", "float16"))
        x = qkv[name]
        if how == "2d":
            x = x.reshape(x.shape[0], x.shape[1] * x.shape[2])
        elif how == "4d":
            x = x[None]
        elif how == "dtype":
            x = typed(x.astype(np.float64), dec.pick(BAD_DTYPES))
        elif how in ("heads", "total", "width"):
            shape = list(x.shape)
            shape[{"total": 0, "heads": 1, "width": 2}[how]] += 1
            x = f32(rng.standard_normal(shape))
        elif how == "arrange":
            x = arrange(dec, x, rng)
        else:
            with np.errstate(all="ignore"):
                x = x.astype(np.float16)
        if how not in ("arrange", "float16") or np.shape(np.asarray(x)) != qkv[name].shape:
            names |= {"query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "enable_gqa",
                      "sinks", "alibi_slopes"}
        qkv[name] = x
        T(f"  {name}: {how} -> {show(x)}")
    cu_q, how_q = spoil_cu(dec, rng, "cu_seqlens_q", cq, tq, T)
    cu_k, how_k = spoil_cu(dec, rng, "cu_seqlens_k", ck, tk, T)
    if how_q != "keep" or how_k != "keep":
        # a length mismatch names both; another number of sequences, the per-sequence options
        names |= {"cu_seqlens_q", "cu_seqlens_k", "sinks", "alibi_slopes"}

    opts = {}
    if dec.chance(3):
        opts["is_causal"] = dec.pick((True, "lower_right", "upper_left", False))
    if dec.chance(4):
        opts["scale"] = dec.pick((0.5, 0.125, 2.0))
    if g > 1 or dec.chance(6):
        opts["enable_gqa"] = True
    if dec.chance(5):
        opts["window"] = (dec.pick((None, 0, 1, 4)), dec.pick((None, 0, 2)))
    if dec.chance(6):
        opts["softcap"] = dec.pick((1.0, 30.0))
    forms = {}
    for name in ("sinks", "alibi_slopes"):
        if dec.chance(4):
            opts[name], forms[name] = per_seq_value(dec, rng, name, N, Hq, T)
            if forms[name] in ("wrong", "3d"):
                names.add(name)
    if "is_causal" not in opts and dec.chance(8):
        opts["alignment"] = dec.pick(("upper_left", "lower_right"))
    api = dec.pick(("forward", "forward", "lse", "vjp", "vjp"))
    T(f"  options {show(opts)}")

    call = (qkv["query"], qkv["key"], qkv["value"], cu_q, cu_k)
    snaps = [(n, x, snapshot(x)) for n, x in zip(("query", "key", "value", "cu_seqlens_q",
                                                  "cu_seqlens_k"), call)]
    mq, mk = cu_meaning(cu_q, np.shape(qkv["query"])[0] if np.ndim(qkv["query"]) else -1), \
        cu_meaning(cu_k, np.shape(qkv["key"])[0] if np.ndim(qkv["key"]) else -1)
    if api == "vjp":
        T("varlen_attention_vjp(query, key, value, cu_seqlens_q, cu_seqlens_k, **options)")
        ok, res = attempt(T, "varlen vjp", lambda: attnx.varlen_attention_vjp(*call, **opts), names)
    else:
        if api == "lse":
            opts["return_lse"] = dec.pick((True, True, np.True_, False, 1, "yes"))
            if not isinstance(opts["return_lse"], (bool, np.bool_)):
                names.add("return_lse")
        T(f"varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, **options)")
        ok, res = attempt(T, "varlen", lambda: attnx.varlen_attention(*call, **opts), names)
    if not ok:
        return
    assert mq is not None, f"varlen: accepted a malformed cu_seqlens_q {show(cu_q)}"
    assert mk is not None, f"varlen: accepted a malformed cu_seqlens_k {show(cu_k)}"
    assert len(mq) == len(mk), "varlen: accepted cu_seqlens_q and cu_seqlens_k of different lengths"
    assert "return_lse" not in names, "varlen: accepted a return_lse that is not a bool"
    check_unchanged(snaps, "varlen")
    qa, ka, va = (np.asarray(x) for x in call[:3])
    n = len(mq) - 1
    per_seq = {name: opts.get(name) for name in ("sinks", "alibi_slopes")}
    rest = {k_: v_ for k_, v_ in opts.items() if k_ not in ("sinks", "alibi_slopes", "return_lse")}
    if api == "vjp":
        out, vjp = res
        lse = None
    elif opts.get("return_lse"):
        out, lse = res
    else:
        out, lse = res, None
    Hq_, Ev_ = qa.shape[1], va.shape[2]
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (qa.shape[0], Hq_, Ev_), \
        f"varlen: out {getattr(out, 'dtype', None)} {np.shape(out)}"
    if lse is not None:
        assert lse.dtype == np.float32 and lse.shape == (Hq_, qa.shape[0]), f"varlen: lse {lse.shape}"
    calls = []
    for i in range(n):
        qs, ks = slice(mq[i], mq[i + 1]), slice(mk[i], mk[i + 1])
        kw_i = dict(rest, layout="blhd", sinks=seq_option(per_seq["sinks"], i, n),
                    alibi_slopes=seq_option(per_seq["alibi_slopes"], i, n))
        calls.append((qs, ks, kw_i))
        if qs.start == qs.stop:
            continue
        o_i, l_i = attnx.scaled_dot_product_attention(qa[None, qs], ka[None, ks], va[None, ks],
                                                      return_lse=True, **kw_i)
        assert_same(out[qs], o_i[0], f"varlen: sequence {i}'s output against its own call")
        if lse is not None:
            assert_same(lse[:, qs], l_i[0], f"varlen: sequence {i}'s lse against its own call")
        if qa[qs].size + ka[ks].size + va[ks].size <= 4000 and \
                finite_small(qa[qs], ka[ks], va[ks]) and modest(kw_i):
            ref = attnx.reference(qa[None, qs], ka[None, ks], va[None, ks], **kw_i)
            close(out[qs], ref[0], f"varlen: sequence {i} against attnx.reference", None, None)
            STATS["varlen compared with reference"] += 1
            T("  varlen compared with reference")
    if api != "vjp":
        return

    # the gradients: vjp(dout), dout maybe out of shape or kind
    dout = f32(rng.standard_normal(out.shape))
    dout2, how = spoil(dec, rng, "dout", dout, T)
    problem_ = float_problem(dout2, out.shape)
    T("vjp(dout)")
    spoiled = {"dout"} if problem_ or how in ("shape", "dtype", "object") else set()
    spoiled |= {n for n in ("sinks", "alibi_slopes") if n in names}   # (no sequence: unchecked)
    ok, grads = attempt(T, "varlen vjp(dout)", lambda: vjp(dout2), spoiled)
    if not ok:
        return
    assert problem_ is None, f"varlen vjp: accepted dout with {problem_}"
    do = canonical(dout2)
    for name, x in (("query", qa), ("key", ka), ("value", va)):
        gx = getattr(grads, name)
        assert gx.dtype == np.float32 and gx.shape == x.shape, f"varlen vjp: grads.{name} {gx.shape}"
    assert grads.attn_mask is None
    if per_seq["sinks"] is None:
        assert grads.sinks is None, "varlen vjp: grads.sinks without sinks"
    else:
        assert grads.sinks is not None and grads.sinks.shape == np.shape(per_seq["sinks"]), \
            f"varlen vjp: grads.sinks {None if grads.sinks is None else grads.sinks.shape}, sinks " \
            f"{np.shape(per_seq['sinks'])}"
    dsinks = []
    for i, (qs, ks, kw_i) in enumerate(calls):
        if qs.start == qs.stop:
            assert not grads.query[qs].any()
            dsinks.append(None)
            continue
        _, f = attnx.scaled_dot_product_attention_vjp(qa[None, qs], ka[None, ks], va[None, ks], **kw_i)
        g = f(do[None, qs])
        assert_same(grads.query[qs], g.query[0], f"varlen vjp: sequence {i}'s grads.query")
        assert_same(grads.key[ks], g.key[0], f"varlen vjp: sequence {i}'s grads.key")
        assert_same(grads.value[ks], g.value[0], f"varlen vjp: sequence {i}'s grads.value")
        dsinks.append(g.sinks)
    for i, (qs, ks, kw_i) in enumerate(calls):
        if qs.start == qs.stop and ks.start != ks.stop:
            assert not grads.key[ks].any() and not grads.value[ks].any(), \
                f"varlen vjp: keys of sequence {i}, which has no query, got gradients"
    if per_seq["sinks"] is not None:
        given = np.asarray(per_seq["sinks"])
        if given.ndim == 2:             # (N, H): a row each
            H = given.shape[-1]
            rows = [np.zeros(H, np.float32) if p is None else np.reshape(p, H) for p in dsinks]
            want = np.stack(rows).astype(np.float32) if rows else np.zeros(given.shape, np.float32)
        else:                           # one value or (H,): summed in float64, in order
            total = np.zeros(given.shape, np.float64)
            for p in dsinks:
                if p is not None:
                    total += np.reshape(p, given.shape)
            want = total.astype(np.float32)
        assert_same(grads.sinks, want, "varlen vjp: grads.sinks against the per-sequence sums")


# ------------------------------------------------------------- int8 pages

#: how a pool's rows are rotated: attnx.int8_rotation(E) (the caches' format),
#: none (a 2-tuple, or None in the third place), the identity, a random
#: matrix (any finite (E, E) is a rotation to varlen_attention: rows stand for
#: ``(scale * q) @ R``), an integer matrix
ROTATIONS = ("int8_rotation", "int8_rotation", "pair", "none", "eye", "random", "integer")
#: what makes an int8 pool call invalid, and the argument its error names
INT8_FAULTS = {"pages_int16": "key", "pages_list": "key", "scales_shape": "key",
               "scales_int": "value", "rotation_shape": "key", "rotation_nan": "value",
               "five_items": "key", "value_centers": "value", "value_array": "value",
               "centers_shape": "key", "centers_nan": "key", "pages_disagree": "value"}


def int8_scales(dec, rng, shape):
    """float32 scales (>= 0) in one regime: rows of zeros, subnormal, huge, mixed."""
    kind = dec.pick(("normal", "normal", "zeros", "tiny", "huge", "mixed", "small"))
    s = rng.random(shape) * 0.03
    if kind == "zeros":
        s[rng.random(shape) < 0.5] = 0.0
    elif kind == "tiny":
        s *= 1e-40
    elif kind == "huge":
        s *= 1e34
    elif kind == "mixed":
        s *= 10.0 ** rng.uniform(-40, 3, shape)
    elif kind == "small":
        s *= 0.01
    return s.astype(np.float32)


def int8_rotation_form(dec, rng, E):
    """A pool's rotation as passed (or "pair": a 2-tuple) and as the rows use it."""
    import attnx

    form = dec.pick(ROTATIONS)
    if form == "int8_rotation":
        r = attnx.int8_rotation(E)
    elif form == "eye":
        r = np.eye(E, dtype=np.float32)
    elif form == "random":
        r = rng.standard_normal((E, E)) / np.sqrt(E)
    elif form == "integer":
        r = np.diag(rng.choice((-1, 1), size=E))[rng.permutation(E)]     # a signed permutation
    else:
        r = None
    return form, r


def pool_rows(pages, scales, rotation):
    """The rows an int8 pool stands for, float64: ``(scale * q) @ R`` (no R: ``scale * q``)."""
    x = scales.astype(np.float32).astype(np.float64)[..., None] * pages
    return x if rotation is None else x @ np.asarray(rotation, np.float64)


def varlen_int8_pages(dec, rng, T):
    """varlen_attention over int8 page pools (``(pages, scales)``, ``(pages,
    scales, rotation)``, keys also ``(pages, scales, rotation, centers)``),
    pages in a random order, unused block_table entries arbitrary: each
    sequence within float32 rounding of float64 attention over the rows the
    pools stand for (plus its centre)."""
    N = dec.int(1, 4)
    Hk = dec.pick((1, 2, 3, 1))
    g = dec.int(1, 3) if dec.chance(2) else 1
    Hq = Hk * g
    E, Ev = dec.pick((1, 2, 3, 4, 5, 8, 16, 17)), dec.pick((1, 2, 3, 4, 8, 16))
    bs = dec.pick((1, 2, 3, 4, 8, 16))
    klens = [dec.pick((0, 1, 2, 3, 5, 8, 9, 17, 1, 33)) for _ in range(N)]
    qlens = [dec.pick((1, 1, 2, 3, 0, 5)) for _ in range(N)]
    need = [-(-n // bs) for n in klens]
    NB = sum(need) + dec.int(0, 3)
    order = rng.permutation(NB)
    table = rng.integers(-3, NB + 4, size=(N, max(need + [1])))    # unused entries: anything
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n]
        at += n
    kq = rng.integers(-127, 128, size=(NB, bs, Hk, E)).astype(np.int8)
    vq = rng.integers(-127, 128, size=(NB, bs, Hk, Ev)).astype(np.int8)
    ks, vs = int8_scales(dec, rng, (NB, bs, Hk)), int8_scales(dec, rng, (NB, bs, Hk))
    kform, kr = int8_rotation_form(dec, rng, E)
    vform, vr = int8_rotation_form(dec, rng, Ev)
    centers = None
    if dec.bool():
        centers = f32(rng.standard_normal((N, Hk, E)) * dec.pick((0.5, 3.0, 100.0)))
    key = (kq, ks) if kform == "pair" and centers is None else (kq, ks, kr)
    if centers is not None:
        key += (centers,)
    value = (vq, vs) if vform == "pair" else (vq, vs, vr)
    regime = dec.pick(REGIMES)
    q = f32(values(rng, (sum(qlens), Hq, E), regime))
    T(f"varlen int8 pages: N={N}, Hq={Hq}, Hk={Hk}, E={E}, Ev={Ev}, block_size={bs}, "
      f"{NB} pages, key lengths {klens}, query lengths {qlens}, rotations {kform}/{vform}, "
      f"centers {centers is not None}, query regime {regime}")
    opts, names, refused = int8_page_options(dec, rng, N, Hq, g, centers is not None, T)
    if dec.chance(4):                      # the key pool laid out otherwise
        key = (arrange(dec, kq, rng), arrange(dec, ks, rng)) + key[2:]
        if not isinstance(key[0], np.ndarray):          # a list of ints: int64, not int8 pages
            names.add("key")
            refused = refused or "key[0] as a list"
        elif np.shape(np.asarray(key[1])) != kq.shape[:3]:     # a list of an empty array
            names.add("key")
            refused = refused or "key[1] as a list of another shape"
        else:
            kq, ks = key[0], np.asarray(key[1])         # (a broadcast repeats some rows)
        T(f"  key pools: {show(key[0])}, {show(key[1])}")
    if dec.chance(6):
        how = dec.pick(tuple(INT8_FAULTS))
        key, value = int8_fault(how, key, value, N, rng)
        names.add(INT8_FAULTS[how])
        refused = refused or how
        T(f"  {how}")
    kd, vd = pool_rows(kq, ks, kr), pool_rows(vq, vs, vr)
    check_int8_pages(T, "varlen int8 pages", q, key, value, qlens, klens, table, opts,
                     kd, vd, centers, names, refused)


def int8_page_options(dec, rng, N, Hq, g, centred, T):
    """The keywords of an int8 pages call (valid unless the names say which are not)."""
    opts, names, refused = {}, set(), None
    opts["is_causal"] = dec.pick(("lower_right", False, True, "lower_right"))
    if g > 1 or dec.chance(4):
        opts["enable_gqa"] = True
    if dec.chance(4):
        opts["scale"] = dec.pick((0.5, 0.125, 2.0))
    if dec.chance(3):
        opts["sinks"] = rng.standard_normal(dec.pick(((Hq,), (N, Hq)))).astype(np.float32)
    if dec.chance(5):
        opts["window"] = (dec.pick((None, 0, 1, 4)), dec.pick((None, 0, 2)))
    if dec.chance(5):
        opts["softcap"] = dec.pick((1.0, 30.0))
        if centred:                        # tanh does not cancel the centre's shift
            names.add("softcap")
            refused = "softcap over centred key pages"
    T(f"  options {show(opts)}")
    return opts, names, refused


def int8_fault(how, key, value, N, rng):
    """key and value with one fault of INT8_FAULTS."""
    kq, ks = key[0], key[1]
    E = np.shape(kq)[-1]
    if how == "pages_int16":
        key = (np.asarray(kq).astype(np.int16),) + key[1:]
    elif how == "pages_list":
        key = (np.asarray(kq).tolist(),) + key[1:]
    elif how == "scales_shape":
        key = (kq, np.asarray(ks)[:, :-1]) + key[2:]
    elif how == "scales_int":
        value = (value[0], np.asarray(value[1]).astype(np.int32)) + value[2:]
    elif how == "rotation_shape":
        key = (kq, ks, np.eye(E + 1)) + key[3:]
    elif how == "rotation_nan":
        Ev = np.shape(value[0])[-1]
        value = (value[0], value[1], np.full((Ev, Ev), np.nan))
    elif how == "five_items":
        key = (key + (None, None, None))[:5]
    elif how == "value_centers":
        value = (value + (None,))[:3] + (np.zeros((N,) + np.shape(value[0])[2:]),)
    elif how == "value_array":
        value = np.zeros(np.shape(value[0]), np.float32)
    elif how == "centers_shape":
        key = (key + (None,))[:3] + (np.zeros((N + 1,) + np.shape(kq)[2:], np.float32),)
    elif how == "centers_nan":
        key = (key + (None,))[:3] + (np.full((N,) + np.shape(kq)[2:], np.nan, np.float32),)
    elif how == "pages_disagree":
        vq = np.asarray(value[0])
        value = (np.concatenate([vq, vq[:1]]), np.concatenate([value[1], value[1][:1]])) + value[2:]
    return key, value


def check_int8_pages(T, what, q, key, value, qlens, klens, table, opts, kd, vd, centers,
                     names, refused):
    """varlen_attention(q, key, value, cu_seqlens, block_table=table, return_lse=True,
    **opts) over int8 pools: refused when ``refused`` says so, naming one of
    ``names``; else each sequence against float64 attention over its rows of
    ``kd`` and ``vd`` (the pools' rows as they stand, (num_blocks, block_size,
    Hk, E) float64), keys plus ``centers[i]`` (N, Hk, E) when given."""
    import attnx

    cq, ck = np.cumsum([0] + qlens), np.cumsum([0] + klens)
    snaps = [(n, x, snapshot(x)) for n, x in [("query", q)] + [
        (f"key[{i}]", x) for i, x in enumerate(key) if isinstance(key, tuple)] + [
        (f"value[{i}]", x) for i, x in enumerate(value) if isinstance(value, tuple)]]
    T(f"{what}: varlen_attention(query, key, value, {cq.tolist()}, {ck.tolist()}, "
      f"block_table={show(table)}, return_lse=True, **options)")
    ok, res = attempt(T, what, lambda: attnx.varlen_attention(
        q, key, value, cq, ck, block_table=table, return_lse=True, **opts), names)
    check_unchanged(snaps, what)
    if not ok:
        return
    assert refused is None, f"{what}: accepted {refused}"
    out, lse = res
    Hq, Hk, bs = q.shape[1], kd.shape[2], kd.shape[1]
    assert out.dtype == np.float32 and out.shape == (q.shape[0], Hq, vd.shape[-1]), \
        f"{what}: out {out.dtype} {out.shape}"
    assert lse.dtype == np.float32 and lse.shape == (Hq, q.shape[0]), f"{what}: lse {lse.shape}"
    for i, (m, n) in enumerate(zip(qlens, klens)):
        if m == 0:
            continue
        pages = table[i, :-(-n // bs)]

        def rows(pool):
            return pool[pages].reshape(-1, Hk, pool.shape[-1])[:n].swapaxes(0, 1)[None]
        k, v = rows(kd), rows(vd)
        if centers is not None:
            k = k + centers[i].astype(np.float64)[None, :, None, :]
        qi = q[cq[i]:cq[i + 1]].swapaxes(0, 1)[None]
        kw = dict(opts, enable_gqa=True, sinks=seq_option(opts.get("sinks"), i, len(qlens)))
        if qi.size + k.size + v.size > 6000 or not finite_small(qi, k, v) or not modest(kw):
            continue
        STATS[f"{what} compared with reference"] += 1
        T(f"  sequence {i} compared with reference")
        want = attnx.reference(qi, k, v, **kw)
        close(out[cq[i]:cq[i + 1]], want[0].swapaxes(0, 1), f"{what}: sequence {i}'s output",
              None, None)
        _, want_lse = attnx.scaled_dot_product_attention(qi, k, v, return_lse=True, **kw)
        close(lse[:, cq[i]:cq[i + 1]], want_lse[0], f"{what}: sequence {i}'s lse", 1e-5, 1e-5)


# ------------------------------------------------------------------- kvcache

# sizes that are not positive integers (max_len: 0 is valid), and one too big to allocate
BAD_INTS = (0, -1, 2.0, True, "2", None, np.int64(-3), np.array([2]), 2**62, np.float32(1))
#: the float caches' dtypes: every kvcache input's first session reads one of these
FLOAT_CACHE_DTYPES = (np.float32, np.float16, "float32", "float16", np.dtype(np.float16))
#: the int8 caches' (keys centred or not): a second session, read after the first
#: (its choices come after every read of older files, which keep their meaning)
INT8_CACHE_DTYPES = ("int8", np.int8, np.dtype(np.int8))
GOOD_CACHE_DTYPES = FLOAT_CACHE_DTYPES + INT8_CACHE_DTYPES
BAD_CACHE_DTYPES = (np.float64, np.int32, "bogus", None, object, "f8", bool)
BAD_FLAGS = ("yes", 1, None, 0.0, np.int8(0))


def cache_arg_ok(name, x):
    """Whether KVCache's documentation accepts ``x`` for ``name`` (a size too big
    to allocate is valid: MemoryError)."""
    if name == "dtype":
        try:
            return np.dtype(x) in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8))
        except TypeError:
            return False
    if name == "center_keys":
        return isinstance(x, (bool, np.bool_))
    if name == "value_dim" and x is None:
        return True
    if isinstance(x, (bool, np.bool_)):
        return False
    try:
        n = operator.index(x)
    except TypeError:
        return False
    return n >= (0 if name == "max_len" else 1)


def mode_kvcache(dec, rng, T):
    kv_session(dec, rng, T, FLOAT_CACHE_DTYPES)
    if dec.chance(3):                          # (read last: older files decode to none of it)
        kv_session(dec, rng, T, INT8_CACHE_DTYPES)


def kv_session(dec, rng, T, dtypes):
    """A KVCache of one of ``dtypes`` built from fuzzed arguments, then a sequence
    of ``append``, ``attend`` and assignments to ``lengths``, the cache checked
    against the harness's record after each; an int8 cache's rows then handed
    to varlen_attention as pages."""
    import attnx

    int8 = dtypes is INT8_CACHE_DTYPES
    params = {"batch": dec.pick((1, 2, 3, 2)), "heads": dec.pick((1, 2, 3, 1)),
              "max_len": dec.pick((0, 1, 2, 4, 5, 8, 9, 16, 17, 24)),
              "head_dim": dec.pick((1, 2, 3, 4, 5, 8, 9)),
              "value_dim": dec.pick((None, None, 1, 3, 4, 8)),
              "dtype": dec.pick(dtypes)}
    if int8:
        params["center_keys"] = dec.pick((True, False, True, np.False_))
    names, refused = set(), None
    if dec.chance(8):
        name = dec.pick(tuple(params))
        params[name] = dec.pick(BAD_CACHE_DTYPES if name == "dtype" else
                                BAD_FLAGS if name == "center_keys" else BAD_INTS)
        names.add(name)
        if not cache_arg_ok(name, params[name]):
            refused = name
    kwargs = {k_: v_ for k_, v_ in params.items() if not (k_ == "value_dim" and v_ is None)}
    T(f"KVCache({show(kwargs)})")
    ok, cache = attempt(T, "KVCache()", lambda: attnx.KVCache(**kwargs), names)
    if not ok:
        return
    assert refused is None, f"KVCache: accepted {refused}={params[refused]!r}"
    B, H, max_len, D = cache.batch, cache.heads, cache.max_len, cache.head_dim
    Dv = cache.value_dim
    dt = cache.k.dtype
    assert cache.k.shape == (B, H, max_len, D) and cache.v.shape == (B, H, max_len, Dv)
    assert dt in ((np.int8,) if int8 else (np.float32, np.float16)) and cache.v.dtype == dt
    assert cache.lengths.dtype == np.int64 and cache.lengths.tolist() == [0] * B
    rec = Int8Record(cache, bool(params.get("center_keys"))) if int8 else FloatRecord(cache)
    lengths = np.zeros(B, np.int64)
    lengths_ok = True
    for step in range(dec.int(1, 8)):
        op = dec.pick(("append", "append", "attend", "attend", "append", "attend", "lengths"))
        if op == "append":
            lengths_ok = kv_append(dec, rng, T, cache, rec, lengths, lengths_ok, step)
        elif op == "attend":
            kv_attend(dec, rng, T, cache, rec, lengths, lengths_ok, step)
        else:
            lengths_ok = kv_lengths(dec, rng, T, cache, lengths, step)
        rec.check(cache, step)
    if int8 and lengths_ok and dec.chance(2):
        kv_int8_pages(dec, rng, T, cache, rec, lengths)


class FloatRecord:
    """What a float KVCache must hold: a copy of its k and v, written by the harness."""

    KIND = "KVCache"

    def __init__(self, cache):
        self.bufs = (cache.k, cache.v)
        self.K, self.V = (np.zeros(x.shape, x.dtype) for x in (cache.k, cache.v))

    def faults(self, cache, k_new, v_new, want_k, want_v, lengths):
        """What append must refuse in k_new and v_new: (the first fault or None,
        the names a refusal may give)."""
        half = cache.k.dtype == np.float16
        fk, fv = float_problem(k_new, want_k, half), float_problem(v_new, want_v, half)
        return fk or fv, ({"k_new"} if fk else set()) | ({"v_new"} if fv else set())

    def write(self, cache, lengths, n, ka, va):
        with np.errstate(all="ignore"):
            for b in range(cache.batch):
                at = int(lengths[b])
                self.K[b, :, at:at + n] = ka[b]
                self.V[b, :, at:at + n] = va[b]

    def rows(self, b, L):
        """Sequence b's first L keys and values, (1, H, L, width), as attention reads them."""
        return self.K[b:b + 1, :, :L], self.V[b:b + 1, :, :L]

    def check(self, cache, step):
        assert cache.k is self.bufs[0] and cache.v is self.bufs[1], \
            "KVCache: its buffers were replaced"
        assert_same(cache.k, self.K, f"KVCache: step {step}: k against the harness's record")
        assert_same(cache.v, self.V, f"KVCache: step {step}: v against the harness's record")


class Int8Record:
    """What an int8 KVCache must hold: a copy of its int8 rows, scales and key
    centres. An append's rows are checked against what was appended (each
    rotated value within the documented bound, the centres the mean of a
    sequence's first keys) and then copied here; attention is checked in
    float64 over the rows these stand for, ``(scale * q) @ R`` plus the centre."""

    NAMES = ("k", "v", "k_scale", "v_scale", "k_center")
    KIND = "KVCache int8"

    def __init__(self, cache, centred):
        import attnx

        B, H, max_len = cache.batch, cache.heads, cache.max_len
        self.bufs = tuple(getattr(cache, n) for n in self.NAMES)
        assert cache.k_scale.shape == cache.v_scale.shape == (B, H, max_len)
        assert cache.k_scale.dtype == cache.v_scale.dtype == np.float32
        assert (cache.k_center is not None) == centred, \
            f"KVCache int8: k_center {cache.k_center} with center_keys={centred}"
        if centred:
            assert cache.k_center.shape == (B, H, 1, cache.head_dim)
            assert cache.k_center.dtype == np.float32 and not cache.k_center.any()
        self.Rk, self.Rv = attnx.int8_rotation(cache.head_dim), attnx.int8_rotation(cache.value_dim)
        for r, mine in ((cache.k_rotation, self.Rk), (cache.v_rotation, self.Rv)):
            assert not r.flags.writeable and r.dtype == np.float64
            assert_same(r, mine, "KVCache: k_rotation/v_rotation against attnx.int8_rotation")
        self.arrays = {n: None if b is None else np.zeros(b.shape, b.dtype)
                       for n, b in zip(self.NAMES, self.bufs)}

    def centres(self, cache, a, lengths):
        """The centres (batch, heads, 1, E) float64 appending keys ``a`` uses:
        the mean of a sequence's keys when they are its first (then fixed),
        else its centre so far; None for an uncentred cache."""
        if self.arrays["k_center"] is None:
            return None
        c = self.arrays["k_center"].astype(np.float64)
        starts = lengths == 0
        if a.shape[2] and starts.any():
            c[starts] = a[starts].mean(axis=2, keepdims=True).astype(np.float32)
        return c

    def rotated(self, a, rotation, centre):
        """y = (x - centre) @ R.T (float64) for the rows of ``a``."""
        x = a.astype(np.float64)
        if centre is not None:
            x = x - centre
        return x @ rotation.T

    def faults(self, cache, k_new, v_new, want_k, want_v, lengths):
        """What append must refuse (the first fault, or None) and the names a
        refusal may give: besides shapes and dtypes, NaN and inf, and rows too
        long for float32 once centred and rotated (within a hair of the limit,
        either answer passes)."""
        fault, names = None, set()
        for name, x, want, R in (("k_new", k_new, want_k, self.Rk),
                                 ("v_new", v_new, want_v, self.Rv)):
            p = float_problem(x, want)
            if p is None or p == "float64 values beyond float32's range":
                a = np.asarray(x, dtype=np.float64)
                if not np.isfinite(a).all():
                    p = "NaN or inf, which an int8 cache cannot store"
                elif a.size and a.shape[-1]:
                    c = self.centres(cache, a, lengths) if name == "k_new" else None
                    with np.errstate(all="ignore"):
                        top = np.abs(self.rotated(a, R, c)).max()
                    p = "a row too long for float32 once rotated" if top > F32_MAX * (1 + 1e-6) \
                        else None
                    if top > F32_MAX * (1 - 1e-6):
                        names.add(name)
                else:
                    p = None
            if p is not None:
                fault = fault or f"{name}: {p}"
                names.add(name)
        return fault, names

    def write(self, cache, lengths, n, ka, va):
        """The rows an append wrote (from ``lengths``, n a sequence), checked and kept."""
        r = self.arrays
        c = self.centres(cache, ka.astype(np.float64), lengths)
        if c is not None:
            got = cache.k_center.astype(np.float64)
            assert np.all(np.abs(got - c) <= np.spacing(np.abs(c).astype(np.float32))), \
                "KVCache int8: k_center is not the mean of each sequence's first keys"
            r["k_center"][...] = cache.k_center
        for b in range(cache.batch):
            at = int(lengths[b])
            rows = slice(at, at + n)
            for name, a, R, centre in (("k", ka, self.Rk, None if c is None else c[b]),
                                       ("v", va, self.Rv, None)):
                q, s = getattr(cache, name)[b, :, rows], getattr(cache, name + "_scale")[b, :, rows]
                assert q.dtype == np.int8 and (q != -128).all(), f"KVCache int8: {name} holds -128"
                y = self.rotated(a[b], R, centre)
                top = np.abs(y).max(axis=-1, keepdims=True) if y.shape[-1] else np.zeros(y.shape)
                bound = top / 254 * (1 + 2e-5) + np.where(top < 127 * 2.0 ** -126, 2.0 ** -150, 0)
                err = np.abs(s[..., None].astype(np.float64) * q - y)
                if not np.all(err <= bound):
                    i = np.unravel_index(np.argmax(err - bound), err.shape)
                    raise AssertionError(f"KVCache int8: {name} of sequence {b}, (head, token, "
                                         f"channel) {i}: stored {s[i[:2]]!r} * {q[i]} is "
                                         f"{err[i]:.3g} from the rotated value {y[i]!r}, past the "
                                         f"bound {bound[i[:2]][0]:.3g}")
                r[name][b, :, rows] = q
                r[name + "_scale"][b, :, rows] = s
        STATS["KVCache int8.append: rows within the bound"] += 1

    def rows(self, b, L):
        """Sequence b's first L keys and values, (1, H, L, width) float64, as they
        stand: ``(scale * q) @ R``, plus the keys' centre."""
        r = self.arrays

        def rows_(q, s, R):
            return (s[b:b + 1, :, :L, None].astype(np.float64) * q[b:b + 1, :, :L]) @ R
        k = rows_(r["k"], r["k_scale"], self.Rk)
        if r["k_center"] is not None:
            k = k + r["k_center"][b:b + 1].astype(np.float64)
        return k, rows_(r["v"], r["v_scale"], self.Rv)

    def check(self, cache, step):
        for name, buf in zip(self.NAMES, self.bufs):
            x = getattr(cache, name)
            assert x is buf, f"KVCache: its {name} was replaced"
            if x is not None:
                assert_same(x, self.arrays[name], f"KVCache: step {step}: {name} against the "
                            f"harness's record")


def kv_int8_pages(dec, rng, T, cache, rec, lengths):
    """An int8 cache's rows handed to varlen_attention as pages of a size that
    divides max_len, with its rotations and (mostly, when it centres keys) its
    centres: each sequence against float64 attention over the rows the record
    says they stand for (issue 56: the centres' 4-tuple once left its
    rotation out)."""
    B, H, max_len = cache.batch, cache.heads, cache.max_len
    if max_len == 0:
        return
    bs = dec.pick(tuple(d for d in (max_len, 1, 2, 4, 8) if max_len % d == 0))
    nb = max_len // bs

    def pool(x):                        # (B, H, max_len, ...) -> (B * nb, bs, H, ...)
        x = np.moveaxis(x, 1, 2)
        return np.ascontiguousarray(x).reshape((B * nb, bs) + x.shape[2:])
    g = dec.int(1, 3) if dec.chance(3) else 1
    qlens = [dec.pick((1, 1, 2, 3, 0)) for _ in range(B)]
    centred = cache.k_center is not None and dec.int(0, 3) != 0
    regime = dec.pick(("normal", "normal", "small", "huge", "special"))
    q = f32(values(rng, (sum(qlens), H * g, cache.head_dim), regime))
    T(f"KVCache int8 as pages of {bs} rows: lengths {lengths.tolist()}, query lengths {qlens}, "
      f"centres {centred}, query regime {regime}")
    key = (pool(cache.k), pool(cache.k_scale), cache.k_rotation)
    if centred:
        key += (cache.k_center[:, :, 0],)
    value = (pool(cache.v), pool(cache.v_scale), cache.v_rotation)
    opts, names, refused = int8_page_options(dec, rng, B, H * g, g, centred, T)
    r = rec.arrays
    kd = pool_rows(pool(r["k"]), pool(r["k_scale"]), rec.Rk)
    vd = pool_rows(pool(r["v"]), pool(r["v_scale"]), rec.Rv)
    table = np.arange(B * nb).reshape(B, nb)
    check_int8_pages(T, "KVCache int8 as pages", q, key, value, qlens,
                     [int(n) for n in lengths], table, opts, kd, vd,
                     r["k_center"][:, :, 0] if centred else None, names, refused)


def kv_tokens(dec, rng, cache, n, width, regime):
    dt = dec.pick(("float32", "float32", "float16", "float64"))
    return arrange(dec, typed(values(rng, (cache.batch, cache.heads, n, width), regime), dt), rng) \
        if dec.chance(4) else typed(values(rng, (cache.batch, cache.heads, n, width), regime), dt)


def kv_append(dec, rng, T, cache, rec, lengths, lengths_ok, step):
    n = dec.pick((1, 1, 2, 3, 0, 5, 8, 17))
    regime = dec.pick(("normal", "normal", "small", "special", "huge", "zeros"))
    k_new = kv_tokens(dec, rng, cache, n, cache.head_dim, regime)
    v_new = kv_tokens(dec, rng, cache, n, cache.value_dim, regime)
    names = set()
    if dec.chance(6):
        which = dec.pick(("k_new", "v_new"))
        x = k_new if which == "k_new" else v_new
        how = dec.pick(("batch", "heads", "width", "tokens", "3d", "5d", "dtype", "object", "list",
                        "beyond"))
        if how in ("batch", "heads", "width", "tokens"):
            shape = [cache.batch, cache.heads, n, cache.head_dim if which == "k_new" else cache.value_dim]
            shape[("batch", "heads", "tokens", "width").index(how)] += dec.int(1, 2)
            x = f32(rng.standard_normal(shape))
        elif how == "3d":
            x = np.asarray(x)[0]
        elif how == "5d":
            x = np.asarray(x)[None]
        elif how == "dtype":
            x = typed(np.zeros(np.shape(x)), dec.pick(BAD_DTYPES))
        elif how == "object":
            x = dec.pick(NON_ARRAYS)
        elif how == "list":
            x = np.asarray(x).tolist()
        else:
            x = np.asarray(x, dtype=np.float64).copy()
            if x.size:
                x.flat[0] = 1e300
        if how != "list":
            names |= {which, "k_new", "v_new"} if how == "tokens" else {which}
        if which == "k_new":
            k_new = x
        else:
            v_new = x
        T(f"  {which}: {how}")
    want_k, want_v = (cache.batch, cache.heads, n, cache.head_dim), (cache.batch, cache.heads, n,
                                                                       cache.value_dim)
    fault, at_fault = rec.faults(cache, k_new, v_new, want_k, want_v, lengths)
    names |= at_fault
    full = bool(lengths_ok and cache.batch and int(lengths.max()) + n > cache.max_len)
    if full:
        names.add("max_len")
    if not lengths_ok:
        names.add("lengths")
    T(f"step {step}: append(k_new={show(k_new)}, v_new={show(v_new)}) at lengths {lengths.tolist()}")
    snaps = [("k_new", k_new, snapshot(k_new)), ("v_new", v_new, snapshot(v_new))]
    before = np.array(cache.lengths, copy=True) if isinstance(cache.lengths, np.ndarray) else None
    ok, _ = attempt(T, "KVCache.append", lambda: cache.append(k_new, v_new), names)
    check_unchanged(snaps, "KVCache.append")
    if not ok:
        if before is not None:
            assert np.array_equal(np.asarray(cache.lengths), before), \
                "KVCache.append raised but changed lengths"
        return lengths_ok
    assert lengths_ok, "KVCache.append: accepted a lengths attribute out of range or kind"
    assert not full, f"KVCache.append: accepted {n} token(s) past max_len={cache.max_len}"
    assert fault is None, f"KVCache.append: accepted k_new/v_new with {fault}"
    rec.write(cache, lengths, n, np.asarray(k_new), np.asarray(v_new))
    lengths += n
    got = np.asarray(cache.lengths)
    assert got.tolist() == lengths.tolist(), f"KVCache.append: lengths {got.tolist()}, expected " \
        f"{lengths.tolist()}"
    return True


def kv_lengths(dec, rng, T, cache, lengths, step):
    """``cache.lengths = ...``: in range or not, of any kind. Returns whether it is valid."""
    B, max_len = cache.batch, cache.max_len
    how = dec.pick(("different", "different", "same", "int32", "list", "uint8", "out", "negative",
                    "shape", "float", "bool", "scalar", "readonly"))
    x = rng.integers(0, max_len + 1, size=B)
    if how == "same":
        x[:] = x[0]
    if how == "int32":
        x = x.astype(np.int32)
    elif how == "list":
        x = x.tolist()
    elif how == "uint8" and max_len < 256:
        x = x.astype(np.uint8)
    elif how == "out":
        x[dec.int(0, B - 1)] = max_len + dec.int(1, 3)
    elif how == "negative":
        x[dec.int(0, B - 1)] = -1
    elif how == "shape":
        x = np.concatenate([x, [0]])
    elif how == "float":
        x = x.astype(np.float64)
    elif how == "bool":
        x = x > 0
    elif how == "scalar":
        x = np.int64(0)
    elif how == "readonly":
        x.flags.writeable = False
    T(f"step {step}: lengths = {show(x)} ({how})")
    cache.lengths = x
    a = np.asarray(x)
    valid = a.shape == (B,) and a.dtype.kind in "iu" and (not a.size or (a.min() >= 0 and a.max() <= max_len))
    if valid:
        lengths[...] = a
    return bool(valid)


def kv_options(dec, rng, cache, Hq, nq, T):
    """attend's keywords (valid unless the returned names say which are not)."""
    opts, names = {}, set()
    B = cache.batch
    if dec.chance(3):
        opts["need_weights"] = True
    if dec.chance(3):
        opts["return_lse"] = True
    if dec.chance(4):
        opts["scale"] = dec.pick((0.5, 0.125, 2.0))
    if dec.chance(4):
        opts["window"] = (dec.pick((None, 0, 1, 4)), dec.pick((None, 0, 2)))
    if dec.chance(6):
        opts["softcap"] = dec.pick((1.0, 30.0))
    if dec.chance(4):
        shape = dec.pick(((Hq,), (B, Hq), (1, Hq), (B, 1), (Hq + 1,)))
        opts["sinks"] = rng.standard_normal(shape).astype(np.float32)
        if shape == (Hq + 1,):
            names.add("sinks")
    if dec.chance(5):
        shape = dec.pick(((Hq,), (B, Hq)))
        opts["alibi_slopes"] = np.ldexp(1.0, -rng.integers(1, 9, size=shape)).astype(np.float32)
    if dec.chance(6):
        opts["query_lengths"] = rng.integers(0, nq + 1, size=dec.pick(((B,), ())))
    refused = None
    if dec.chance(8):
        opts["alignment"] = dec.pick(("lower_right", "upper_left"))
        if opts["alignment"] == "upper_left":      # contradicts the cache's lower-right causal
            names |= {"alignment", "is_causal"}
            refused = "alignment='upper_left'"
    if dec.chance(10):
        bad = dec.pick(("is_causal", "key_lengths", "layout", "enable_gqa", "bogus",
                        "need_weights", "return_lse", "dropout_p"))
        opts[bad] = {"is_causal": True, "key_lengths": [1], "layout": "bhld",
                     "enable_gqa": True, "bogus": 1, "need_weights": "yes", "return_lse": 1,
                     "dropout_p": 0.5}[bad]
        names.add(bad)
        refused = f"{bad}={opts[bad]!r}"
    T(f"  options {show(opts)}")
    return opts, names, refused


def kv_row(opts, b, B):
    """Sequence b's options: row b of per-sequence sinks/alibi_slopes (B, Hq) and query_lengths (B,)."""
    row = {}
    for name, x in opts.items():
        if name in ("need_weights", "return_lse"):
            continue
        if name in ("sinks", "alibi_slopes", "query_lengths"):
            a = np.asarray(x)
            if a.ndim == (1 if name == "query_lengths" else 2) and a.shape[0] == B:
                x = a[b:b + 1]
        row[name] = x
    return row


def kv_attend(dec, rng, T, cache, rec, lengths, lengths_ok, step):
    import attnx

    B, H = cache.batch, cache.heads
    g = dec.int(1, 3) if dec.chance(3) else 1
    Hq = H * g
    nq = dec.pick((1, 1, 2, 3, 5, 0))
    regime = dec.pick(("normal", "normal", "small", "special", "huge"))
    dt = dec.pick(("float32", "float32", "float16", "float64"))
    q = typed(values(rng, (B, Hq, nq, cache.head_dim), regime), dt)
    names = set()
    if dec.chance(4):
        q = arrange(dec, q, rng)
    if dec.chance(8):
        how = dec.pick(("batch", "heads", "width", "3d", "dtype", "object"))
        if how in ("batch", "heads", "width"):
            shape = [B, Hq, nq, cache.head_dim]
            shape[{"batch": 0, "heads": 1, "width": 3}[how]] += 1
            q = f32(rng.standard_normal(shape))
        elif how == "3d":
            q = np.asarray(q)[0]
        elif how == "dtype":
            q = typed(np.zeros((B, Hq, nq, cache.head_dim)), dec.pick(BAD_DTYPES))
        else:
            q = dec.pick(NON_ARRAYS)
        names |= {"q", "query", "sinks", "alibi_slopes", "query_lengths"}
        T(f"  q: {how}")
    opts, bad, refused = kv_options(dec, rng, cache, Hq, nq, T)
    names |= bad
    if cache.k_center is not None and opts.get("softcap"):   # tanh does not cancel the centre
        names.add("softcap")
        refused = refused or "softcap over centred int8 keys"
    qshape = float_shape(q)
    if qshape is None or len(qshape) != 4 or qshape[0] != B or qshape[3] != cache.head_dim or \
            qshape[1] % H:
        refused = refused or f"q {show(q)}"
        names |= {"q", "query"}
    if not lengths_ok:
        names.add("lengths")
    T(f"step {step}: attend(q={show(q)}, **options) over lengths {lengths.tolist()}")
    snaps = [("q", q, snapshot(q))] + [(n, x, snapshot(x)) for n, x in opts.items()]
    ok, res = attempt(T, "KVCache.attend", lambda: cache.attend(q, **opts), names)
    check_unchanged(snaps, "KVCache.attend")
    if not ok:
        return
    assert lengths_ok, "KVCache.attend: accepted a lengths attribute out of range or kind"
    assert refused is None, f"KVCache.attend: accepted {refused}"
    need_w, want_lse = bool(opts.get("need_weights")), bool(opts.get("return_lse"))
    parts = res if (need_w or want_lse) else (res,)
    assert isinstance(parts, tuple) and len(parts) == 1 + need_w + want_lse, \
        f"KVCache.attend: {len(parts)} results"
    out = parts[0]
    w = parts[1] if need_w else None
    lse = parts[-1] if want_lse else None
    qa = np.asarray(q)
    Hq = qa.shape[1]
    assert out.dtype == np.float32 and out.shape == (B, Hq, nq, cache.value_dim), \
        f"KVCache.attend: out {out.dtype} {out.shape}"
    L = int(lengths.max()) if B else 0
    if w is not None:
        assert w.dtype == np.float32 and w.shape == (B, Hq, nq, L), f"KVCache.attend: weights {w.shape}"
    if lse is not None:
        assert lse.dtype == np.float32 and lse.shape == (B, Hq, nq), f"KVCache.attend: lse {lse.shape}"
    for b in range(B):
        Lb = int(lengths[b])
        kb, vb = rec.rows(b, Lb)
        row = kv_row(opts, b, B)
        if w is not None:
            assert not w[b, ..., Lb:].any(), f"KVCache.attend: weights of sequence {b} past its length"
        if qa.size + kb.size + vb.size > 6000 or not finite_small(qa[b], kb, vb) or not modest(row):
            continue
        STATS[f"{rec.KIND}.attend compared with reference"] += 1
        T(f"  {rec.KIND}.attend compared with reference")
        ref = attnx.reference(qa[b:b + 1], kb, vb, is_causal="lower_right", enable_gqa=True,
                              need_weights=need_w, **row)
        if need_w:
            close(out[b:b + 1], ref[0], f"{rec.KIND}.attend: sequence {b}'s output", None, None)
            close(w[b:b + 1, ..., :Lb], ref[1], f"{rec.KIND}.attend: sequence {b}'s weights",
                  None, None)
        else:
            close(out[b:b + 1], ref, f"{rec.KIND}.attend: sequence {b}'s output", None, None)
        if lse is not None:
            _, l_b = attnx.scaled_dot_product_attention(qa[b:b + 1], kb, vb, is_causal="lower_right",
                                                        enable_gqa=True, return_lse=True, **row)
            close(lse[b:b + 1], l_b, f"{rec.KIND}.attend: sequence {b}'s lse", 1e-5, 1e-5)


# ------------------------------------------------------------------- drivers

MODES = {"backward": mode_backward, "merge": mode_merge, "varlen": mode_varlen,
         "kvcache": mode_kvcache}


def run_one(data: bytes, tolerate_known: bool = False, trace: Trace = None) -> None:
    """Decode ``data`` and make its calls, checking each (see the module docstring).

    With ``tolerate_known``, an exception listed in KNOWN_BUGS passes."""
    import attnx
    from attnx import _attnx

    T = trace if trace is not None else Trace()
    dec = Decoder(data)
    mode = dec.pick(tuple(MODES))
    rng = np.random.default_rng(dec.seed())
    isa_byte, threads = dec.byte(), dec.int(1, 3)
    isas = _attnx.available_isas()
    T(f"mode {mode}, isa {isas[isa_byte % len(isas)]}, {threads} thread(s)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous_isa, previous_threads = _attnx.isa(), attnx.get_num_threads()
        _attnx.set_isa(isas[isa_byte % len(isas)])
        attnx.set_num_threads(threads)
        try:
            MODES[mode](dec, rng, T)
        except Exception as exc:
            if tolerate_known and known_bug(exc):
                STATS["known bug"] += 1
                return
            raise
        finally:
            _attnx.set_isa(previous_isa)
            attnx.set_num_threads(previous_threads)


def describe(data: bytes) -> str:
    """What an input does, call by call, and how it ends (it is run: needs attnx)."""
    T = Trace()
    try:
        run_one(data, trace=T)
        T("outcome: passes")
    except BaseException as exc:       # noqa: B902 (a report, not a handler)
        T(f"outcome: {type(exc).__name__}: {exc}")
    return "\n".join(T.lines)


def main(argv):
    if len(argv) > 1 and argv[1] in ("--replay", "--describe"):
        for path in argv[2:]:
            with open(path, "rb") as f:
                data = f.read()
            print(f"== {path}", flush=True)
            if argv[1] == "--describe":
                T = Trace(echo=True)
                try:
                    run_one(data, trace=T)
                    print("outcome: passes")
                except Exception as exc:
                    import traceback
                    traceback.print_exc(file=sys.stdout)
                    if known_bug(exc):
                        print(f"known bug: {known_bug(exc)}")
            else:
                run_one(data)
                print("ok")
        return
    import atheris
    with atheris.instrument_imports(include=["attnx"]):
        import attnx  # noqa: F401  (instrumented for coverage of the Python side)
    for f in (mode_backward, spoil, spoil_values, reshaped, problem, merge_chunks, merge_arbitrary,
              container, mode_varlen, varlen_packed, spoil_cu, per_seq_value, varlen_int8_pages,
              int8_page_options, int8_fault, int8_scales, int8_rotation_form, mode_kvcache,
              kv_session, kv_append, kv_attend, kv_lengths, kv_options, kv_tokens, kv_int8_pages,
              base.arrange, base.typed):
        atheris.instrument_func(f)
    atheris.Setup(argv, lambda data: run_one(data, tolerate_known=True))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
