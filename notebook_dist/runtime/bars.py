"""A rank's progress bars (tqdm's, text and widget): each one's count rides in the
agent's snapshots (``bars``), where the dashboard reads a rank's progress when the cell
reports none itself (``nd.report(step=...)``). From ``phrases.COMPACT_FROM`` ranks the
notebook shows the ranks' alike bars as one (``notebook_dist/ui/bars.py``): a bar then
counts as usual and shows nothing on the rank, a widget bar making no widget, a text bar
writing nowhere.

At 32 ranks, 32 widget bars were a page of bars and, for 16 bars of 5 steps, 179 comm
messages through the notebook's kernel; 32 text bars were 32 lines that never fold (each
its own rate and time).
"""

from __future__ import annotations

import sys
from typing import Any

from .state import STATE


class _Part:
    """A widget's stand-in: what ``tqdm.notebook`` sets on its three parts (a value, a
    bar style, a colour, a layout) is kept and shown nowhere."""

    def __init__(self, value: Any = "") -> None:
        self.value = value
        self.bar_style = ""
        self.layout = self
        self.style = self

    def close(self) -> None:
        self.closed = True


class QuietBar(_Part):
    """What ``tqdm.notebook``'s ``status_printer`` makes (a box of the description, the
    bar and the counts), without a widget."""

    def __init__(self, total: float | None = None) -> None:
        super().__init__()
        self.children = (_Part(), _Part(0), _Part())
        self.pbar = None

    def _ipython_display_(self) -> None:
        """Displayed (as ``tqdm.notebook`` displays its box): nothing is shown."""

    @property
    def state(self) -> str:
        """'danger' (it stopped with an error), 'success' (closed whole), or ''."""
        return self.children[1].bar_style


def quiet_printer(_fp=None, total=None, desc=None, ncols=None) -> QuietBar:
    """``tqdm.notebook.tqdm.status_printer``'s stand-in for a bar the notebook groups."""
    return QuietBar(total)


def grouped() -> bool:
    """Whether this cell's bars are shown grouped by the notebook (its request says so)."""
    return STATE.group_bars


class _Nowhere:
    """Where a grouped text bar writes: nowhere (the notebook draws it)."""

    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


NOWHERE = _Nowhere()


def quieted(bar, widget: bool, args: tuple, kwargs: dict) -> bool:
    """Make ``bar`` (about to be made) show nothing when this cell's bars are grouped: a
    widget bar makes no widget, a text bar to the rank's streams writes nowhere (one to a
    file of the user's writes there). Whether it was."""
    if not grouped():
        return False
    if widget:
        bar.status_printer = quiet_printer
        return True
    if len(args) > 4 or kwargs.get("file") not in (None, sys.stdout, sys.stderr):
        return False  # (its file given: the user's log, say)
    kwargs["file"] = NOWHERE
    return True


def keep(bar, quiet: bool) -> None:
    """A bar made in this cell, for the snapshots to carry (one made disabled counts
    nothing: left out)."""
    if not getattr(bar, "disable", True):
        STATE.bars.append((bar, quiet))


def bar_states() -> list[list] | None:
    """Each bar of this cell as ``[description, n, total, state, grouped]``, in the order
    they were made (None: none); state: 'danger' (closed short of its total, or stopped by
    an error), 'success' (closed whole), 'hidden' (closed, made with ``leave=False``: an
    epoch's inner bar) or '' (open)."""
    if not STATE.bars:
        return None
    label = f"[rank {STATE.rank}] "
    out = []
    for bar, quiet in list(STATE.bars):
        container = getattr(bar, "container", None)  # (a widget bar's, or its stand-in)
        if container is not None:
            state = container.children[1].bar_style
            if getattr(container, "closed", False) and state != "danger":
                state = "hidden"  # (tqdm.notebook closes a leave=False bar's box)
        elif bar.disable:  # (a text bar: closed)
            short = bar.total and bar.n < bar.total
            state = "hidden" if not bar.leave else "danger" if short else "success"
        else:
            state = ""
        desc = str(bar.desc or "").removeprefix(label).removeprefix(label.rstrip())
        out.append([desc, bar.n, bar.total, state or "", quiet])
    return out
