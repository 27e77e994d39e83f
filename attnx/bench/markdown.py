"""The docs' benchmark tables, generated from saved ``python -m attnx bench --json``
output, so that every figure they show is one of a committed file.

A page marks each generated block with two HTML comments (invisible once
rendered, by GitHub and by Sphinx)::

    <!-- bench: bench/zen5.json speed decode -->
    ... written by this module ...
    <!-- /bench -->

naming a saved ``--json`` output, relative to the page, and what to show of
it: names of :data:`BLOCKS`, in order. The ``about`` block reads the file's sidecar,
``<name>.about.json``: which machine, when, which versions (written once,
right after the run, by ``--about``)::

    python -m attnx bench --json > docs/bench/zen3.json
    python -m attnx.bench.markdown --about "AMD EPYC (Zen 3) VM, 2 vCPUs" > docs/bench/zen3.about.json
    python -m attnx.bench.markdown README.md docs/performance.md     # rewrites the blocks

``--check`` changes nothing and exits 1 if a page is not what its files give
(tests/test_bench_docs.py checks the same).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .rows import Row, kind, read_json

MARK = re.compile(r"(<!-- bench: (\S+) (\w+(?: \w+)*) -->\n)(.*?)(<!-- /bench -->)", re.S)
_SWEEP = re.compile(r"^sweep L=(\d+) D=(\d+)$")


def _g(v: Optional[float]) -> str:
    """GFLOP/s or GB/s: three figures at most (445, 38.5, 6.5)."""
    return "" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _x(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.2f}×"


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.0%}"


def _ms(v: Optional[float]) -> str:
    return "" if v is None else f"{1e3 * v:.1f}"


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def _label(row: Row) -> str:
    return str(row["case"]).strip()


def _peaks(rows: List[Row]) -> Dict[int, float]:
    return {int(r["threads"]): float(r["peak_gflops"]) for r in rows if r.get("peak_gflops")}


def _speed_rows(rows: List[Row]) -> List[Row]:
    """The speed rows, but for the sweep's grid of lengths and head sizes."""
    return [r for r in rows if kind(r) in ("case", "backward", "mha_step", "varlen")
            and not _SWEEP.match(str(r["case"]))]


def speed(rows: List[Row], about: Dict[str, Any]) -> str:
    """GFLOP/s of attnx, its share of the peak, torch, ONNX Runtime (where the run
    had it) and NumPy, each speed row."""
    speed_rows = _speed_rows(rows)
    ort = any("onnxruntime_gflops" in r for r in speed_rows)    # a run with ONNX Runtime
    body = [[_label(r), _g(r.get("attnx_gflops")), _pct(r.get("of_peak")), _g(r.get("torch_gflops")),
             _x(r.get("vs_torch"))]
            + ([_g(r.get("onnxruntime_gflops")), _x(r.get("vs_onnxruntime"))] if ort else [])
            + [_g(r.get("numpy_gflops")), _x(r.get("vs_numpy"))]
            for r in speed_rows]
    return _table(["row", "attnx GFLOP/s", "of the peak", "torch SDPA", "attnx vs torch"]
                  + (["ONNX Runtime", "attnx vs ONNX Runtime"] if ort else [])
                  + ["NumPy", "attnx vs NumPy"], body)


def sweep(rows: List[Row], about: Dict[str, Any]) -> str:
    """The forward over L (rows) and D (columns): attnx's GFLOP/s, share of the peak
    and speed against torch's SDPA."""
    grid = {(int(m[1]), int(m[2])): r for r in rows for m in [_SWEEP.match(str(r["case"]))] if m}
    lengths, dims = sorted({L for L, _ in grid}), sorted({D for _, D in grid})

    def cell(r: Optional[Row]) -> str:
        if r is None:
            return ""
        return (f"{_g(r['attnx_gflops'])} ({_pct(r.get('of_peak'))})"
                + (f", {_x(r['vs_torch'])}" if r.get("vs_torch") else ""))
    body = [[f"L={L}"] + [cell(grid.get((L, D))) for D in dims] for L in lengths]
    return _table(["B=1 H=8"] + [f"D={D}" for D in dims], body)


