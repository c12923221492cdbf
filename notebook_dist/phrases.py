"""How the package writes ranks and sizes, in every message: one helper each."""

from __future__ import annotations

from collections.abc import Iterable

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def rank_list(ranks: Iterable[int], one: str = "rank", many: str = "ranks") -> str:
    """'rank 1', 'ranks 0, 2'."""
    ranks = sorted(ranks)
    return f"{one if len(ranks) == 1 else many} {', '.join(map(str, ranks))}"


def _scaled(n: float) -> tuple[float, str]:
    for unit, size in _UNITS:
        if n >= size:
            return n / size, unit
    return n, "B"


def size_text(n: int) -> str:
    """A transfer's size, three significant digits: '514 KiB', '4 MiB', '96 B'."""
    value, unit = _scaled(n)
    return f"{n} B" if unit == "B" else f"{value:.3g} {unit}"


def memory_text(n: int | None) -> str:
    """Memory held, one decimal: '100.0 MiB'; '-' when not known."""
    if not n:
        return "-"
    value, unit = _scaled(n)
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
