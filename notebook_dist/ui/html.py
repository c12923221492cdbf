"""A static HTML rendering of the final state: the record a finished cell keeps.

When a cell ends, the live widget is replaced by this (and closed), so the notebook
keeps a record that needs no kernel, no widget state and no open comm.
"""

from __future__ import annotations

import html

from .state import DashboardState
from .text import fmt_bytes, fmt_metric, progress_text
from .widget_colors import STATE_COLORS, sparkline


def render_html(st: DashboardState) -> str:
    devices = ", ".join(sorted(set(st.devices)))
    head = (
        f"<b>{st.world_size} ranks</b> · {st.backend} · {html.escape(devices)} · {st.wall_s:.1f} s"
    )
    if st.throughput:
        head += f" · {st.throughput:,.0f} samples/s"
    rows = []
    for r in st.ranks:
        row = st.rows.get(r)
        if row is None:
            continue
        color = STATE_COLORS.get(row.state, "#757575")
        metrics = ", ".join(
            f"{k}={fmt_metric(v)}"
            for k, v in row.metrics.items()
            if k not in ("step", "total", "samples")
        )
        mem = fmt_bytes(row.rss_bytes)
        if row.gpu_allocated is not None:
            mem += f", GPU {fmt_bytes(row.gpu_allocated)} / {fmt_bytes(row.gpu_reserved)}"
        flag = " ⚠ straggler" if row.straggler else ""
        rows.append(
            f"<tr class='nd-rank-row nd-rank-{r}'><td><b>rank {r}</b></td>"
            f"<td><span class='nd-state' data-state='{row.state}' style='color:{color};font-weight:bold'>{row.state}</span>{flag}</td>"
            f"<td class='nd-step'>{progress_text(row.step, row.total)}</td>"
            f"<td>{html.escape(metrics)}</td><td>{sparkline(row.chart)}</td>"
            f"<td>compute {row.compute_s:.1f} s / wait {row.wait_s:.1f} s</td><td>{mem}</td>"
            f"<td>{html.escape(row.last_output[:60])}</td></tr>"
        )
    verdict = (
        f"<div class='nd-verdict' style='color:#e65100'><b>Diagnosis:</b> {html.escape(st.verdict)}</div>"
        if st.verdict
        else ""
    )
    return (
        f"<div class='nd-dashboard nd-final'><div>{head}</div><table style='font-size:12px'>"
        "<thead><tr><th>rank</th><th>state</th><th>step</th><th>metrics</th><th>chart</th>"
        "<th>compute/wait</th><th>memory</th><th>last output</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{verdict}</div>"
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
