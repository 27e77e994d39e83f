"""What the benchmark measures, row by row: a row is a dict of plain values
(the object ``python -m attnx bench --json`` prints on one line), its
``"kind"`` the measurement that made it (a key of :data:`.runner.KINDS`)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

Row = Dict[str, Any]


class MissingExtra(ImportError):
    """An optional dependency is missing; the message names the extra that installs it
    (the command line prints it as one ``error:`` line)."""


def read_json(path: str) -> List[Row]:
    """The objects of a ``--json`` output, one per non-blank line (ValueError
    naming the line for anything else)."""
    rows: List[Row] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg}); expected the "
                                 f"output of python -m attnx bench --json") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a JSON {type(row).__name__}, not an object")
            rows.append(row)
    return rows


def kind(row: Row) -> str:
    """The row's kind (the measurement that made it); rows saved before
    "kind" was a key are told by their keys."""
    if "kind" in row:
        return str(row["kind"])
    if "roofline_GBps" in row:
        return "decode"
    if "vs_base" in row:
        return "variant"
    return "case"
