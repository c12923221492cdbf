"""A rank's widget progress bars (``tqdm.notebook``) when the notebook shows the ranks'
alike bars as one (from ``phrases.COMPACT_FROM`` ranks): the bar counts as usual but makes
no widget, and its state rides in the agent's snapshots (``bars``), which the notebook
draws as one bar for the ranks whose bars share a description (``notebook_dist.bars``).

At 32 ranks, 32 widget bars were a page of bars and, for 16 bars of 5 steps, 179 comm
messages through the notebook's kernel; now no widget leaves a rank.
"""

from __future__ import annotations

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
    """Whether this cell's widget bars are shown grouped by the notebook (the cell's
    request says so)."""
    return STATE.group_bars


def keep(bar) -> None:
    """A grouped bar made in this cell, for the snapshots to carry."""
    STATE.bars.append(bar)


def bar_states() -> list[list] | None:
    """Each grouped bar of this cell as ``[description, n, total, state]``, in the order
    they were made (None: none)."""
    if not STATE.bars:
        return None
    out = []
    for bar in list(STATE.bars):
        container = getattr(bar, "container", None)
        state = container.state if isinstance(container, QuietBar) else ""
        out.append([str(bar.desc or ""), bar.n, bar.total, state])
    return out
