"""Text rendering of the dashboard: printed once when the cell ends, never streamed."""

from __future__ import annotations

from ..phrases import memory_text as fmt_bytes
from ..table import format_table
from .compact import compact, compact_text
from .state import DashboardState
from .words import fmt_metric, healed_text, progress_text


def render_text(st: DashboardState, full: bool = False) -> str:
    """The dashboard as text; from ``phrases.COMPACT_FROM`` ranks, the ranks grouped by
    what they do unless ``full`` (``DistConfig.dashboard_full_table``)."""
    head = f"{st.world_size} ranks · {st.backend} · {st.wall_s:.1f} s"
    if st.throughput:
        head += f" · {st.throughput:,.0f} samples/s"
    lines = [head]
    if compact(st) and not full:
        lines += compact_text(st)
        if st.verdict:
            lines.append(f"Diagnosis: {st.verdict}")
        return "\n".join(lines)
    cols = (
        "rank",
        "state",
        "step",
        "metrics",
        "collective",
        "compute/wait",
        "memory",
        "last output",
    )
    table = []
    for r in st.ranks:
        row = st.rows.get(r)
        if row is None:
            continue
        metrics = ", ".join(
            f"{k}={fmt_metric(v)}"
            for k, v in row.metrics.items()
            if k not in ("step", "total", "samples")
        )
        state = row.state + (" (straggler)" if row.straggler else "") + healed_text(row)
        mem = fmt_bytes(row.rss_bytes)
        if row.gpu_allocated is not None:
            mem += f" / GPU {fmt_bytes(row.gpu_allocated)} (peak {fmt_bytes(row.gpu_peak)})"
        table.append(
            (
                str(r),
                state,
                progress_text(row.step, row.total),
                metrics or "-",
                row.collective or "-",
                f"{row.compute_s:.1f}/{row.wait_s:.1f} s",
                mem,
                (row.last_output or "")[:40],
            )
        )
    lines.extend(format_table(cols, table))
    if st.verdict:
        lines.append(f"Diagnosis: {st.verdict}")
    return "\n".join(lines)


class TextDashboard:
    """Keeps the latest state; prints it once, when the cell ends."""

    def __init__(self, full: bool = False) -> None:
        self.state: DashboardState | None = None
        self.full = full  # every rank's row, however many (DistConfig.dashboard_full_table)

    def update(self, state: DashboardState) -> None:
        self.state = state

    def close(self, state: DashboardState) -> None:
        self.state = state
        if any(row.metrics for row in state.rows.values()) or state.verdict:
            print(render_text(state, self.full))
