"""``python -m attnx bench``: attnx against PyTorch and a tutorial's NumPy code.

Every row times its contestants in one process, interleaved (a, b, c, a, b,
c, ...), and reports medians, so a noisy shared machine slows them alike and
the ratios stay meaningful; see _time for how thread pools that spin after
a call are kept from slowing each other. All contestants get the same
thread count.
Attention forward is counted as 4·B·H·Lq·Lk·D FLOP (half of it for causal,
whose tiles above the diagonal are skipped; GFLOP/s of causal rows still use
the full count, so a causal row's speed-up is visible as a higher number).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import NDArray

Row = Dict[str, Any]


class MissingExtra(ImportError):
    """An optional dependency is missing; the message names the extra that installs it
    (the command line prints it as one ``error:`` line)."""
F32 = NDArray[np.float32]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats (about a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    p.add_argument("--threads", type=int, default=0, help="threads for every contestant (default: attnx's)")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per contestant (default 7, quick 3)")
    p.add_argument("--plot", metavar="DIR", help="also draw the results as PNG figures into DIR "
                   "(needs matplotlib: attnx[plot])")
    p.add_argument("--from-json", metavar="FILE", help="with --plot: draw from a saved --json "
                   "output instead of running the benchmark")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def numpy_attention(Q: F32, K: F32, V: F32) -> Tuple[F32, F32]:
    """The NumPy attention that tutorials teach (it builds every score):
    Q (N, Lq, D), K (N, Lk, D), V (N, Lk, Dv) -> out (N, Lq, Dv), weights (N, Lq, Lk)."""
    d_k = Q.shape[-1]
    scores = Q @ K.transpose(0, 2, 1) / np.sqrt(d_k)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return weights @ V, weights


def numpy_attention_backward(Q: F32, K: F32, V: F32, dO: F32) -> Tuple[F32, F32, F32]:
    """The obvious NumPy backward of numpy_attention (it builds P, dP and dS):
    Q (N, Lq, D), K, V (N, Lk, D), dO (N, Lq, D) -> dQ, dK, dV."""
    scale = 1.0 / np.sqrt(Q.shape[-1])
    s = Q @ K.transpose(0, 2, 1) * scale
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    P = e / e.sum(axis=-1, keepdims=True)
    O = P @ V
    dV = P.transpose(0, 2, 1) @ dO
    dP = dO @ V.transpose(0, 2, 1)
    dS = P * (dP - (dO * O).sum(axis=-1, keepdims=True))
    return (dS @ K) * scale, (dS.transpose(0, 2, 1) @ Q) * scale, dV


def _time(fns: Sequence[Callable[[], object]], repeats: int,
          settle: Sequence[int] = ()) -> List[float]:
    """Median seconds per call of each callable, interleaved by blocks.

    Each round runs every contestant in turn for a block of back-to-back
    calls lasting ~30 ms (one call if a call is longer), then pauses 30 ms
    (0.2 s after an index in ``settle``). Thread pools (attnx's, PyTorch's
    OpenMP, OpenBLAS behind NumPy's matmul) keep spinning for a while after
    a call; without the pause they would slow down whichever contestant runs
    next, and on two cores that decides small cases. The result is the
    median over ``repeats`` rounds of each block's time per call."""
    counts: List[int] = []
    for f in fns:              # warm up for 30 ms (at least twice): the block size
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < 0.03:
            f()
            n += 1
        counts.append(max(1, n - 1))
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, (t, f, n) in enumerate(zip(times, fns, counts)):
            time.sleep(0.2 if (i - 1) % len(fns) in settle else 0.03)
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            t.append((time.perf_counter() - t0) / n)
    return [float(np.median(t)) for t in times]


def read_time(k: NDArray[Any], v: NDArray[Any], threads: int) -> None:
    """The roofline of decoding: a plain reduction (the maximum, as uint32:
    only the bytes matter, and integer max is the fastest of NumPy's
    reductions) over the bytes of k and v, split across ``threads`` Python
    threads (NumPy's reductions release the GIL)."""
    import threading

    flat = [a.reshape(-1).view(np.uint8) for a in (k, v)]
    flat = [a[:a.size // 4 * 4].view(np.uint32) for a in flat]
    chunks = [c for a in flat for c in np.array_split(a, threads)]
    if threads == 1:
        for c in chunks:
            np.maximum.reduce(c)
        return
    ts = [threading.Thread(target=lambda cs: [np.maximum.reduce(c) for c in cs],
                           args=(chunks[i::threads],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def decode_step(torch: Any, model: Any, ids: Any) -> Callable[[], object]:
    """One greedy decoding step of ``model`` after the prompt ``ids`` (1, L): the
    prompt's cache is built once; each call feeds the next token with that
    cache, then crops the cache back to L tokens, so that every call decodes at
    the same context length. (Timing generate() of n tokens minus generate() of
    one instead leaves the prefill's run-to-run noise in the difference, which
    swamps the decoding at a few thousand tokens.)"""
    import inspect
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
    # transformers >= 5.24 names the cache "cache" (and warns at "past_key_values")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, token = first[name], first.logits[:, -1:].argmax(-1)

    def step() -> object:
        with torch.no_grad():
            out = model(input_ids=token, use_cache=True, **{name: cache})
        cache.crop(-1)
        return out
    return step


def _inputs(B: int, Hq: int, Hk: int, Lq: int, Lk: int, D: int, layout: str = "bhld",
            seed: int = 0) -> List[F32]:
    rng = np.random.default_rng(seed)
    if layout == "blhd":
        shapes = [(B, Lq, Hq, D), (B, Lk, Hk, D), (B, Lk, Hk, D)]
    else:
        shapes = [(B, Hq, Lq, D), (B, Hk, Lk, D), (B, Hk, Lk, D)]
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


class Column(NamedTuple):
    """A column of a printed table: its heading, how a row gives its value
    (None: the cell reads "-") and the format of that value."""
    heading: str
    value: Callable[[Row], Optional[float]]
    fmt: str = "{:8.1f}"


def _key(name: str) -> Callable[[Row], Optional[float]]:
    return lambda row: row.get(name)


def _ms(name: str) -> Callable[[Row], Optional[float]]:
    return lambda row: 1e3 * row[name] if row.get(name) is not None else None


class Table(NamedTuple):
    """One printed table: every row of a kind in :data:`KIND_TABLE` is printed
    under the columns of its table, so no row has a cell that does not apply."""
    title: str
    columns: Tuple[Column, ...]
    note: bool = True        # print the row's "note" after the columns
    case_width: int = 44     # the width of the case column (longer names push the row right)

    def header_line(self) -> str:
        return f"{'case':<{self.case_width}}" + "".join(
            f" {c.heading:>{_width(c)}}" for c in self.columns)

    def line(self, row: Row) -> str:
        text = f"{row['case']:<{self.case_width}}"
        for c in self.columns:
            v = c.value(row)
            text += " " + (c.fmt.format(v) if v is not None else "-").rjust(_width(c))
        if self.note and row.get("note"):
            text += "  " + row["note"]
        return text


def _width(c: Column) -> int:
    return max(len(c.heading), len(c.fmt.format(0.0)))


_RATIO = "{:8.2f}x"
TABLES: Dict[str, Table] = {
    "speed": Table("", (
        Column("attnx", _key("attnx_gflops")), Column("of peak", _key("of_peak"), "{:7.0%}"),
        Column("torch", _key("torch_gflops")),
        Column("numpy", _key("numpy_gflops")), Column("vs torch", _key("vs_torch"), _RATIO),
        Column("vs numpy", _key("vs_numpy"), _RATIO))),
    "decode": Table(
        "Decoding (Lq=1) reads K and V: GB/s, against a plain reduction over the same bytes "
        "on as many threads (the roofline)", (
            Column("attnx GB/s", _key("attnx_GBps")), Column("roofline", _key("roofline_GBps")),
            Column("of roof", _key("of_roofline"), "{:7.0%}"),
            Column("vs torch", _key("vs_torch"), _RATIO),
            Column("vs float32 cache", _key("vs_float32_cache"), _RATIO)), note=False),
    "memory": Table(
        "Memory: peak RSS growth during one call, in a fresh process", (
            Column("attnx", _key("attnx_gflops")),
            Column("RSS MiB", _key("peak_rss_growth_MiB"), "{:8.0f}"))),
    "mask": Table(
        "Backward with a float mask against the same mask as bool (time; RSS growth, "
        "each in a fresh process)", (
            Column("attnx", _key("attnx_gflops")),
            Column("time vs bool", _key("float_vs_bool_time"), _RATIO),
            Column("RSS MiB", _key("rss_growth_float_MiB"), "{:8.0f}"),
            Column("bool RSS MiB", _key("rss_growth_bool_MiB"), "{:8.0f}")), note=False,
        case_width=66),
    "model": Table(
        "A whole model's step, attn_implementation attnx, sdpa and eager (ms per call)", (
            Column("attnx ms", _ms("attnx_s")), Column("sdpa ms", _ms("sdpa_s")),
            Column("eager ms", _ms("eager_s")), Column("vs sdpa", _key("vs_torch"), _RATIO)),
        note=False, case_width=56),
    "dask": Table(
        "attnx.dask on a 2-process LocalCluster against one process (causal GFLOP/s count "
        "half the scores)", (
            Column("attnx", _key("attnx_gflops")),
            Column("1 process", _key("one_process_gflops")),
            Column("time vs 1 process",
                   lambda r: r["attnx_s"] / r["one_process_s"] if r.get("one_process_s") else None,
                   _RATIO))),
    "variant": Table(
        "Variants: each call against the same call without the variant, interleaved", (
            Column("ms", _ms("attnx_s")), Column("without ms", _ms("base_s")),
            Column("time", lambda r: r["attnx_s"] / r["base_s"] if r.get("base_s") else None,
                   _RATIO)), note=False, case_width=54),
}
# the table of each kind of row (a row's "kind" is the _Bench method that measured it)
KIND_TABLE = {"case": "speed", "backward": "speed", "mha_step": "speed", "varlen": "speed",
              "decode": "decode", "memory": "memory", "backward_memory": "memory",
              "mask_backward": "mask", "transformers_decoder": "model",
              "dask_cluster": "dask", "variant": "variant"}


class _Bench:
    """The contestants, the settings of one run, and how rows are printed."""

    def __init__(self, args: argparse.Namespace) -> None:
        import attnx

        self.attnx = attnx
        self.quick = args.quick
        self.json = args.json
        self.repeats = args.repeats or (3 if args.quick else 7)
        self.threads = args.threads or attnx.get_num_threads()
        self.torch: Any = None      # imported through importlib: torch is untyped for mypy here
        self.F: Any = None
        self._table: Optional[Table] = None     # the table the last printed row belongs to
        self._peaks: Dict[int, float] = {}      # the FMA peak measured in this run, per thread count
        try:
            self.torch = importlib.import_module("torch")
            self.F = importlib.import_module("torch.nn.functional")
        except ImportError:
            pass

    def emit(self, row: Row) -> None:
        """Print ``row``: a JSON line, or a line of its kind's table (a new table
        starts, with its title and columns, when the kind changes)."""
        if self.json:
            print(json.dumps(row), flush=True)
            return
        table = TABLES[KIND_TABLE[row.get("kind", "case")]]
        if table is not self._table:
            if self._table is not None:
                print()
            if table.title:
                print(table.title)
            print(table.header_line())
            self._table = table
        print(table.line(row), flush=True)

    def header(self) -> None:
        if self.json:
            return
        print(f"attnx {self.attnx.__version__}, ISA {self.attnx.isa()}, {self.threads} thread(s), "
              f"CPU: {cpu_name()}, numpy {np.__version__}"
              + (f", torch {self.torch.__version__}" if self.torch else ", torch not installed"))
        print(f"GFLOP/s = 4·B·H·Lq·Lk·D (backward 10·, forward+backward 14·) / median time per "
              f"call over {self.repeats} interleaved rounds (each a ~30 ms block of back-to-back calls)")
        print(f"FP32 FMA peak measured now ({self.attnx.isa()}, register-only FMA chains): "
              f"{self._peak(self.threads):.0f} GFLOP/s on {self.threads} thread(s); "
              f"'of peak' is attnx's share of the peak for the row's thread count")

    def case(self, name: str, B: int, Hq: int, Hk: int, Lq: int, Lk: int, D: int, *,
             causal: bool = False, mask: Optional[NDArray[Any]] = None, layout: str = "bhld",
             need_weights: bool = False, numpy: bool = False, threads: Optional[int] = None,
             bfloat16: bool = False) -> Row:
        """One row: attnx, torch's SDPA (unless need_weights) and, with ``numpy``,
        the tutorial NumPy code, on the same inputs and threads (``bfloat16``:
        bfloat16 tensors for attnx and torch, and attnx on float32 tensors of
        the same values beside them: the row's vs_float32 is how much faster
        the bfloat16 call is)."""
        attnx, torch, F = self.attnx, self.torch, self.F
        nt = threads or self.threads
        attnx.set_num_threads(nt)
        if torch:
            torch.set_num_threads(nt)
        q, k, v = _inputs(B, Hq, Hk, Lq, Lk, D, layout)
        aq, ak, av = (q, k, v) if not bfloat16 else (torch.from_numpy(x).bfloat16() for x in (q, k, v))
        gqa = Hq != Hk
        lay = "blhd" if layout == "blhd" else "bhld"
        fns: List[Callable[[], object]] = [lambda: attnx.scaled_dot_product_attention(
            aq, ak, av, attn_mask=mask, is_causal=causal, enable_gqa=gqa, layout=lay,
            need_weights=need_weights)]
        names = ["attnx"]
        if bfloat16:
            fq, fk, fv = (torch.from_numpy(x).bfloat16().float() for x in (q, k, v))
            fns.append(lambda: attnx.scaled_dot_product_attention(
                fq, fk, fv, attn_mask=mask, is_causal=causal, enable_gqa=gqa, layout=lay))
            names.append("float32")
        if torch and not need_weights:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            if bfloat16:
                tq, tk, tv = (x.bfloat16() for x in (tq, tk, tv))
            if layout == "blhd":   # torch wants (B, H, L, D): a transposed view, as its users pass it
                tq, tk, tv = (x.transpose(1, 2) for x in (tq, tk, tv))
            tm = torch.from_numpy(mask) if mask is not None else None
            tc = bool(causal) and mask is None
            kw = {"enable_gqa": True} if gqa else {}
            if causal and mask is not None:
                tm = tm & torch.ones(Lq, Lk, dtype=torch.bool).tril()
            fns.append(lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=tc, **kw))
            names.append("torch")
        if numpy:
            q3, k3, v3 = (x.reshape(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v))
            fns.append(lambda: numpy_attention(q3, k3, v3))
            names.append("numpy")
        settle = [names.index("numpy")] if numpy else []
        times = dict(zip(names, _time(fns, self.repeats, settle)))
        row = self._row(name, 4.0 * B * Hq * Lq * Lk * D, times, nt, dense=not causal)
        if bfloat16:
            row["note"] = f"{row['vs_float32']:.2f}x attnx's speed on float32 tensors"
        attnx.set_num_threads(0)
        return row

    def decode(self, Lk: int, Hq: int, Hk: int, D: int) -> List[Row]:
        """Lq = 1 over a cache of Hk heads: bandwidth bound. Per storage dtype
        (float32, float16, bfloat16 when ml_dtypes is installed), the GB/s of K
        and V read against the roofline: a plain reduction over the same bytes
        on as many threads (:func:`read_time`), timed interleaved with it.
        (On AMD EPYC Zen 5, 2 threads, over 512 MiB: NumPy's maximum as uint32
        or float32 67-69 GB/s, float32 add 38, torch's sum 81.)"""
        attnx = self.attnx
        attnx.set_num_threads(self.threads)
        q = _inputs(1, Hq, Hk, 1, Lk, D)[0]
        k32, v32 = _inputs(1, Hk, Hk, Lk, Lk, D, seed=1)[1:]
        dtypes: List[Any] = [np.float32, np.float16]
        try:
            import ml_dtypes
            dtypes.append(ml_dtypes.bfloat16)
        except ImportError:
            pass
        rows: List[Row] = []
        gqa = f" GQA {Hq}/{Hk}" if Hq != Hk else f" H={Hq}"
        for dt in dtypes:
            k, v = k32.astype(dt), v32.astype(dt)
            fns: List[Callable[[], object]] = [
                lambda: attnx.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hk),
                lambda: read_time(k, v, self.threads)]
            if self.torch and dt == np.float32:
                tq, tk, tv = (self.torch.from_numpy(x) for x in (q, k, v))
                self.torch.set_num_threads(self.threads)
                fns.append(lambda: self.F.scaled_dot_product_attention(tq, tk, tv,
                                                                       enable_gqa=Hq != Hk))
            times = _time(fns, self.repeats)
            nbytes = k.nbytes + v.nbytes
            gbs, roof = nbytes / times[0] / 1e9, nbytes / times[1] / 1e9
            name = np.dtype(dt).name
            row: Row = {"case": f"decode {name}{gqa} Lk={Lk} D={D}", "threads": self.threads,
                        "attnx_s": times[0], "attnx_gflops": 4.0 * Hq * Lk * D / times[0] / 1e9,
                        "attnx_GBps": gbs, "roofline_GBps": roof, "of_roofline": gbs / roof,
                        "note": f"reads K+V at {gbs:.1f} GB/s = {gbs / roof:.0%} of a plain "
                                f"reduction's {roof:.1f} GB/s over the same bytes"}
            if len(times) > 2:
                row["torch_gflops"] = 4.0 * Hq * Lk * D / times[2] / 1e9
                row["vs_torch"] = times[2] / times[0]
            if rows:
                row["vs_float32_cache"] = rows[0]["attnx_s"] / times[0]
                row["note"] += f"; {row['vs_float32_cache']:.2f}x the float32 cache's speed"
            rows.append(row)
        attnx.set_num_threads(0)
        return rows

    def _peak(self, nt: int) -> float:
        """The FP32 FMA peak of attnx's instruction set on ``nt`` threads, GFLOP/s,
        measured by the core in this run (once per thread count; best of three
        runs of 0.1 s): the compute roofline of the rows."""
        if nt not in self._peaks:
            from . import _attnx
            self._peaks[nt] = _attnx.fma_peak(nt, 0.3)
        return self._peaks[nt]

    def _row(self, name: str, flops: float, times: Dict[str, float], nt: int, *,
             dense: bool = True) -> Row:
        """A speed row. ``dense=False`` (causal): the GFLOP/s count every score, the
        work done half of them, so the row gets no share of the peak."""
        row: Row = {"case": name, "threads": nt, "attnx_s": times["attnx"],
                    "attnx_gflops": flops / times["attnx"] / 1e9, "peak_gflops": self._peak(nt)}
        if dense:
            row["of_peak"] = row["attnx_gflops"] / row["peak_gflops"]
        for n in ("torch", "numpy", "float32"):
            if n in times:
                row[f"{n}_s"] = times[n]
                row[f"{n}_gflops"] = flops / times[n] / 1e9
                row[f"vs_{n}"] = times[n] / times["attnx"]
        return row

    def backward(self, name: str, B: int, H: int, L: int, D: int, *, causal: bool = False,
                 step: bool = True, numpy: bool = False) -> Row:
        """Gradients: ``step`` times a forward (with lse) + backward against torch's
        forward + backward (14·B·H·L²·D FLOP); otherwise the backward alone
        against torch's backward alone (10·B·H·L²·D), and, with ``numpy``, the
        obvious NumPy backward that materialises P, dP and dS."""
        attnx, torch, F = self.attnx, self.torch, self.F
        attnx.set_num_threads(self.threads)
        q, k, v, dout = _inputs(B, H, H, L, L, D) + _inputs(B, H, H, L, L, D, seed=1)[:1]
        out, lse = attnx.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)

        def a_step() -> object:
            o, vjp = attnx.scaled_dot_product_attention_vjp(q, k, v, is_causal=causal)
            return vjp(dout)

        def a_bwd() -> object:
            return attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                               is_causal=causal)
        fns: List[Callable[[], object]] = [a_step if step else a_bwd]
        names = ["attnx"]
        if torch:
            torch.set_num_threads(self.threads)
            tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
            tdo = torch.from_numpy(dout)
            if step:
                fns.append(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                           .backward(tdo))
            else:
                graph = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                fns.append(lambda: torch.autograd.grad(graph, (tq, tk, tv), tdo, retain_graph=True))
            names.append("torch")
        if numpy:
            fns.append(lambda: numpy_attention_backward(q[0], k[0], v[0], dout[0]))
            names.append("numpy")
        settle = [names.index("numpy")] if numpy else []
        times = dict(zip(names, _time(fns, self.repeats, settle)))
        row = self._row(name, (14.0 if step else 10.0) * B * H * L * L * D, times, self.threads,
                        dense=not causal)
        attnx.set_num_threads(0)
        return row

    def mha_step(self, B: int, L: int, d_model: int, H: int) -> Row:
        """MultiHeadAttention forward + backward against torch.nn.MultiheadAttention's."""
        attnx, torch = self.attnx, self.torch
        attnx.set_num_threads(self.threads)
        mha = attnx.MultiHeadAttention(d_model, H, seed=0)
        x, dout = (np.random.default_rng(s).standard_normal((B, L, d_model), dtype=np.float32)
                   for s in (0, 1))

        def a_step() -> object:
            out, vjp = mha.vjp(x)
            return vjp(dout)
        fns: List[Callable[[], object]] = [a_step]
        names = ["attnx"]
        if torch:
            torch.set_num_threads(self.threads)
            tm = torch.nn.MultiheadAttention(d_model, H, batch_first=True)
            tx = torch.tensor(x, requires_grad=True)
            tdo = torch.from_numpy(dout)
            fns.append(lambda: tm(tx, tx, tx, need_weights=False)[0].backward(tdo))
            names.append("torch")
        times = dict(zip(names, _time(fns, self.repeats)))
        flops = 14.0 * B * L * L * d_model + 2.0 * 3 * 4 * B * L * d_model * d_model
        row = self._row(f"MHA fwd+bwd B={B} L={L} d_model={d_model} H={H}",
                        flops, times, self.threads)
        attnx.set_num_threads(0)
        return row

    @staticmethod
    def _rss_growth(L: int, H: int, D: int, before: str, call: str, sizes: str) -> Tuple[float, float, int]:
        """Run ``before`` then, timed, ``call`` in a fresh process on q, k, v (and
        a dout ``do``), each (1, H, L, D): the peak RSS growth during ``call`` in
        MiB, its seconds, and the bytes of the arrays named by ``sizes``."""
        # The peak is Linux's VmHWM: ru_maxrss survives exec, so a child of a
        # process with torch loaded starts with the parent's peak (~260 MiB)
        # and a smaller call shows no growth at all.
        code = (
            "import resource, time, numpy as np, attnx\n"
            "def hwm():\n"
            "    try:\n"
            "        with open('/proc/self/status') as f:\n"
            "            return next(int(x.split()[1]) for x in f if x.startswith('VmHWM:'))\n"
            "    except (OSError, StopIteration):\n"
            "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"rng = np.random.default_rng(0); L, H, D = {L}, {H}, {D}\n"
            "q, k, v, do = (rng.standard_normal((1, H, L, D), dtype=np.float32) for _ in range(4))\n"
            f"{before}\n"
            "base = hwm()\n"
            "t0 = time.perf_counter()\n"
            f"{call}\n"
            "t = time.perf_counter() - t0\n"
            "peak = hwm()\n"
            f"print(base, peak, t, {sizes})\n")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        base_kib, peak_kib, t, nbytes = res.stdout.split()
        return (int(peak_kib) - int(base_kib)) / 1024, float(t), int(nbytes)

    def variant(self, name: str, L: int, H: int, D: int, base: Dict[str, Any],
                opts: Dict[str, Any], *, grad: bool = False) -> Row:
        """attnx with ``base`` + ``opts`` (a variant) against attnx with ``base``
        alone, interleaved: the forward, or with ``grad`` the backward alone."""
        attnx = self.attnx
        attnx.set_num_threads(self.threads)
        q, k, v, dout = _inputs(1, H, H, L, L, D) + _inputs(1, H, H, L, L, D, seed=1)[:1]
        def call(kw: Dict[str, Any]) -> Callable[[], object]:
            if not grad:
                return lambda: attnx.scaled_dot_product_attention(q, k, v, **kw)
            out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
            return lambda: attnx.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)
        fns = [call({**base, **opts}), call(base)]
        t_var, t_base = _time(fns, self.repeats)
        row: Row = {"case": name, "threads": self.threads, "attnx_s": t_var, "base_s": t_base,
                    "vs_base": t_base / t_var,
                    "note": f"{t_var / t_base:.2f}x the time without it "
                            f"({1e3 * t_var:.1f} ms against {1e3 * t_base:.1f} ms)"}
        attnx.set_num_threads(0)
        return row

    def varlen(self, lengths: Sequence[int], H: int, D: int, *, grad: bool = False) -> Row:
        """A packed batch through attnx.varlen_attention against torch's SDPA on the
        same batch padded, with a padding mask (forward, or forward + backward)."""
        attnx, torch, F = self.attnx, self.torch, self.F
        attnx.set_num_threads(self.threads)
        lens = np.asarray(lengths)
        B, L, total = len(lens), int(lens.max()), int(lens.sum())
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((total, H, D), dtype=np.float32) for _ in range(4))
        cu = np.concatenate([[0], np.cumsum(lens)])

        def a_call() -> object:
            if not grad:
                return attnx.varlen_attention(q, k, v, cu, cu)
            out, vjp = attnx.varlen_attention_vjp(q, k, v, cu, cu)
            return vjp(dout)
        fns: List[Callable[[], object]] = [a_call]
        names = ["attnx"]
        if torch:
            torch.set_num_threads(self.threads)
            pad = [torch.from_numpy(attnx.unpack(x, cu)).transpose(1, 2).contiguous()
                   for x in (q, k, v, dout)]                         # (B, H, L, D), padded
            tq, tk, tv = (x.clone().requires_grad_(grad) for x in pad[:3])
            mask = torch.arange(L)[None, :] < torch.from_numpy(lens)[:, None]
            tm = mask[:, None, None, :]                              # (B, 1, 1, L) keys

            def t_call() -> object:
                out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
                return out.backward(pad[3]) if grad else out
            fns.append(t_call)
            names.append("torch")
        times = dict(zip(names, _time(fns, self.repeats)))
        flops = (14.0 if grad else 4.0) * H * D * float((lens.astype(np.float64) ** 2).sum())
        padding = 1 - total / (B * L)
        row = self._row(f"varlen {B} seqs {lens.min()}..{L}{', fwd+bwd' if grad else ''}, "
                        f"H={H} D={D}", flops, times, self.threads)
        row["note"] = f"torch on the batch padded to {L} ({padding:.0%} padding) with a padding mask"
        attnx.set_num_threads(0)
        return row

    def transformers_decoder(self, L: int, dtype: str = "float32",
                             small: bool = True) -> List[Row]:
        """A Llama-style decoder with random weights, in ``dtype``, with
        attn_implementation "attnx", "sdpa" and "eager": the prefill of L
        tokens, and one decoding step at a context of L tokens
        (:func:`decode_step`). ``small``: 4 layers, d_model 512, 8 query and 2
        key/value heads; else SmolLM-135M's shape (30 layers, hidden 576, 9
        query and 3 key/value heads of 64, vocabulary 49152)."""
        torch = self.torch
        try:
            import transformers
        except ImportError:
            return []
        from .integrations import transformers as hf
        hf.register()
        torch.set_num_threads(self.threads)
        self.attnx.set_num_threads(self.threads)
        shape = (dict(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2) if small else
                 dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      tie_word_embeddings=True))
        config = transformers.LlamaConfig(max_position_embeddings=8192, **shape)
        models = {}
        for impl in ("attnx", "sdpa", "eager"):
            torch.manual_seed(0)
            m: Any = transformers.LlamaForCausalLM(config.__class__(**config.to_dict()))
            m.eval()
            m.set_attn_implementation(impl)
            models[impl] = m.to(getattr(torch, dtype))
        ids = torch.randint(0, shape["vocab_size"], (1, L),
                            generator=torch.Generator().manual_seed(0))

        def prefill(m: Any) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    return m(input_ids=ids)
            return run

        names = list(models)
        t_pre = dict(zip(names, _time([prefill(models[n]) for n in names], self.repeats)))
        steps = [decode_step(torch, models[n], ids) for n in names]
        per_token = dict(zip(names, _time(steps, self.repeats)))
        rows: List[Row] = []
        for what, times in (("prefill", t_pre), ("decode, per token", per_token)):
            kind = "Llama-style decoder" if small else "SmolLM-135M-shaped decoder"
            row: Row = {"case": f"{kind} {dtype} {what}, L={L}", "threads": self.threads,
                        "attnx_s": times["attnx"], "sdpa_s": times["sdpa"],
                        "eager_s": times["eager"], "vs_torch": times["sdpa"] / times["attnx"],
                        "note": f"attnx {1e3 * times['attnx']:.1f} ms, sdpa "
                                f"{1e3 * times['sdpa']:.1f} ms, eager {1e3 * times['eager']:.1f} ms"}
            rows.append(row)
        self.attnx.set_num_threads(0)
        return rows

    def dask_cluster(self, L: int, H: int, D: int, chunk: int) -> List[Row]:
        """Causal attention over (1, H, L, D) on a 2-process dask LocalCluster
        (attnx.dask, chunks of ``chunk`` queries and keys) against one process."""
        try:
            from . import dask as adask
        except ImportError:
            return []
        r = adask.bench(L, H, D, chunk, n_workers=2, repeats=min(self.repeats, 3))
        dask_s, numpy_s = float(r["dask_s"]), float(r["numpy_s"])
        flops = 4.0 * H * L * L * D / 2          # causal: half the scores
        row: Row = {"case": f"dask 2 workers, causal L={L} H={H} D={D}", "threads": self.threads,
                    "attnx_s": dask_s, "attnx_gflops": flops / dask_s / 1e9,
                    "one_process_s": numpy_s, "one_process_gflops": flops / numpy_s / 1e9,
                    "note": f"{dask_s:.2f} s vs one process {numpy_s:.2f} s "
                            f"({dask_s / numpy_s:.2f}x the time); {r['case']}"}
        self.attnx.set_num_threads(0)
        return [row]

    def backward_memory(self, L: int, H: int, D: int) -> Row:
        """Peak RSS growth of one long-sequence backward, in a fresh process."""
        extra, t, grads = self._rss_growth(
            L, H, D, "out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True)",
            "g = attnx.scaled_dot_product_attention_backward(do, q, k, v, out, lse)", "q.nbytes * 3")
        row: Row = {"case": f"long backward L={L} H={H} D={D}", "threads": self.threads,
                    "attnx_s": t, "attnx_gflops": 10.0 * H * L * L * D / t / 1e9,
                    "peak_rss_growth_MiB": extra,
                    "note": f"RSS grew {extra:.0f} MiB during the call (the gradients are "
                            f"{grads / 2**20:.0f} MiB)"}
        return row

    def mask_backward(self, L: int, H: int, D: int, mshape: Tuple[int, ...]) -> Row:
        """The backward with a float mask of shape ``mshape`` (its gradient summed
        to that shape inside the backward) against the same call with the mask
        as bool: time (in this process, interleaved) and peak RSS growth (each
        in a fresh process)."""
        attnx = self.attnx
        attnx.set_num_threads(self.threads)
        q, k, v, dout = _inputs(1, H, H, L, L, D) + _inputs(1, H, H, L, L, D, seed=1)[:1]
        keep = np.random.default_rng(2).random(mshape) > 0.1
        masks = {"bool": keep, "float": np.where(keep, 0.0, -np.inf).astype(np.float32)}
        fns = []
        for m in masks.values():
            out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
            fns.append(lambda m=m, out=out, lse=lse: attnx.scaled_dot_product_attention_backward(
                dout, q, k, v, out, lse, attn_mask=m))
        t_bool, t_float = _time(fns, self.repeats)
        rss = {}
        for kind in masks:
            # the mask made in place: a temporary would raise the peak before the call
            make = (f"m = np.{'ones' if kind == 'bool' else 'zeros'}({mshape}, "
                    f"{'bool' if kind == 'bool' else 'np.float32'})\n"
                    f"m[..., ::10] = {'False' if kind == 'bool' else '-np.inf'}")
            rss[kind], _, _ = self._rss_growth(
                L, H, D, make + "\nout, lse = attnx.scaled_dot_product_attention(q, k, v, "
                "attn_mask=m, return_lse=True)",
                "g = attnx.scaled_dot_product_attention_backward(do, q, k, v, out, lse, attn_mask=m)",
                "0")
        mask_mib = masks["float"].nbytes / 2**20
        row: Row = {"case": f"backward, float mask {mshape} vs bool, L={L} H={H} D={D}",
                    "threads": self.threads, "attnx_s": t_float,
                    "attnx_gflops": 10.0 * H * L * L * D / t_float / 1e9,
                    "float_vs_bool_time": t_float / t_bool,
                    "rss_growth_float_MiB": rss["float"], "rss_growth_bool_MiB": rss["bool"],
                    "note": f"{t_float / t_bool:.2f}x the bool mask's time; RSS grew "
                            f"{rss['float']:.0f} MiB (bool {rss['bool']:.0f}, the mask "
                            f"{mask_mib:.1f} MiB; target: bool + mask + 8 MiB)"}
        attnx.set_num_threads(0)
        return row

    def memory(self, L: int, H: int, D: int) -> Row:
        """Peak RSS of one long-sequence call, in a fresh process."""
        extra, t, data = self._rss_growth(
            L, H, D, "pass", "out = attnx.scaled_dot_product_attention(q, k, v)",
            "out.nbytes")
        row: Row = {"case": f"long L={L} H={H} D={D}", "threads": self.threads, "attnx_s": t,
                    "attnx_gflops": 4.0 * H * L * L * D / t / 1e9, "peak_rss_growth_MiB": extra,
                    "note": f"RSS grew {extra:.0f} MiB during the call, which allocates the "
                            f"{data / 2**20:.0f} MiB output (the inputs were allocated before)"}
        return row


