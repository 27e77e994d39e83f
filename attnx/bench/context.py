"""The settings of one run, and how every row is timed.

Every row times its contestants in one process, interleaved (a, b, c, a, b,
c, ...), and reports medians, so a noisy shared machine slows them alike and
the ratios stay meaningful; see :func:`interleaved` for how thread pools that
spin after a call are kept from slowing each other. All contestants get the
same thread count. Two rooflines are measured in the run itself: the FP32 FMA
peak (:meth:`Context.peak`, the compute roofline) and a plain reduction over
the bytes decoding reads (:func:`read_all`, the bandwidth roofline).
Attention forward is counted as 4·B·H·Lq·Lk·D FLOP (half of it for causal,
whose tiles above the diagonal are skipped; GFLOP/s of causal rows still use
the full count, so a causal row's speed-up is visible as a higher number).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import NDArray

from .rows import Row

F32 = NDArray[np.float32]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved(fns: Sequence[Callable[[], object]], repeats: int,
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


def read_all(k: NDArray[Any], v: NDArray[Any], threads: int,
             extra: Sequence[NDArray[Any]] = ()) -> None:
    """The roofline of decoding: a plain reduction (the maximum, as uint32:
    only the bytes matter, and integer max is the fastest of NumPy's
    reductions) over the bytes of k and v (and ``extra``: an int8 cache's
    scales), split across ``threads`` Python threads (NumPy's reductions
    release the GIL)."""
    import threading

    flat = [a.reshape(-1).view(np.uint8) for a in (k, v, *extra)]
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


def inputs(B: int, Hq: int, Hk: int, Lq: int, Lk: int, D: int, layout: str = "bhld",
           seed: int = 0) -> List[F32]:
    """Random q, k, v of the given shapes (``layout`` "blhd": heads second-last)."""
    rng = np.random.default_rng(seed)
    if layout == "blhd":
        shapes = [(B, Lq, Hq, D), (B, Lk, Hk, D), (B, Lk, Hk, D)]
    else:
        shapes = [(B, Hq, Lq, D), (B, Hk, Lk, D), (B, Hk, Lk, D)]
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def _gflops(peak: Optional[float]) -> str:
    return "none on this CPU" if peak is None else f"{peak:.0f} GFLOP/s"


class Context:
    """The contestants and the settings of one run (``--quick``, ``--threads``,
    ``--repeats``), the FMA peak measured in it, and how a speed row is made."""

    def __init__(self, args: argparse.Namespace) -> None:
        import attnx

        self.attnx = attnx
        self.quick: bool = args.quick
        self.repeats: int = args.repeats or (3 if args.quick else 7)
        self.threads: int = args.threads or attnx.get_num_threads()
        self.torch: Any = None      # imported through importlib: torch is untyped for mypy here
        self.F: Any = None
        # the peaks measured in this run, per unit and thread count (None: not on this CPU)
        self._peaks: Dict[Tuple[str, int], Optional[float]] = {}
        try:
            self.torch = importlib.import_module("torch")
            self.F = importlib.import_module("torch.nn.functional")
        except ImportError:
            pass
        from . import onnx
        self.ort: Any = onnx.load()     # ONNX Runtime, an optional contestant ([onnx] extra)

    def time(self, fns: Sequence[Callable[[], object]], settle: Sequence[int] = ()) -> List[float]:
        """:func:`interleaved` with this run's repeats."""
        return interleaved(fns, self.repeats, settle)

    def peak(self, nt: int, unit: str = "fma") -> Optional[float]:
        """The peak of one of the core's units (``_attnx.PEAK_UNITS``: "fma" the
        FP32 FMAs of attnx's instruction set, "bf16dot" its vdpbf16ps, "amx" its
        tiles) on ``nt`` threads, GFLOP/s, measured by the core in this run (once
        per unit and thread count; best of three runs of 0.1 s), or None where
        the kernels in use lack the unit: the compute rooflines of the rows."""
        if (unit, nt) not in self._peaks:
            from .. import _attnx
            self._peaks[unit, nt] = _attnx.peak(unit, nt, 0.3)
        return self._peaks[unit, nt]

    def fma_peak(self, nt: int) -> float:
        """The FP32 FMA peak on ``nt`` threads (every kernel table has FMAs)."""
        peak = self.peak(nt)
        if peak is None:  # not an assert: it would vanish under python -O
            raise RuntimeError("the core measured no FMA peak: every kernel table has FMAs")
        return peak

    def ceilings(self, nt: int) -> Row:
        """What every row carries: the peaks of the bfloat16 dot products and of
        the tiles on ``nt`` threads (None where this CPU has none)."""
        return {"bf16dot_peak_gflops": self.peak(nt, "bf16dot"),
                "amx_peak_gflops": self.peak(nt, "amx")}

    def ceiling(self, nt: int, dots: bool) -> Tuple[str, float]:
        """A row's own ceiling: the fastest unit its kernels may use (``dots``:
        its call may take bfloat16 dot products, as bfloat16 inputs' scores
        and precision="medium" do where the CPU has them), and its peak."""
        for unit in ("amx", "bf16dot") if dots else ():
            peak = self.peak(nt, unit)
            if peak is not None:
                return unit, peak
        return "fma", self.fma_peak(nt)

    def speed_row(self, name: str, flops: float, times: Dict[str, float], nt: int, *,
                  dense: bool = True, dots: bool = False) -> Row:
        """A speed row: GFLOP/s of attnx and each peer timed (``times``: seconds by
        contestant), ratios to attnx; its share of the FP32 FMA peak (``of_peak``)
        and of its own ceiling (``of_ceiling``, :meth:`ceiling` with ``dots``).
        ``dense=False`` (causal): the GFLOP/s count every score, the work done
        half of them, so the row gets no share of a peak."""
        unit, top = self.ceiling(nt, dots)
        row: Row = {"case": name, "threads": nt, "attnx_s": times["attnx"],
                    "attnx_gflops": flops / times["attnx"] / 1e9, "peak_gflops": self.fma_peak(nt),
                    "ceiling": unit}
        if dense:
            row["of_peak"] = row["attnx_gflops"] / row["peak_gflops"]
            row["of_ceiling"] = row["attnx_gflops"] / top
        for n in ("torch", "onnxruntime", "numpy", "float32", "highest"):
            if n in times:
                row[f"{n}_s"] = times[n]
                row[f"{n}_gflops"] = flops / times[n] / 1e9
                row[f"vs_{n}"] = times[n] / times["attnx"]
        return row

    def header_lines(self) -> List[str]:
        """What the table output prints first: versions, machine, formulas, the peak."""
        attnx, torch = self.attnx, self.torch
        return [
            f"attnx {attnx.__version__}, ISA {attnx.isa()}, {self.threads} thread(s), "
            f"CPU: {cpu_name()}, numpy {np.__version__}"
            + (f", torch {torch.__version__}" if torch else ", torch not installed")
            + (f", onnxruntime {self.ort.__version__}" if self.ort else ""),
            f"GFLOP/s = 4·B·H·Lq·Lk·D (backward 10·, forward+backward 14·) / median time per "
            f"call over {self.repeats} interleaved rounds (each a ~30 ms block of back-to-back calls)",
            f"FP32 FMA peak measured now ({attnx.isa()}, register-only FMA chains): "
            f"{self.fma_peak(self.threads):.0f} GFLOP/s on {self.threads} thread(s); "
            f"'of peak' is attnx's share of the peak for the row's thread count",
            "bfloat16 dot products' peak (vdpbf16ps chains): " + _gflops(
                self.peak(self.threads, "bf16dot")) + "; AMX tiles' peak (TDPBF16PS): "
            + _gflops(self.peak(self.threads, "amx"))]
