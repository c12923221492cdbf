"""Collective bandwidth as nccl-tests reports it (its PERFORMANCE.md): algbw = S / t,
with S each op's "size", and busbw = algbw x factor(ranks), the rate each link runs at,
comparable across ops. Shared by ``--profile`` and ``%dist_bench``."""

from __future__ import annotations

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def size_of(op: str, rank_bytes: int, n: int) -> int:
    """S as nccl-tests counts it: all_gather's whole output (n inputs), the others' input."""
    return rank_bytes * n if op == "all_gather" else rank_bytes


def busbw(op: str, size: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one ``op`` moving ``size`` bytes (S) in ``seconds`` on
    ``n`` ranks."""
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * BUS_FACTOR.get(op, lambda n: 1.0)(n)
