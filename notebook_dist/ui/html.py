"""The dashboard as HTML: one renderer for the live widget and for the record a finished
cell keeps.

While a cell runs, the widget shows ``render_html(state, live=True)``; when it ends the
widget is replaced by a static :class:`DashboardRecord` of the final state (and closed),
so the notebook keeps a record that needs no kernel, no widget state and no open comm,
and looks the same as the live view did.
"""

from __future__ import annotations

import html

from ..phrases import memory_text as fmt_bytes
from .compact import compact, compact_html
from .state import DashboardState, RankRow
from .widget_colors import STATE_COLORS, sparkline
from .words import fmt_metric, healed_text, progress_text

COLUMNS = (
    "rank",
    "state",
    "progress",
    "step",
    "metrics",
    "chart",
    "collective",
    "compute / wait",
    "memory",
    "last output",
)
_CELL = "padding:1px 6px;text-align:left;white-space:nowrap"


def progress_bar(step, total, width: int = 90) -> str:
    """A plain-HTML progress bar (no widget: it must survive in the static record)."""
    if not total or step is None:
        return ""
    share = max(0.0, min(1.0, float(step) / float(total)))
    return (
        f"<div class='nd-progress' data-value='{step:g}' data-max='{total:g}' "
        f"style='width:{width}px;height:8px;background:#e0e0e0;border-radius:4px'>"
        f"<div style='width:{share * 100:.1f}%;height:8px;background:#1e88e5;border-radius:4px'>"
        "</div></div>"
    )


def _row(row: RankRow) -> str:
    color = STATE_COLORS.get(row.state, "#757575")
    flag = (
        " <span class='nd-straggler' title='step time over 20% above the median'>⚠ straggler</span>"
        if row.straggler
        else ""
    )
    if row.healed:
        flag += (
            " <span class='nd-healed' title='replaced by a fresh engine with %dist_heal'>"
            f"{healed_text(row).strip(' ()')}</span>"
        )
    metrics = ", ".join(
        f"{k}={fmt_metric(v)}"
        for k, v in row.metrics.items()
        if k not in ("step", "total", "samples")
    )
    mem = fmt_bytes(row.rss_bytes)
    if row.gpu and row.gpu_allocated is None:  # %dist_status: the GPU as the rank reported it
        mem = f"<span class='nd-gpu'>{html.escape(row.gpu)}</span>"
    if row.gpu_allocated is not None:
        mem += (
            f"<br><span class='nd-gpu' title='{html.escape(row.gpu)}: CUDA memory allocated / "
            f"reserved (peak allocated)'>{html.escape(row.gpu.split(' ', 1)[0])} "
            f"{fmt_bytes(row.gpu_allocated)} / {fmt_bytes(row.gpu_reserved)} "
            f"(peak {fmt_bytes(row.gpu_peak)})</span>"
        )
    chart = sparkline(row.chart) + (
        f"<div style='font-size:10px;color:#777'>{html.escape(row.chart_key)}</div>"
        if row.chart_key
        else ""
    )
    cells = (
        f"<b>rank {row.rank}</b>",
        f"<span class='nd-state' data-state='{row.state}' style='color:{color};font-weight:bold'>"
        f"{row.state}</span> <span style='color:#777'>{row.elapsed_s:.1f} s</span>{flag}",
        progress_bar(row.step, row.total),
        f"<span class='nd-step'>{progress_text(row.step, row.total)}</span>",
        f"<span class='nd-metrics'>{html.escape(metrics)}</span>",
        chart,
        html.escape(row.collective),
        f"compute {row.compute_s:.1f} s / wait {row.wait_s:.1f} s",
        mem,
        html.escape(row.last_output[:60]),
    )
    tds = "".join(f"<td style='{_CELL}'>{c}</td>" for c in cells)
    return f"<tr class='nd-rank-row nd-rank-{row.rank}'>{tds}</tr>"


def render_html(st: DashboardState, live: bool = False) -> str:
    devices = ", ".join(sorted(set(st.devices)))
    head = (
        f"<b>{st.world_size} ranks</b> · {st.backend} · {html.escape(devices)}"
        f" · <span class='nd-wall'>{st.wall_s:.1f} s</span>"
    )
    if st.throughput:
        head += f" · {st.throughput:,.0f} samples/s"
    if st.title:
        head = f"<span class='nd-title'>{html.escape(st.title)}</span><br>{head}"
    rows = "".join(_row(st.rows[r]) for r in st.ranks if r in st.rows)
    verdict = (
        f"<div class='nd-verdict' style='color:#e65100'><b>Diagnosis:</b> {html.escape(st.verdict)}</div>"
        if st.verdict
        else ""
    )
    ths = "".join(f"<th style='{_CELL}'>{c}</th>" for c in COLUMNS)
    table = (
        f"<table style='font-size:12px;border-collapse:collapse'>"
        f"<thead><tr>{ths}</tr></thead><tbody>{rows}</tbody></table>"
    )
    if compact(st):  # many ranks: groups first, every row one click away
        table = compact_html(st, table)
    return (
        # the line height is set here: a widget's HTML would inherit a 28 px one
        # (overflow: a page narrower than the table scrolls it rather than cutting it)
        f"<div class='nd-dashboard {'nd-live' if live else 'nd-final'}' style='line-height:1.3;overflow-x:auto'>"
        f"<div class='nd-header'>{head}</div>{table}{verdict}</div>"
    )


def render_summary(st: DashboardState) -> str:
    """The one line a quick, quiet cell keeps instead of the table."""
    return (
        "<div class='nd-dashboard nd-summary' style='color:#777;font-size:11px;line-height:1.3'>"
        f"{html.escape(st.summary())}</div>"
    )


class DashboardRecord:
    """What a finished cell keeps: HTML for the notebook, text for everything else."""

    def __init__(self, html_text: str, plain: str):
        self.html = html_text
        self.plain = plain

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.plain
