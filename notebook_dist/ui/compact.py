"""The dashboard for many ranks: ranks grouped by what they are doing, the ones that need a
look first, and a strip with one square per rank; the full table one click away.

A table of 32 rows is a page tall and buries the one stuck rank. Past
``phrases.COMPACT_FROM`` ranks the live view and the record show instead::

    32 ranks · gloo · 41.0 s
    rank 5: running (straggler) · step 40/100
    rank 17: dead
    30 ranks: in collective all_reduce #3 · step 41/100
    [▮▮▮▮▮▯▮▮ ...]                      <- one square per rank, its state's colour
    ▸ every rank (32)                   <- the full table, opened with a click

The groups are a pure function of the dashboard state (:func:`groups`); the widget and the
text form draw the same groups; ``DistConfig.dashboard_full_table`` prints every rank's row
in the text form (``%dist_status`` always does).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..phrases import COMPACT_FROM, alike, rank_list
from .state import DashboardState, RankRow
from .widget_colors import STATE_COLORS
from .words import healed_text, progress_text

#: which states are listed first: what needs a look, then what runs, then what is over
ORDER = (
    "dead",
    "error",
    "hung",
    "in debugger",
    "waiting for input",
    "released",
    "running",
    "in collective",
    "starting",
    "idle",
    "done",
)


@dataclass
class Group:
    """Ranks doing the same thing: their state, collective, and whether they straggle."""

    state: str
    collective: str
    straggler: bool
    ranks: list[int] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    total: float | None = None
    #: the ranks' totals where they differ (uneven data): the steps are said against them
    totals: tuple[float, float] | None = None

    def label(self) -> str:
        what = self.state + (f" {self.collective}" if self.collective else "")
        if self.straggler:
            what += " (straggler)"
        step = ""
        if self.steps:
            low, high = min(self.steps), max(self.steps)
            step = f" · step {progress_text(low, self.total)}"
            if high != low:
                step = f" · steps {low:g}-{progress_text(high, self.total)}"
            if self.totals:
                step = f" · steps {low:g}-{high:g} of {self.totals[0]:g}-{self.totals[1]:g}"
        return f"{rank_list(self.ranks)}: {what}{step}"

    @property
    def needs_a_look(self) -> bool:
        return self.straggler or ORDER.index(self.state) < ORDER.index("running")


def _order(state: str) -> int:
    return ORDER.index(state) if state in ORDER else len(ORDER)


def groups(st: DashboardState) -> list[Group]:
    """The ranks grouped by (state, collective, straggler), most in need of a look first:
    dead, failed, hung and waiting ranks, then stragglers, then the rest by state."""
    rows = [(r, row) for r in st.ranks if (row := st.rows.get(r)) is not None]
    made = []
    for key, same in alike(
        rows, key=lambda rr: (rr[1].state, rr[1].collective, rr[1].straggler)
    ).items():
        stepped = [row for _, row in same if row.step is not None]
        totals = sorted({float(row.total) for row in stepped if row.total})
        made.append(
            Group(
                *key,
                ranks=[r for r, _ in same],
                steps=[float(row.step) for row in stepped],
                total=stepped[-1].total if stepped else None,
                totals=(totals[0], totals[-1]) if len(totals) > 1 else None,
            )
        )
    return sorted(made, key=lambda g: (_order(g.state) if not g.straggler else -1, g.ranks[0]))


def compact(st: DashboardState) -> bool:
    return len(st.ranks) >= COMPACT_FROM


def strip_html(st: DashboardState) -> str:
    """One square per rank, coloured by its state, its progress as the square's fill."""
    cells = []
    for r in st.ranks:
        row = st.rows.get(r) or RankRow(rank=r)
        color = STATE_COLORS.get(row.state, "#757575")
        share = 1.0
        if row.step is not None and row.total:
            share = max(0.1, min(1.0, float(row.step) / float(row.total)))
        tip = f"rank {r}: {row.state}{healed_text(row)}"
        if row.collective:
            tip += f" in {row.collective}"
        if row.step is not None:
            tip += f", step {progress_text(row.step, row.total)}"
        border = "2px solid #e65100" if row.straggler else "1px solid #bbb"
        cells.append(
            f"<span class='nd-cell nd-cell-{r}' data-state='{row.state}' title='{html.escape(tip)}' "
            f"style='display:inline-block;width:10px;height:12px;margin:1px;border:{border};"
            f"background:linear-gradient(to top,{color} {share * 100:.0f}%,#f5f5f5 "
            f"{share * 100:.0f}%)'></span>"
        )
    return f"<div class='nd-strip' style='max-width:640px;line-height:0'>{''.join(cells)}</div>"


def compact_html(st: DashboardState, table: str) -> str:
    """The groups, the strip, and ``table`` (every rank's row) behind a click."""
    lines = []
    for g in groups(st):
        color = STATE_COLORS.get(g.state, "#757575")
        weight = "bold" if g.needs_a_look else "normal"
        lines.append(
            f"<div class='nd-group' data-state='{g.state}' style='font-weight:{weight}'>"
            f"<span style='color:{color}'>●</span> {html.escape(g.label())}</div>"
        )
    return (
        f"<div class='nd-groups' style='font-size:12px'>{''.join(lines)}</div>"
        f"{strip_html(st)}"
        f"<details class='nd-all-ranks' style='font-size:12px'><summary>every rank "
        f"({len(st.ranks)})</summary>{table}</details>"
    )


def compact_text(st: DashboardState) -> list[str]:
    """The groups, a line each (``render_text(state, full=True)`` gives every row)."""
    return [g.label() for g in groups(st)] + [
        "(every rank's row: DistConfig.dashboard_full_table, or %dist_status)"
    ]
