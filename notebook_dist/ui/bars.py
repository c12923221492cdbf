"""The ranks' progress bars (tqdm's widget and text bars) as one bar for the ranks whose
bars share a description, from ``phrases.COMPACT_FROM`` ranks: ``[ranks 0-31] train`` and
how far the slowest rank is, where 32 widget bars were a page, and 32 text bars 32 lines
that never fold (each its own rate and time). The ranks' bars show nothing then
(``runtime/bars.py``). Fed by the agents' snapshots (twice a second) and each rank's final
one; drawn as a widget in a notebook, and as a line a group at the cell's end elsewhere.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from ..phrases import COMPACT_FROM, alike, rank_list

#: how often, at most, the bars look at the ranks' snapshots as the cell runs (seconds)
LOOK_S = 0.2
#: up to how many different counts a group's bar names with their ranks
_KINDS_NAMED = 3


def grouping(ranks: int, raw_output: bool, fold_from: int) -> bool:
    """Whether a cell on ``ranks`` ranks shows its ranks' alike bars as one: from
    ``COMPACT_FROM`` ranks, when its lines fold too (not ``--raw-output``)."""
    return ranks >= COMPACT_FROM and not raw_output and 0 < fold_from <= ranks


@dataclass
class BarGroup:
    """The ranks whose bar (the same one of each rank's, by its place and description)
    is shown as one: their counts, totals and states ('danger', 'success', '')."""

    desc: str
    place: int = 0  # which of each rank's bars it is (an epoch's inner bar: one a epoch)
    ranks: list[int] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    totals: list[float | None] = field(default_factory=list)
    states: list[str] = field(default_factory=list)

    def shares(self) -> list[float]:
        """How far each rank's bar is, 0 to 1 (1 for a bar without a total)."""
        return [n / t if t else 1.0 for n, t in zip(self.counts, self.totals)]

    @property
    def share(self) -> float:
        """How far the slowest rank is, 0 to 1."""
        shares = self.shares()
        return max(0.0, min(1.0, min(shares))) if shares else 0.0

    @property
    def state(self) -> str:
        """'danger' (a rank's bar stopped short or failed), 'success' (all closed whole),
        'hidden' (all closed, made with ``leave=False``), or '' (running)."""
        if "danger" in self.states:
            return "danger"
        if all(s == "hidden" for s in self.states):
            return "hidden"
        return "success" if all(s in ("success", "hidden") for s in self.states) else ""

    def label(self) -> str:
        return f"[{rank_list(self.ranks)}] {self.desc}".rstrip()

    def counts_text(self) -> str:
        """Where the ranks' bars are: '20/20' (all alike), '10/10 (ranks 0-4, 6-8), 11/11
        (rank 5)' (a few kinds), '12-15/20 (slowest: rank 5)' (many), '7 it' (no total)."""
        said = [
            (r, f"{_number(n)}/{_number(t)}" if t else f"{_number(n)} it")
            for r, n, t in zip(self.ranks, self.counts, self.totals)
        ]
        kinds = alike(said, key=lambda s: s[1])
        if len(kinds) == 1:
            return said[0][1]
        if len(kinds) <= _KINDS_NAMED:
            return ", ".join(
                f"{text} ({rank_list(r for r, _ in same)})" for text, same in kinds.items()
            )
        totals = [t for t in self.totals if t]
        shares = self.shares()
        slowest = [r for r, share in zip(self.ranks, shares) if share == min(shares)]
        counts = f"{_number(min(self.counts))}-{_number(max(self.counts))}"
        total = f"/{_number(max(totals))}" if totals else " it"
        return f"{counts}{total} (slowest: {rank_list(slowest)})"

    def text(self) -> str:
        return f"{self.label()}: {self.counts_text()}"


def groups_of(snaps: dict[int, dict]) -> list[BarGroup]:
    """The ranks' grouped bars (in each snapshot's ``bars``, those that showed nothing on
    the rank), grouped by their place among the rank's and their description, in the
    order they first come."""
    entries = [
        (i, r, bar)
        for r, snap in sorted(snaps.items())
        for i, bar in enumerate(b for b in (snap or {}).get("bars") or () if b[4])
    ]
    out = []
    for (place, desc), same in alike(entries, key=lambda e: (e[0], e[2][0])).items():
        group = BarGroup(desc, place)
        for _, r, (_, n, total, state, _) in same:
            group.ranks.append(r)
            group.counts.append(n)
            group.totals.append(total)
            group.states.append(state)
        out.append(group)
    return out


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class GroupedBars:
    """The grouped bars of one cell: ``update`` at each look at the ranks, ``finish``
    at its end. ``live``: drawn as widgets as the cell runs (a notebook); else one line
    a group is written to ``out`` when it ends. Not ``on``: the ranks show their own."""

    def __init__(self, out: TextIO | None, live: bool | None = None, on: bool = True):
        self.out, self._live, self.on = out, live, on
        self.looked = time.monotonic()  # (a cell shorter than LOOK_S: one look, at its end)
        self.shown: dict[tuple[int, str], object] = {}  # a group's widget, by its place
        self.last: list[BarGroup] = []

    def update(self, views: dict, final: bool = False) -> None:
        """Look at the ranks' snapshots, and draw the groups in a notebook. A bar that
        cannot be drawn never fails the cell: the bars stop, said in the log."""
        if not self.last and not any(v.snap.get("bars") for v in views.values()):
            return  # (most cells make no bar: a look at each rank, no more)
        try:
            self.last = groups_of({r: v.snap for r, v in views.items()})
            if self.live:
                for group in self.last:
                    self._draw(group, final)
        except Exception:
            logging.getLogger("notebook_dist").exception("the ranks' progress bars stopped")
            self.on, self.last = False, []

    @property
    def live(self) -> bool:
        """Drawn as widgets (a notebook's kernel with ipywidgets): asked when first drawn."""
        if self._live is None:
            from . import widgets_available

            self._live = widgets_available()
        return self._live

    def following(self, on_update):
        """A watch's ``on_update`` that updates the bars, then calls ``on_update``."""
        if not self.on:
            return on_update

        def updated(view) -> None:
            now = time.monotonic()
            if self.on and now - self.looked >= LOOK_S:  # (snapshots come twice a second)
                self.looked = now
                self.update(view.views)
            if on_update is not None:
                on_update(view)

        return updated

    def finish(self, views: dict) -> None:
        """The bars' last state: drawn, its text form with it (a notebook), or a line a
        group written (elsewhere)."""
        if not self.on:
            return
        self.update(views, final=True)
        if not self.last or self.live:
            return
        out = self.out or sys.stdout
        out.write("".join(g.text() + "\n" for g in self.last if g.state != "hidden"))
        out.flush()

    def _draw(self, group: BarGroup, final: bool = False) -> None:
        """A group's widget, made and shown at first sight, its parts set as they change;
        closed once every rank's bar closed hidden (``leave=False``). Its text form says
        the group as it is (a saved notebook, read without the widget, shows the bar's last
        state): sent with it, and again at the cell's end."""
        import ipywidgets as w

        key = (group.place, group.desc)
        shown = self.shown.get(key)
        if group.state == "hidden":
            if shown is not None and shown.comm is not None:
                shown.close()  # (as tqdm.notebook closes a leave=False bar)
            return
        new = shown is None
        if new:
            bar = w.FloatProgress(min=0.0, max=1.0)
            shown = self.shown[key] = w.HBox(
                [w.HTML(), bar, w.HTML()], layout=w.Layout(display="inline-flex")
            )
            shown.add_class("nd-bars")
        left, bar, right = shown.children
        _set(left, "value", group.label() + ":")
        _set(bar, "value", group.share)
        _set(bar, "bar_style", group.state)
        _set(right, "value", group.counts_text())
        if new or final:
            from IPython.display import publish_display_data

            data = {**shown._repr_mimebundle_(), "text/plain": group.text()}
            display_id = f"nd-bars-{shown.model_id}"
            publish_display_data(data, transient={"display_id": display_id}, update=not new)


def _set(widget, name: str, value) -> None:
    """Set a widget's trait only when it changes (each change is a message)."""
    if getattr(widget, name) != value:
        setattr(widget, name, value)


#: the bars of a cell whose ranks show their own (fewer than ``COMPACT_FROM``, raw output)
OFF = GroupedBars(None, False, on=False)
