"""``python -m attnx bench``: its options (:func:`add_arguments`, called by
attnx/_cli.py) and what it runs (:func:`run`)."""

from __future__ import annotations

import argparse
import sys

from . import runner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats (about a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    p.add_argument("--threads", type=int, default=0, help="threads for every contestant (default: attnx's)")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per contestant (default 7, quick 3)")
    p.add_argument("--plot", metavar="DIR", help="also draw the results as PNG figures into DIR "
                   "(needs matplotlib: attnx[plot])")
    p.add_argument("--from-json", metavar="FILE", help="with --plot: draw from a saved --json "
                   "output instead of running the benchmark")


def run(args: argparse.Namespace) -> int:
    """``python -m attnx bench``: the benchmark, and with ``--plot DIR`` its figures
    (``--from-json FILE``: drawn from a saved ``--json`` output, nothing run)."""
    if args.plot is None:
        runner.run_rows(args)
        return 0
    from . import plot
    from .rows import read_json
    plot.require_matplotlib()          # before minutes of measuring
    rows = read_json(args.from_json) if args.from_json else runner.run_rows(args)
    for path in plot.plot(rows, args.plot):
        print(f"wrote {path}", file=sys.stderr)
    return 0
