"""``python -m attnx bench --plot DIR``: the benchmark's rows drawn as PNG figures.

Three figures, each from the rows that carry it (a figure whose rows are
absent is not written):

* ``sweep.png``: GFLOP/s against sequence length (the ``sweep L=.. D=..``
  rows), one line per contestant (attnx, torch, NumPy, where measured) and
  head size; a horizontal line at the machine's FP32 FMA peak when a row (or
  a header object among them) carries a measured ``peak_gflops``. No peak is
  ever assumed.
* ``decode.png``: decoding's bandwidth, attnx's GB/s next to the roofline
  measured beside it (a plain reduction over the same bytes), per cache dtype,
  with and without GQA (the ``decode`` rows).
* ``variants.png``: each variant's speed relative to the same call without
  it (the ``variant`` rows, ``vs_base``).

The rows are those ``python -m attnx bench --json`` prints (one JSON object
a line); ``--from-json FILE`` reads such a file (:func:`.rows.read_json`)
instead of running the bench.
matplotlib (``attnx[plot]``) is imported only here, and only the
object-oriented API is used (no pyplot, no display needed).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from .rows import MissingExtra, Row, kind

__all__ = ["require_matplotlib", "plot", "sweep_figure", "decode_figure", "variants_figure"]

_SWEEP = re.compile(r"^sweep L=(\d+) D=(\d+)$")
_COLORS = {"attnx": "tab:blue", "torch": "tab:orange", "numpy": "tab:green"}
_LABELS = {"attnx": "attnx", "torch": "torch SDPA", "numpy": "NumPy (tutorial code)"}


def require_matplotlib() -> None:
    """Raise :class:`MissingExtra` naming the extra if matplotlib cannot be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MissingExtra('python -m attnx bench --plot needs matplotlib, which is not '
                           'installed: pip install "attnx[plot]" (or pip install matplotlib)'
                           ) from None


def peak_gflops(rows: List[Row]) -> Optional[float]:
    """The FP32 FMA peak a row or header object carries (``peak_gflops``), or None."""
    for row in rows:
        if row.get("peak_gflops"):
            return float(row["peak_gflops"])
    return None


def _threads(rows: List[Row]) -> str:
    ts = sorted({int(r["threads"]) for r in rows if "threads" in r})
    return "/".join(map(str, ts)) + (" thread" if ts == [1] else " threads") if ts else ""


def sweep_figure(rows: List[Row]) -> Any:
    """GFLOP/s against L of the sweep rows (a matplotlib Figure), or None without any."""
    from matplotlib.figure import Figure

    sweep = [(int(m[1]), int(m[2]), r) for r in rows if kind(r) == "case"
             for m in [_SWEEP.match(str(r.get("case", "")))] if m]
    if not sweep:
        return None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    dims = sorted({d for _, d, _ in sweep})
    styles = ["-", "--", ":", "-."]
    for who in ("attnx", "torch", "numpy"):
        for i, d in enumerate(dims):
            pts = sorted((L, r[f"{who}_gflops"]) for L, dd, r in sweep
                         if dd == d and r.get(f"{who}_gflops") is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)],
                        marker="o", color=_COLORS[who], label=f"{_LABELS[who]}, D={d}")
    peak = peak_gflops(rows)
    if peak is not None:
        ax.axhline(peak, color="black", linestyle="--", linewidth=1,
                   label=f"FP32 FMA peak (measured), {peak:.0f} GFLOP/s")
    ax.set_xscale("log", base=2)
    lengths = sorted({L for L, _, _ in sweep})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length L (= Lq = Lk)")
    ax.set_ylabel("GFLOP/s (4·B·H·L²·D / time)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Forward, B=1 H=8, {_threads([r for _, _, r in sweep])}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def decode_figure(rows: List[Row]) -> Any:
    """attnx's decode GB/s beside the roofline, per decode row, or None without any."""
    from matplotlib.figure import Figure

    dec = [r for r in rows if kind(r) == "decode"]
    if not dec:
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = list(range(len(dec)))
    w = 0.38
    bars = ax.bar([i - w / 2 for i in x], [r["attnx_GBps"] for r in dec], w,
                  color=_COLORS["attnx"], label="attnx: K and V read")
    ax.bar([i + w / 2 for i in x], [r["roofline_GBps"] for r in dec], w, color="tab:gray",
           label="roofline: a plain reduction over the same bytes")
    for bar, r in zip(bars, dec):
        ax.annotate(f"{r['attnx_GBps'] / r['roofline_GBps']:.0%}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize="small")
    labels = [str(r["case"]).removeprefix("decode ").replace(" Lk=", "\nLk=")
              .replace(" H=", "\nH=").replace(" GQA", "\nGQA").replace(" D=", "\nD=")
              for r in dec]               # a line a part: eight bars' labels side by side
    ax.set_xticks(x, labels, fontsize="x-small")
    ax.set_ylabel("GB/s")
    ax.set_title(f"Decoding one token (Lq=1), {_threads(dec)}: % = of the roofline")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def variants_figure(rows: List[Row]) -> Any:
    """Each variant's speed relative to the call without it (bars), or None without any."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    var = [r for r in rows if kind(r) == "variant"]
    if not var:
        return None
    fig = Figure(figsize=(9, 0.45 * len(var) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    y = list(range(len(var)))[::-1]
    speed = [float(r["vs_base"]) for r in var]
    # each bar from 1 (as fast as without the variant) to its speed, on a log scale
    bars = ax.barh(y, [s - 1 for s in speed], left=1,
                   color=["tab:green" if s >= 1 else "tab:red" for s in speed])
    for bar, s in zip(bars, speed):
        ax.annotate(f"{s:.2f}x", (s, bar.get_y() + bar.get_height() / 2), va="center",
                    ha="left" if s >= 1 else "right", fontsize="small",
                    xytext=(3 if s >= 1 else -3, 0), textcoords="offset points")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y, [str(r["case"]) for r in var], fontsize="small")
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(speed + [1.0]) / 1.5, max(speed + [1.0]) * 1.5)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("speed against the same call without the variant (> 1: faster)")
    ax.set_title(f"Variants, {_threads(var)}")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


FIGURES = {"sweep.png": sweep_figure, "decode.png": decode_figure,
           "variants.png": variants_figure}


def plot(rows: List[Row], outdir: str) -> List[Path]:
    """Write the figures the rows hold into ``outdir`` (created if needed);
    returns their paths. ValueError if the rows hold none of them."""
    require_matplotlib()
    figs: Dict[str, Any] = {name: make(rows) for name, make in FIGURES.items()}
    if all(f is None for f in figs.values()):
        raise ValueError("no sweep, decode or variant rows to plot (expected the rows of "
                         "python -m attnx bench --json)")
    os.makedirs(outdir, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        if fig is not None:
            path = Path(outdir) / name
            fig.savefig(path, dpi=110)
            paths.append(path)
    return paths