def decode(rows: List[Row], about: Dict[str, Any]) -> str:
    """Decoding's GB/s against the read roofline measured beside it."""
    body = [[_label(r).removeprefix("decode "), _g(r["attnx_GBps"]), _g(r["roofline_GBps"]),
             _pct(r["of_roofline"]), _x(r.get("vs_torch")), _x(r.get("vs_float32_cache")),
             _x(r.get("vs_bfloat16_cache"))]
            for r in rows if kind(r) == "decode"]
    return _table(["decoding one token, cache", "attnx GB/s", "roofline GB/s", "of the roofline",
                   "attnx vs torch", "vs a float32 cache", "vs a bfloat16 cache"], body)


def variants(rows: List[Row], about: Dict[str, Any]) -> str:
    """Each variant's time against the same call without it."""
    body = [[_label(r), _ms(r["attnx_s"]), _ms(r["base_s"]), _x(r["attnx_s"] / r["base_s"])]
            for r in rows if kind(r) == "variant"]
    return _table(["variant", "ms", "ms without it", "time against without"], body)


def models(rows: List[Row], about: Dict[str, Any]) -> str:
    """Whole models (transformers) and attnx.dask."""
    body = [[_label(r), _ms(r["attnx_s"]), _ms(r["sdpa_s"]), _ms(r["eager_s"]),
             _x(r["vs_torch"])] for r in rows if kind(r) == "transformers_decoder"]
    text = _table(["model step (ms)", "attnx", "sdpa", "eager", "attnx vs sdpa"], body) if body else ""
    for r in rows:
        if kind(r) == "dask_cluster":
            text += (f"\n{_label(r)}: {r['attnx_s']:.2f} s on the cluster against "
                     f"{r['one_process_s']:.2f} s in one process.\n")
    return text


def memory(rows: List[Row], about: Dict[str, Any]) -> str:
    """Peak RSS growth of one call, each in a fresh process."""
    body = [[_label(r), f"{r['peak_rss_growth_MiB']:.0f} MiB", ""]
            for r in rows if kind(r) in ("memory", "backward_memory")]
    body += [[_label(r), f"{r['rss_growth_float_MiB']:.0f} MiB (bool: "
              f"{r['rss_growth_bool_MiB']:.0f} MiB)", _x(r["float_vs_bool_time"])]
             for r in rows if kind(r) == "mask_backward"]
    return _table(["call", "peak RSS growth", "time against a bool mask"], body)


def about_text(rows: List[Row], about: Dict[str, Any]) -> str:
    """One paragraph: the machine, the command, the date, the versions, the peak."""
    if not about:
        raise ValueError("an about block needs the rows' sidecar <name>.about.json "
                         "(python -m attnx.bench.markdown --about MACHINE writes one)")
    quick = not any(kind(r) == "memory" for r in rows)
    peaks = _peaks(rows)
    threads = sorted({int(r["threads"]) for r in rows if "threads" in r})
    most = max(threads) if threads else 0
    versions = ", ".join(f"{n} {about[n]}" for n in ("attnx", "numpy", "torch") if about.get(n))
    peak = (f"{peaks[most]:.0f} GFLOP/s on {most} threads" if most in peaks else "")
    if peak and 1 in peaks and most != 1:
        peak += f", {peaks[1]:.0f} on one"
    commit = f" at {about['commit']}" if about.get("commit") else ""
    return (f"{about['machine']} (`/proc/cpuinfo`: {about['cpu']}; attnx's ISA "
            f"{about['isa']}): `python -m attnx bench{' --quick' if quick else ''} --json` "
            f"on {about['date']}{commit}, {versions}, {most} threads unless a row says "
            f"otherwise, {len(rows)} rows. The FP32 FMA peak it measured: {peak}."
            + (f" {about['note']}" if about.get("note") else "") + "\n")


