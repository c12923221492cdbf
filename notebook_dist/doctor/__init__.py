"""The hang and fault doctor: per-rank snapshots in, a table and a plain verdict out.

A pure function (:func:`diagnose`) of what each rank reported: its state, the collective
or point-to-point op it is in (sequence number per process group, op, peer and tag,
shapes, dtypes, the cell line that issued it), the collectives it completed in this
cell, what torch has in flight itself (Flight Recorder), and its Python stack. The
verdict comes from the first of a list of small rules (:mod:`.rules`) that explains what
the ranks show; the table rows are drawn from the same facts (:mod:`.facts`, over
:mod:`.waits`, :mod:`.stacks`, :mod:`.source` and :mod:`.words`).
"""

from __future__ import annotations

from .diagnosis import Diagnosis
from .facts import Facts, RankReport
from .rules import RULES
from .source import rank_condition
from .stacks import format_stacks

__all__ = ["Diagnosis", "RULES", "RankReport", "diagnose", "format_stacks", "rank_condition"]


def diagnose(
    ranks: dict[int, RankReport],
    *,
    now: float,
    cell_file: str | None = None,
    source: str | None = None,
    first_line: int = 2,
    healable: bool = True,
) -> Diagnosis:
    """``ranks``: rank -> its :class:`RankReport` (status, agent snapshot, how it ended).
    ``healable``: the cluster can put a fresh rank in a dead one's place (``%dist_heal``:
    engines this notebook started on this machine)."""
    facts = Facts(ranks, now, cell_file, source, first_line, healable)
    for rule in RULES:
        verdict = rule.check(facts)
        if verdict is not None:
            verdict.rule = rule.code
            return verdict
    return Diagnosis("none", "Nothing is stuck.", [], facts.rows(), None, "ND000")
