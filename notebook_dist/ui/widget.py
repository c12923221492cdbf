"""The live dashboard widget: one ipywidgets ``HTML`` view of the state, redrawn at most a
few times a second while the cell runs.

One widget, not one per field and rank: a dashboard of N ranks used to open about 12N
comms (each widget brings a Layout and a Style), and building them cost the kernel tens of
milliseconds of CPU at the start of every cell, taken from the ranks on a small machine.
Now it opens three, and an update is one message.
"""

from __future__ import annotations

import ipywidgets as W

from .html import DashboardRecord, render_html, render_summary
from .state import DashboardState
from .text import render_text


class WidgetDashboard:
    """The live widget. ``update`` redraws from a state; no logic lives here.

    It appears once the cell deserves a table (``DashboardState.worth_a_table``): a cell
    that ends within ``quiet_s`` with nothing to report never opens a comm, and leaves one
    line of summary. ``quiet_s=0`` shows the full table for every cell.
    """

    def __init__(self, quiet_s: float = 0.0, display=None) -> None:
        self.quiet_s = quiet_s
        self.view: W.HTML | None = None
        self._handle = None
        self._display = display  # where the view goes: IPython's display (the default)

    def update(self, st: DashboardState) -> None:
        if self.view is None:
            if not st.worth_a_table(self.quiet_s):
                return
            self.view = W.HTML()
            self._handle = self._show(self.view)
        self.view.value = render_html(st, live=True)  # unchanged text sends nothing

    def close(self, st: DashboardState) -> None:
        """Replace the live widget by a static record of the final state, then close it."""
        if self.view is None and not st.worth_a_table(self.quiet_s):
            record = DashboardRecord(render_summary(st), st.summary())
        else:
            record = DashboardRecord(render_html(st), render_text(st))
        if self._handle is None:
            self._handle = self._show(record)
        else:
            self._handle.update(record)
        for w in self.widgets():
            w.close()

    def _show(self, obj):
        if self._display is not None:
            return self._display(obj)
        from IPython.display import display

        return display(obj, display_id=True)

    def widgets(self) -> list:
        """Every widget this dashboard made (for leak checks): the view, its Layout and Style."""
        if self.view is None:
            return []
        return [self.view, self.view.layout, self.view.style]