def summary(rows: List[Row], about: Dict[str, Any]) -> str:
    """README's table: the main rows, each contestant's GFLOP/s and share of the peak."""
    by_case = {str(r["case"]).strip(): r for r in rows}
    peaks = _peaks(rows)
    picks = [("forward, L=1024 D=64", "B=1 H=8 L=1024 D=64, 2 threads"),
             ("backward, L=1024 D=64", "same, backward only"),
             ("forward + backward, L=1024 D=64", "fwd+bwd B=1 H=8 L=1024 D=64, 2 threads"),
             ("forward, L=4096 D=128", "sweep L=4096 D=128"),
             ("forward, L=1024 D=64, bfloat16", "sweep L=1024 D=64 bfloat16 (torch bfloat16)")]

    def cell(r: Row, who: str) -> str:
        v = r.get(f"{who}_gflops")
        if v is None:
            return ""
        peak = peaks.get(int(r["threads"]))
        return _g(v) + (f" ({v / peak:.0%})" if peak else "")
    # precision="medium" beside a row, where the run timed it
    medium = any(f"{case}, precision='medium'" in by_case for _, case in picks)
    body = [[label, cell(r, "attnx")]
            + ([cell(by_case.get(f"{case}, precision='medium'", {}), "attnx")] if medium else [])
            + [cell(r, "torch"), cell(r, "numpy")]
            for label, case in picks for r in [by_case.get(case)] if r is not None]
    most = max(peaks) if peaks else 0
    caption = (f"\n{about['machine']}, {most} threads, `python -m attnx bench --json` on "
               f"{about['date']}: GFLOP/s (4·B·H·L²·D a forward, 10· a backward) and, in "
               f"brackets, the share of the FP32 FMA peak measured in the same run "
               f"({peaks.get(most, 0):.0f} GFLOP/s).\n" if about else "")
    return _table(["B=1 H=8, GFLOP/s (of the peak)", "attnx"]
                  + (["attnx, precision='medium'"] if medium else [])
                  + ["torch SDPA", "NumPy (tutorial code)"], body) + caption


BLOCKS: Dict[str, Callable[[List[Row], Dict[str, Any]], str]] = {
    "about": about_text, "speed": speed, "sweep": sweep, "decode": decode,
    "variants": variants, "models": models, "memory": memory, "summary": summary}
"""What a marked block can show, by name."""


def about_path(rows_path: Path) -> Path:
    return rows_path.with_name(rows_path.stem + ".about.json")


def render(text: str, base: Path) -> str:
    """``text`` (a page) with every marked block written from the files it names
    (relative to ``base``, the page's directory)."""
    cache: Dict[Path, Tuple[List[Row], Dict[str, Any]]] = {}

    def block(m: "re.Match[str]") -> str:
        path, names = base / m[2], m[3].split()
        unknown = [n for n in names if n not in BLOCKS]
        if unknown:
            raise ValueError(f"unknown bench block {unknown[0]!r} (known: {', '.join(BLOCKS)})")
        if path not in cache:
            about = about_path(path)
            cache[path] = (read_json(str(path)),
                           json.loads(about.read_text(encoding="utf-8")) if about.exists() else {})
        parts = [BLOCKS[n](*cache[path]).strip("\n") for n in names]
        return m[1] + "\n" + "\n\n".join(p for p in parts if p) + "\n\n" + m[5]
    return MARK.sub(block, text)


def about_now(machine: str) -> Dict[str, Any]:
    """The sidecar of a run made here, now: the machine as described, its CPU's
    name, attnx's ISA, today's date, the versions, the git commit if any."""
    import numpy

    import attnx
    from .context import cpu_name
    about: Dict[str, Any] = {"machine": machine, "cpu": cpu_name(), "isa": attnx.isa(),
                             "date": datetime.date.today().isoformat(),
                             "attnx": attnx.__version__, "numpy": numpy.__version__}
    try:
        import torch
        about["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        about["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True,
                                         capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return about


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnx.bench.markdown",
                                description="Rewrite the bench blocks of Markdown pages from "
                                            "the saved --json output they name.")
    p.add_argument("pages", nargs="*", help="Markdown pages (README.md docs/performance.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs")
    p.add_argument("--about", metavar="MACHINE", help="print the sidecar of a run made here now "
                   "(MACHINE: how the page names the machine) and exit")
    args = p.parse_args(argv)
    if args.about:
        print(json.dumps(about_now(args.about), indent=1))
        return 0
    stale = []
    for page in map(Path, args.pages):
        text = page.read_text(encoding="utf-8")
        new = render(text, page.parent)
        if new != text:
            stale.append(str(page))
            if not args.check:
                page.write_text(new, encoding="utf-8")
    verb = "differ from their bench files" if args.check else "rewritten"
    if stale:
        print(f"{verb}: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