Case = Tuple[str, Dict[str, Any]]
"""A row (or rows) of the benchmark: the _Bench method that measures it, and
its keyword arguments."""


def _forward_cases(quick: bool, nt: int) -> List[Case]:
    """The forward at B=1 H=8 L=1024 D=64 with its peers, then decoding."""
    base = dict(B=1, Hq=8, Hk=8, Lq=1024, Lk=1024, D=64)
    return [
        ("case", dict(name=f"B=1 H=8 L=1024 D=64, {nt} threads", **base, numpy=True)),
        *([("case", dict(name="B=1 H=8 L=1024 D=64, 1 thread", **base, threads=1))]
          if nt > 1 else []),
        ("case", dict(name="  same, causal", **base, causal=True)),
        ("case", dict(name="  same, need_weights", **base, need_weights=True, numpy=True)),
        ("decode", dict(Lk=8192, Hq=32, Hk=32, D=128)),
        ("decode", dict(Lk=32768, Hq=32, Hk=8, D=128)),     # GQA: the same bytes of cache
        *([("memory", dict(L=16384, H=8, D=64))] if not quick else []),
    ]


def _training_cases(quick: bool, nt: int, torch: bool) -> List[Case]:
    """Gradients, the layer, whole models, memory, dask."""
    base = dict(B=1, H=8, L=1024, D=64)
    Lm = 1024 if quick else 3072
    return [
        ("backward", dict(name=f"fwd+bwd B=1 H=8 L=1024 D=64, {nt} threads", **base)),
        ("backward", dict(name="  same, backward only", **base, step=False, numpy=True)),
        ("backward", dict(name="  same, causal backward only", **base, step=False, causal=True)),
        ("mha_step", dict(B=8, L=256, d_model=512, H=8)),
        *[("transformers_decoder", dict(L=256 if quick else 1024, dtype=dtype, small=quick))
          for dtype in ("float32", "bfloat16") if torch],
        *([("backward_memory", dict(L=16384, H=8, D=64))] if not quick else []),
        *[("mask_backward", dict(L=Lm, H=8, D=64, mshape=mshape))
          for mshape in ((1, 1, 1, Lm), (1, 1, Lm, Lm))],
        ("dask_cluster", dict(L=8192, H=8, D=64, chunk=2048) if quick else
         dict(L=65536, H=8, D=64, chunk=8192)),
    ]


