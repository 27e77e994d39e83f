"""The rows as ``python -m attnx bench`` prints them: one JSON object a line
(``--json``), or tables: every kind of row under the columns of its own
table (:data:`TABLES`, :data:`KIND_TABLE`), so no row has a cell that does
not apply."""

from __future__ import annotations

import json
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .rows import Row


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
        Column("vs numpy", _key("vs_numpy"), _RATIO), Column("onnxrt", _key("onnxruntime_gflops")),
        Column("vs onnxrt", _key("vs_onnxruntime"), _RATIO))),
    "decode": Table(
        "Decoding (Lq=1) reads K and V: GB/s, against a plain reduction over the same bytes "
        "on as many threads (the roofline)", (
            Column("attnx GB/s", _key("attnx_GBps")), Column("roofline", _key("roofline_GBps")),
            Column("of roof", _key("of_roofline"), "{:7.0%}"),
            Column("vs torch", _key("vs_torch"), _RATIO),
            Column("vs float32 cache", _key("vs_float32_cache"), _RATIO),
            Column("vs bfloat16 cache", _key("vs_bfloat16_cache"), _RATIO),
            Column("vs unrotated int8", _key("vs_unrotated_int8"), _RATIO)), note=False),
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
    "blockmask": Table(
        "Masks that cost what they keep: the bool mask against what does the kept work only "
        "(speed ratios; 'BlockMask': the same mask classified once)", (
            Column("ms", _ms("attnx_s")), Column("base ms", _ms("base_s")),
            Column("vs base", _key("vs_base"), _RATIO),
            Column("BlockMask", _key("blockmask_vs_base"), _RATIO),
            Column("float", _key("float_vs_base"), _RATIO),
            Column("vs flex", _key("vs_flex"), _RATIO)), case_width=50),
    "variant": Table(
        "Variants: each call against the same call without the variant, interleaved", (
            Column("ms", _ms("attnx_s")), Column("without ms", _ms("base_s")),
            Column("time", lambda r: r["attnx_s"] / r["base_s"] if r.get("base_s") else None,
                   _RATIO)), note=False, case_width=54),
}
# the table of each kind of row (a row's "kind" is the measurement that made it)
KIND_TABLE = {"case": "speed", "backward": "speed", "mha_step": "speed", "varlen": "speed",
              "decode": "decode", "memory": "memory", "backward_memory": "memory",
              "mask_backward": "mask", "transformers_decoder": "model",
              "dask_cluster": "dask", "variant": "variant", "block_mask": "blockmask"}


class Printer:
    """Prints rows as they are measured: JSON lines, or a table per kind of row."""

    def __init__(self, json_lines: bool) -> None:
        self.json = json_lines
        self._table: Optional[Table] = None     # the table the last printed row belongs to

    def header(self, lines: Callable[[], List[str]]) -> None:
        """The table output's first lines (nothing with ``--json``: ``lines`` is not called)."""
        if not self.json:
            for line in lines():
                print(line)

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

    def summary(self, rows: List[Row]) -> None:
        """The table output's last line: the rows where attnx was slower than torch."""
        if self.json:
            return
        slower = [r["case"] for r in rows if r.get("vs_torch") is not None and r["vs_torch"] < 1.0]
        print()
        print(f"rows slower than torch: {len(slower)}" + (": " + "; ".join(slower) if slower else ""))
