"""The dashboard: a plain state object (``state``), rendered as widgets or as text.

Widget code holds no logic: ``state.build`` turns what the kernel knows of a running
cell into a :class:`DashboardState`; ``widget`` and ``text`` only draw it. Pick one
with :func:`make_dashboard`.
"""

from __future__ import annotations

from .state import DashboardState, RankRow, build


def widgets_available() -> bool:
    """True inside a Jupyter kernel whose front end can show ipywidgets."""
    from ..displays import in_kernel

    if not in_kernel():
        return False  # terminal IPython, a plain script
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def make_dashboard(mode: str = "auto", quiet_s: float = 0.0, full_table: bool = False):
    """``auto``: widgets in a Jupyter kernel, text elsewhere; ``widget``, ``text`` or ``off``.
    ``quiet_s``: a cell shorter than this with nothing to report leaves one line;
    ``full_table``: the text form prints every rank's row, however many."""
    if mode == "off":
        return None
    if mode == "widget" or (mode == "auto" and widgets_available()):
        from .widget import WidgetDashboard

        return WidgetDashboard(quiet_s)
    from .text import TextDashboard

    return TextDashboard(full_table)


def show(record) -> None:
    """Show a record (``html.DashboardRecord``, or a sentence): rich in a notebook whose
    front end draws widgets, its text elsewhere (a terminal, a script, nbconvert)."""
    if isinstance(record, str) or not widgets_available():
        print(record if isinstance(record, str) else repr(record))
        return
    from IPython.display import display

    display(record)


__all__ = [
    "DashboardFeed",
    "DashboardState",
    "RankRow",
    "build",
    "make_dashboard",
    "show",
    "widgets_available",
]


class DashboardFeed:
    """The CellWatch callback that feeds a dashboard at most ``hz`` times a second."""

    def __init__(self, dashboard, hz: float = 4.0, chart_metric: str = "loss"):
        self.dashboard = dashboard
        self.min_interval = 1.0 / hz
        self.chart_metric = chart_metric
        self._last = 0.0
        self.updates = 0

    def __call__(self, watch) -> None:
        import time

        now = time.monotonic()
        if now - self._last < self.min_interval:
            return
        self._last = now
        self.updates += 1
        self.dashboard.update(build(watch, self.chart_metric))

    def close(self, watch) -> None:
        self.dashboard.close(build(watch, self.chart_metric))
