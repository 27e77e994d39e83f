"""The benchmark run: the cases of :mod:`.cases`, in order, each through its
measurement (:data:`KINDS`), each row printed as it is measured."""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Tuple, Union

from . import blockmask, memory, models, speed
from .cases import SMOKE, Case, cases
from .context import Context
from .report import Printer
from .rows import Row

Measure = Callable[..., Union[Row, List[Row]]]
KINDS: Dict[str, Measure] = {
    "case": speed.case, "decode": speed.decode, "backward": speed.backward,
    "mha_step": speed.mha_step, "variant": speed.variant, "varlen": speed.varlen,
    "memory": memory.memory, "backward_memory": memory.backward_memory,
    "mask_backward": memory.mask_backward,
    "transformers_decoder": models.transformers_decoder, "dask_cluster": models.dask_cluster,
    "block_mask": blockmask.block_mask,
}
"""Each kind of row and the measurement that makes it: a function of the
run's :class:`.context.Context` and the keyword arguments of a :class:`.cases.Case`."""


def measure(ctx: Context, printer: Printer, case: Case) -> List[Row]:
    """Run one case, print its rows and return them; each row's "kind" is the case's,
    and each row carries the compute ceilings of its thread count
    (:meth:`.context.Context.ceilings`)."""
    result = KINDS[case.kind](ctx, **case.params)
    rows = result if isinstance(result, list) else [result]
    for row in rows:
        row["kind"] = case.kind
        for key, value in ctx.ceilings(int(row.get("threads", ctx.threads))).items():
            row.setdefault(key, value)
        printer.emit(row)
    return rows


def _start(args: argparse.Namespace) -> Tuple[Context, Printer]:
    ctx, printer = Context(args), Printer(args.json)
    printer.header(ctx.header_lines)
    return ctx, printer


def smoke(args: argparse.Namespace) -> Row:
    """One tiny row through the benchmark's own machinery (the tests call this)."""
    ctx, printer = _start(args)
    return measure(ctx, printer, SMOKE)[0]


def run_rows(args: argparse.Namespace) -> List[Row]:
    """The whole benchmark (``--quick``: fewer rows and repeats); prints each row
    as it is measured and returns them all."""
    ctx, printer = _start(args)
    rows: List[Row] = []
    for case in cases(ctx.quick, ctx.threads, ctx.torch is not None):
        rows.extend(measure(ctx, printer, case))
    printer.summary(rows)
    return rows
