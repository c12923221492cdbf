"""Fixed-width text tables: the rank table, the doctor's table, the text dashboard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_table(
    columns: Sequence[str], rows: Sequence[Mapping[str, Any] | Sequence[Any]]
) -> list[str]:
    """Header and one line per row, columns two spaces apart, no trailing blanks.

    A row is a mapping by column name or a sequence in column order.
    """
    cells = [
        [str(row[c]) for c in columns] if isinstance(row, Mapping) else [str(v) for v in row]
        for row in rows
    ]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return [line(list(columns)), *(line(r) for r in cells)]
