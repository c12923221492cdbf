"""``%dist_bench``: collective bandwidth measured in the notebook, as nccl-tests reports it.

For each op and size: the time of one collective (the slowest rank's, averaged over many
iterations), the algorithm bandwidth ``algbw = S / t`` and the bus bandwidth
``busbw = algbw * factor(n)``, which nccl-tests defines so that every op's figure is the
rate its links run at (all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all
(n-1)/n, broadcast 1). Good for checking a machine or a network from the notebook.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from .bandwidth import busbw
from .errors import UsageMistake
from .phrases import size_text as bytes_text
from .runtime.bench import OPS

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8")
MAX_SIZE = 8 << 30


class BenchError(UsageMistake, ValueError):
    """A %dist_bench request that cannot be measured."""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise BenchError(
            f"--sizes: {text!r} is not a size; give sizes like 1K, 256M or 1G "
            "(K, M, G = 2**10, 2**20, 2**30 bytes)"
        )
    size = int(m.group(1)) * UNITS[m.group(2).upper()]
    if not 1 <= size <= MAX_SIZE:
        raise BenchError(f"--sizes: {text!r} is out of range (1 byte to 8G)")
    return size


def parse_sizes(spec: str) -> list[int]:
    """``1K-256M`` (powers of two from one to the other), ``1M``, or ``4K,1M,64M``."""
    spec = spec.strip()
    if not spec:
        raise BenchError("--sizes is empty: give sizes like 1K-256M")
    if "-" in spec and "," not in spec:
        lo_text, _, hi_text = spec.partition("-")
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo > hi:
            raise BenchError(f"--sizes {spec}: the first size is larger than the last")
        sizes = []
        size = lo
        while size <= hi:
            sizes.append(size)
            size *= 2
        return sizes
    return [parse_size(part) for part in spec.split(",")]


def parse_ops(names: list[str]) -> list[str]:
    ops = list(dict.fromkeys(names)) or list(OPS)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise BenchError(f"unknown collective {unknown[0]!r}: choose from {', '.join(OPS)}")
    return ops


@dataclass
class BenchRow:
    op: str
    bytes: int
    seconds: float
    iters: int
    world_size: int

    @property
    def algbw(self) -> float:  # GB/s
        return busbw(self.op, self.bytes, self.seconds, self.world_size)[0]

    @property
    def busbw(self) -> float:
        return busbw(self.op, self.bytes, self.seconds, self.world_size)[1]


class BenchResult:
    """The table (size, time, algbw, busbw per op) and a plot of busbw against size."""

    def __init__(self, rows: list[BenchRow], backend: str, dtype: str):
        self.rows, self.backend, self.dtype = rows, backend, dtype

    def busbw(self, op: str) -> dict[int, float]:
        return {r.bytes: r.busbw for r in self.rows if r.op == op}

    def text(self) -> str:
        from .table import format_table

        world = self.rows[0].world_size if self.rows else 0
        head = f"%dist_bench: {world} ranks, {self.backend}, {self.dtype}"
        if self.backend == "gloo" and any(r.op == "reduce_scatter" for r in self.rows):
            head += " (Gloo runs reduce_scatter as an all_reduce: its busbw understates the links)"
        rows = [
            {
                "op": r.op,
                "size": bytes_text(r.bytes),
                "time": f"{r.seconds * 1e6:.1f} us",
                "algbw": f"{r.algbw:.3f} GB/s",
                "busbw": f"{r.busbw:.3f} GB/s",
            }
            for r in self.rows
        ]
        return "\n".join([head, *format_table(("op", "size", "time", "algbw", "busbw"), rows)])

    __repr__ = text

    def chart(self):
        from .viz import line_chart

        series = {}
        for r in self.rows:
            series.setdefault(r.op, []).append((r.bytes, r.busbw))
        return line_chart(
            f"bus bandwidth, {self.backend}",
            series,
            xlabel="size (bytes)",
            ylabel="busbw (GB/s)",
            logx=True,
        )

    def _repr_html_(self) -> str:
        lines = self.text().splitlines()
        return (
            f"<div class='nd-bench'><pre style='font-size:12px'>{html.escape(chr(10).join(lines))}</pre>"
            f"{self.chart()._repr_html_()}</div>"
        )


def bench(
    cluster, ops: list[str] | None = None, sizes: str = "1K-16M", dtype: str = "float32"
) -> BenchResult:
    """Time ``ops`` (default: all five) over ``sizes`` on every rank of ``cluster``."""
    from .runtime import bench as rt_bench

    ops = parse_ops(ops or [])
    sizes_b = parse_sizes(sizes)
    if dtype not in DTYPES:
        raise BenchError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    results = cluster.apply(rt_bench.run, ops, sizes_b, dtype, timeout=None)
    rows = [
        BenchRow(r["op"], r["bytes"], r["seconds"], r["iters"], cluster.world_size)
        for r in results[0]
    ]
    return BenchResult(rows, cluster.backend, dtype)
