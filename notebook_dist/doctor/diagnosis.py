"""A verdict, the rule that gave it, and the table it sits under."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def text(self) -> str:
        from ..table import format_table

        lines = format_table(COLUMNS, self.rows) if self.rows else []
        lines.append(f"Diagnosis: {self.verdict}")
        return "\n".join(lines)