def _variant_cases(quick: bool) -> List[Case]:
    """The variants, each against the same call without it; then packed batches."""
    sinks, slopes = np.linspace(-1, 1, 8, dtype=np.float32), 2.0 ** -np.arange(1, 9, dtype=np.float32)
    spread = np.linspace(64, 2048, 16).astype(int)    # ~48% padding when padded to 2048
    Lw, w = (4096, 256) if quick else (16384, 1024)
    return [
        *[("variant", dict(name=f"{what}{', causal' if causal else ''} L=1024 H=8 D=64", L=1024,
                           H=8, D=64, base={"is_causal": causal}, opts=opts))
          for what, opts in (("sinks", {"sinks": sinks}), ("softcap 30", {"softcap": 30.0}),
                             ("ALiBi", {"alibi_slopes": slopes}))
          for causal in (False, True)],
        *[("variant", dict(name=f"window ({w}, 0) vs causal, L={Lw} H=8 D=64"
                                f"{', backward' if grad else ''}", L=Lw, H=8, D=64,
                           base={"is_causal": True}, opts={"window": (w, 0)}, grad=grad))
          for grad in (False, True)],
        *[("varlen", dict(lengths=(spread if not quick else spread // 4).tolist(), H=8, D=64,
                          grad=grad)) for grad in (False, True)],
    ]


def _sweep_cases(quick: bool, torch: bool) -> List[Case]:
    """The forward over sequence lengths and head sizes, then masks, GQA, layouts, dtypes."""
    lengths = [16, 128, 1024] if quick else [16, 64, 256, 1024, 4096]
    dims = [64] if quick else [32, 64, 128]
    L, D = (256, 64) if quick else (1024, 64)
    bool_mask = np.random.default_rng(1).random((1, 1, L, L)) > 0.2
    float_mask = np.where(bool_mask, 0.0, -np.inf).astype(np.float32)
    pad = np.ones((2, 1, 1, L), dtype=bool)
    pad[1, ..., L * 3 // 4:] = False
    one, two = dict(B=1, Hq=8, Hk=8, Lq=L, Lk=L, D=D), dict(B=2, Hq=8, Hk=8, Lq=L, Lk=L, D=D)
    return [
        *[("case", dict(name=f"sweep L={n} D={d}", B=1, Hq=8, Hk=8, Lq=n, Lk=n, D=d))
          for n in lengths for d in dims],
        ("case", dict(name=f"sweep L={L} D={D} bool mask (1,1,L,L)", **one, mask=bool_mask)),
        ("case", dict(name=f"sweep L={L} D={D} float mask (1,1,L,L)", **one, mask=float_mask)),
        ("case", dict(name=f"sweep L={L} D={D} B=2 padding mask (B,1,1,L)", **two, mask=pad)),
        ("case", dict(name=f"sweep L={L} D={D} causal + padding", **two, mask=pad, causal=True)),
        ("case", dict(name=f"sweep L={L} D={D} GQA Hq=8 Hk=2", **{**one, "Hk": 2})),
        ("case", dict(name=f"sweep L={L} D={D} layout blhd", **one, layout="blhd")),
        *([("case", dict(name=f"sweep L={L} D={D} bfloat16 (torch bfloat16)", **one,
                         bfloat16=True))] if torch else []),
    ]


def cases(quick: bool, threads: int, torch: bool) -> List[Case]:
    """Every case of the benchmark, in the order they run (``quick``: fewer and
    smaller; ``torch``: whether torch is installed, for the rows that need it)."""
    return (_forward_cases(quick, threads) + _training_cases(quick, threads, torch)
            + _variant_cases(quick) + _sweep_cases(quick, torch))


def measure(b: _Bench, case: Case) -> List[Row]:
    """Run one case (the method of ``b`` it names), print its rows and return them;
    each row's "kind" is the method's name."""
    kind, params = case
    result: Union[Row, List[Row]] = getattr(b, kind)(**params)
    rows = result if isinstance(result, list) else [result]
    for row in rows:
        row["kind"] = kind
        b.emit(row)
    return rows


def smoke(args: argparse.Namespace) -> Row:
    """One tiny row through the benchmark's own machinery (the tests call this)."""
    b = _Bench(args)
    b.header()
    return measure(b, ("case", dict(name="smoke B=1 H=2 L=32 D=16", B=1, Hq=2, Hk=2, Lq=32,
                                    Lk=32, D=16, numpy=True)))[0]


def run_rows(args: argparse.Namespace) -> List[Row]:
    """The whole benchmark (``--quick``: fewer rows and repeats); prints each row
    as it is measured and returns them all."""
    b = _Bench(args)
    b.header()
    rows: List[Row] = []
    for case in cases(b.quick, b.threads, b.torch is not None):
        rows.extend(measure(b, case))
    slower = [r["case"] for r in rows if r.get("vs_torch") is not None and r["vs_torch"] < 1.0]
    if not b.json:
        print()
        print(f"rows slower than torch: {len(slower)}" + (": " + "; ".join(slower) if slower else ""))
    return rows


def run(args: argparse.Namespace) -> int:
    """``python -m attnx bench``: the benchmark, and with ``--plot DIR`` its figures
    (``--from-json FILE``: drawn from a saved ``--json`` output, nothing run)."""
    if args.plot is None:
        run_rows(args)
        return 0
    from . import _bench_plot
    _bench_plot.require_matplotlib()          # before minutes of measuring
    rows = _bench_plot.read_json(args.from_json) if args.from_json else run_rows(args)
    for path in _bench_plot.plot(rows, args.plot):
        print(f"wrote {path}", file=sys.stderr)
    return 0
