"""Colours and the SVG sparkline, shared by the widget and the static HTML."""

from __future__ import annotations

STATE_COLORS = {
    "starting": "#9e9e9e",
    "running": "#1e88e5",
    "in collective": "#8e24aa",
    "done": "#43a047",
    "error": "#e53935",
    "dead": "#212121",
    "hung": "#fb8c00",
    "in debugger": "#00897b",
    "waiting for input": "#00897b",
    "released": "#6d4c41",
    "idle": "#757575",
}


def sparkline(points: list[tuple[float, float]], width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of (x, y) points; empty when there is nothing to draw.

    At most one point per two pixels is drawn (the first and the last always): more
    would not show, and the dashboard redraws this several times a second.
    """
    if len(points) < 2:
        return f"<svg width='{width}' height='{height}'></svg>"
    most = max(2, width // 2)
    if len(points) > most:
        stride = -(-(len(points) - 1) // (most - 1))  # ceiling
        points = points[:-1:stride] + [points[-1]]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx, sy = (width - 2) / ((x1 - x0) or 1.0), (height - 2) / ((y1 - y0) or 1.0)
    coords = " ".join(
        f"{(x - x0) * sx + 1:.1f},{height - 1 - (y - y0) * sy:.1f}" for x, y in points
    )
    return (
        f"<svg class='nd-chart' width='{width}' height='{height}'><polyline fill='none' stroke='#1e88e5' "
        f"stroke-width='1.5' points='{coords}'/></svg>"
    )
