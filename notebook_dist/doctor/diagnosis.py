"""A verdict, the rule that gave it, and the table it sits under."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..phrases import COMPACT_FROM, alike, rank_numbers

COLUMNS = ("rank", "state", "op", "shapes", "where", "waiting")


@dataclass
class Diagnosis:
    #: the hang class: conditional, mismatch, shapes, dtypes, raised, dead, busy, uneven,
    #: finished, stalled, python, none; p2p-deadlock, p2p-tag, p2p-peer, p2p-missing;
    #: library; gpu-busy
    kind: str
    verdict: str
    culprits: list[int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    line: int | None = None
    rule: str = ""  # the code of the rule that gave the verdict (ND101, ...)

    def text(self, full: bool = False) -> str:
        """The table and the verdict. From ``phrases.COMPACT_FROM`` ranks, the ranks whose
        rows read the same share one row, unless ``full`` (every rank's row)."""
        from ..table import format_table

        rows = self.rows if full or len(self.rows) < COMPACT_FROM else alike_rows(self.rows)
        lines = format_table(COLUMNS, rows) if rows else []
        lines.append(f"Diagnosis: {self.verdict}")
        return "\n".join(lines)


#: how long a rank has waited, as its row says it
_WAITED = re.compile(r"(\d+(?:\.\d+)?) s")


def alike_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row for the ranks whose rows read the same but for how long each has waited
    (which then reads as a range: '3.4-3.6 s'), in the order of their first rank."""
    return [
        {**same[0], "rank": rank_numbers(r["rank"] for r in same), "waiting": _waited(same)}
        for same in alike(rows, key=_but_the_wait).values()
    ]


def _but_the_wait(row: dict[str, Any]) -> tuple:
    """What a row says, but how long its rank has waited (a reason for waiting stays)."""
    waiting = str(row.get("waiting", ""))
    return tuple(row.get(c, "") for c in COLUMNS[1:-1]) + (
        "" if _WAITED.fullmatch(waiting) else waiting,
    )


def _waited(rows: list[dict[str, Any]]) -> str:
    times = sorted({float(m[1]) for r in rows if (m := _WAITED.fullmatch(str(r["waiting"])))})
    if len(times) < 2:
        return rows[0].get("waiting", "")
    return f"{times[0]:.1f}-{times[-1]:.1f} s"
