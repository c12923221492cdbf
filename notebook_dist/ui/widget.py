"""ipywidgets rendering of the dashboard: one row per rank, a header, a chart per rank."""

from __future__ import annotations

import html

import ipywidgets as W

from .state import DashboardState, RankRow
from .text import fmt_bytes, fmt_metric, progress_text
from .widget_colors import STATE_COLORS, sparkline


class RankRowWidget:
    def __init__(self, rank: int):
        self.rank = rank
        self.label = W.HTML(f"<b>rank {rank}</b>", layout=W.Layout(width="70px"))
        self.state = W.HTML(layout=W.Layout(width="150px"))
        self.progress = W.IntProgress(min=0, max=1, value=0, layout=W.Layout(width="140px"))
        self.step = W.HTML(layout=W.Layout(width="80px"))
        self.metrics = W.HTML(layout=W.Layout(width="200px"))
        self.chart = W.HTML(layout=W.Layout(width="130px"))
        self.detail = W.HTML(layout=W.Layout(width="360px"))
        self.box = W.HBox(
            [
                self.label,
                self.state,
                self.progress,
                self.step,
                self.metrics,
                self.chart,
                self.detail,
            ],
            layout=W.Layout(align_items="center"),
        )
        self.box.add_class("nd-rank-row")
        self.box.add_class(f"nd-rank-{rank}")

    def render(self, row: RankRow) -> None:
        color = STATE_COLORS.get(row.state, "#757575")
        flag = (
            " <span title='step time >20% over the median'>⚠ straggler</span>"
            if row.straggler
            else ""
        )
        self.state.value = (
            f"<span class='nd-state' data-state='{row.state}' style='color:{color};font-weight:bold'>{row.state}</span>"
            f" <span style='color:#777'>{row.elapsed_s:.1f} s</span>{flag}"
        )
        if row.total:
            self.progress.max = max(1, int(row.total))
            self.progress.value = min(int(row.step or 0), self.progress.max)
            self.progress.layout.visibility = "visible"
        else:
            self.progress.layout.visibility = "hidden"
        self.step.value = f"<span class='nd-step'>{progress_text(row.step, row.total)}</span>"
        shown = {k: v for k, v in row.metrics.items() if k not in ("step", "total", "samples")}
        self.metrics.value = html.escape(
            ", ".join(f"{k}={fmt_metric(v)}" for k, v in shown.items())
        )
        self.chart.value = sparkline(row.chart) + (
            f"<div style='font-size:10px;color:#777'>{row.chart_key}</div>" if row.chart_key else ""
        )
        mem = fmt_bytes(row.rss_bytes)
        if row.gpu_allocated is not None:
            mem += f", GPU {fmt_bytes(row.gpu_allocated)} / {fmt_bytes(row.gpu_reserved)}"
        parts = [
            f"{row.collective}" if row.collective else "",
            f"compute {row.compute_s:.1f} s / wait {row.wait_s:.1f} s",
            mem,
            html.escape(row.last_output[:60]),
        ]
        self.detail.value = (
            "<span style='font-size:11px;color:#555'>"
            + " · ".join(p for p in parts if p)
            + "</span>"
        )


class WidgetDashboard:
    """The live widget. ``update`` redraws from a state; no logic lives here."""

    def __init__(self) -> None:
        self.header = W.HTML()
        self.verdict = W.HTML()
        self.rows: dict[int, RankRowWidget] = {}
        self.rows_box = W.VBox()
        self.root = W.VBox([self.header, self.rows_box, self.verdict])
        self.root.add_class("nd-dashboard")
        self.root.add_class("nd-live")
        self._handle = None

    def _ensure_rows(self, st: DashboardState) -> None:
        if list(self.rows) != st.ranks:
            self.rows = {r: RankRowWidget(r) for r in st.ranks}
            self.rows_box.children = [w.box for w in self.rows.values()]

    def update(self, st: DashboardState) -> None:
        if self._handle is None:
            from IPython.display import display

            self._handle = display(self.root, display_id=True)
        self._ensure_rows(st)
        devices = ", ".join(sorted(set(st.devices)))
        head = f"<b>{st.world_size} ranks</b> · {st.backend} · {devices} · <span class='nd-wall'>{st.wall_s:.1f} s</span>"
        if st.throughput:
            head += f" · {st.throughput:,.0f} samples/s"
        self.header.value = head
        for r, w in self.rows.items():
            if r in st.rows:
                w.render(st.rows[r])
        self.verdict.value = (
            f"<div class='nd-verdict' style='color:#e65100'><b>Diagnosis:</b> {html.escape(st.verdict)}</div>"
            if st.verdict
            else ""
        )

    def close(self, st: DashboardState) -> None:
        """Replace the live widget by a static record of the final state, then close it."""
        from .html import DashboardRecord, render_html
        from .text import render_text

        record = DashboardRecord(render_html(st), render_text(st))
        if self._handle is None:
            from IPython.display import display

            self._handle = display(record, display_id=True)
        else:
            self._handle.update(record)
        for w in self.widgets():
            w.close()

    def widgets(self) -> list:
        """Every widget this dashboard made (for leak checks)."""
        out = [self.root, self.header, self.verdict, self.rows_box]
        for w in self.rows.values():
            out += [w.box, w.label, w.state, w.progress, w.step, w.metrics, w.chart, w.detail]
        # each widget also owns a Layout (and most a Style) widget with a comm of its own
        owned = [getattr(w, name, None) for w in out for name in ("layout", "style")]
        return out + [w for w in owned if w is not None]
