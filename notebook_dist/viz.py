"""Pictures of collectives: each rank's tensor before and after, as an inline SVG.

Each element is coloured by its value, so data movement is visible at a glance: after
a broadcast every row wears rank 0's colours; after an all_gather every row holds
everyone's. Plain SVG, no plotting library.
"""

from __future__ import annotations

import colorsys
import html
from typing import Any

CELL = 34
GAP = 6


def _values(x: Any) -> list[float]:
    if hasattr(x, "detach"):
        x = x.detach().cpu().reshape(-1).tolist()
    elif hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (int, float)):
        return [float(x)]
    out: list[float] = []
    for v in x:
        out.extend(_values(v) if not isinstance(v, (int, float)) else [float(v)])
    return out


def _color(v: float, lo: float, hi: float) -> str:
    t = 0.0 if hi == lo else (v - lo) / (hi - lo)
    r, g, b = colorsys.hsv_to_rgb(0.62 - 0.62 * t, 0.45, 0.95)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.2g}"


def _block(rows: dict[int, list[float]], x0: int, y0: int, lo: float, hi: float) -> list[str]:
    parts = []
    for i, (_rank, vals) in enumerate(sorted(rows.items())):
        y = y0 + i * (CELL + GAP)
        for j, v in enumerate(vals):
            x = x0 + j * CELL
            parts.append(
                f"<rect x='{x}' y='{y}' width='{CELL - 2}' height='{CELL - 2}' rx='4' fill='{_color(v, lo, hi)}' stroke='#555'/>"
                f"<text x='{x + (CELL - 2) / 2}' y='{y + CELL / 2 + 3}' font-size='11' text-anchor='middle'>{_fmt(v)}</text>"
            )
    return parts


class CollectivePicture:
    """Displays as SVG in a notebook and as text elsewhere."""

    def __init__(self, title: str, before: dict, after: dict):
        self.title = title
        self.before = {r: _values(v) for r, v in before.items()}
        self.after = {r: _values(v) for r, v in after.items()}

    def __repr__(self) -> str:
        lines = [self.title]
        for r in sorted(self.before):
            b = " ".join(_fmt(v) for v in self.before[r])
            a = " ".join(_fmt(v) for v in self.after.get(r, []))
            lines.append(f"  rank {r}: [{b}]  ->  [{a}]")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        allv = [v for vals in (*self.before.values(), *self.after.values()) for v in vals] or [0.0]
        lo, hi = min(allv), max(allv)
        wb = max(len(v) for v in self.before.values()) * CELL
        wa = max(len(v) for v in self.after.values()) * CELL
        label_w, arrow_w = 60, 70
        n = len(self.before)
        height = 30 + n * (CELL + GAP)
        width = label_w + wb + arrow_w + wa + 10
        parts = [
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' class='nd-collective'>",
            f"<text x='0' y='14' font-size='13' font-weight='bold'>{html.escape(self.title)}</text>",
            f"<text x='{label_w}' y='26' font-size='10' fill='#777'>before</text>",
            f"<text x='{label_w + wb + arrow_w}' y='26' font-size='10' fill='#777'>after</text>",
        ]
        for i, r in enumerate(sorted(self.before)):
            y = 30 + i * (CELL + GAP)
            parts.append(f"<text x='0' y='{y + CELL / 2 + 3}' font-size='12'>rank {r}</text>")
            ax = label_w + wb + 10
            parts.append(
                f"<line x1='{ax}' y1='{y + CELL / 2}' x2='{ax + arrow_w - 25}' y2='{y + CELL / 2}' stroke='#999' stroke-width='2'/>"
                f"<polygon points='{ax + arrow_w - 25},{y + CELL / 2 - 5} {ax + arrow_w - 17},{y + CELL / 2} {ax + arrow_w - 25},{y + CELL / 2 + 5}' fill='#999'/>"
            )
        parts += _block(self.before, label_w, 30, lo, hi)
        parts += _block(self.after, label_w + wb + arrow_w, 30, lo, hi)
        parts.append("</svg>")
        return "".join(parts)


def collective_picture(title: str, before: dict, after: dict) -> CollectivePicture:
    """``before``/``after``: rank -> tensor (a RankValues from ``--gather`` works)."""
    return CollectivePicture(title, dict(before), dict(after))


# ---- who holds which element of a sharded tensor ------------------------------------

RANK_COLORS = (
    "#42a5f5",
    "#ef5350",
    "#66bb6a",
    "#ffa726",
    "#ab47bc",
    "#26c6da",
    "#8d6e63",
    "#ec407a",
)


def _rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


class OwnersPicture:
    """A matrix drawn as a grid, each element in the colour of the rank that holds it."""

    def __init__(self, title: str, owners: Any, cell: int = 12):
        if hasattr(owners, "tolist"):
            owners = owners.tolist()
        self.title = title
        self.owners = [
            [int(v) for v in row]
            for row in (owners if owners and isinstance(owners[0], list) else [owners])
        ]
        self.cell = cell

    def ranks(self) -> list[int]:
        return sorted({v for row in self.owners for v in row})

    def __repr__(self) -> str:
        lines = [self.title] + ["  " + "".join(str(v) for v in row) for row in self.owners]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        c = self.cell
        rows, cols = len(self.owners), len(self.owners[0])
        legend_y = 22 + rows * c + 16
        width = max(cols * c + 2, 90 * len(self.ranks()))
        parts = [
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{legend_y + 8}' class='nd-owners'>",
            f"<text x='0' y='14' font-size='13' font-weight='bold'>{html.escape(self.title)}</text>",
        ]
        for i, row in enumerate(self.owners):
            for j, r in enumerate(row):
                parts.append(
                    f"<rect x='{j * c}' y='{22 + i * c}' width='{c - 1}' height='{c - 1}' fill='{_rank_color(r)}'/>"
                )
        for k, r in enumerate(self.ranks()):
            parts.append(
                f"<rect x='{k * 90}' y='{legend_y - 9}' width='10' height='10' fill='{_rank_color(r)}'/>"
                f"<text x='{k * 90 + 14}' y='{legend_y}' font-size='11'>rank {r}</text>"
            )
        parts.append("</svg>")
        return "".join(parts)


def owners_picture(
    title: str, owners: Any = None, *, held: Any = None, shape: tuple[int, int] | None = None
) -> OwnersPicture:
    """Who holds which element of a sharded matrix.

    ``owners``: the matrix (tensor or nested lists) of the rank holding each element. Or
    ``held`` (rank -> the numbers of the elements that rank holds, counted in row order)
    with the matrix's ``shape``: what each rank's shard of ``torch.arange(n).reshape(shape)``
    holds, distributed like the weight (``distribute_tensor(numbers, w.device_mesh,
    w.placements).to_local()``), gathered with ``--gather``.
    """
    if held is not None:
        if shape is None:
            raise ValueError("owners_picture(held=...) needs the matrix's shape")
        rows, cols = shape
        grid = [[-1] * cols for _ in range(rows)]
        for rank, numbers in dict(held).items():
            for n in _values(numbers):
                grid[int(n) // cols][int(n) % cols] = int(rank)
        owners = grid
    return OwnersPicture(title, owners)


# ---- a line chart ----------------------------------------------------------------------


class LineChart:
    """Series of (x, y) points as an SVG chart (log axes on request), text elsewhere."""

    def __init__(
        self,
        title: str,
        series: dict[str, list[tuple[float, float]]],
        xlabel: str = "",
        ylabel: str = "",
        logx: bool = False,
        logy: bool = False,
    ):
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.series = {name: [(float(x), float(y)) for x, y in pts] for name, pts in series.items()}
        self.logx, self.logy = logx, logy

    def __repr__(self) -> str:
        lines = [self.title]
        for name, pts in self.series.items():
            lines.append(f"  {name}: " + ", ".join(f"({_fmt(x)}, {y:.4g})" for x, y in pts))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import math

        w, h, left, bottom, top = 460, 220, 56, 34, 24
        pts = [p for s in self.series.values() for p in s]
        if not pts:
            return f"<div>{html.escape(self.title)}: no points</div>"

        def tx(v):
            return math.log10(v) if self.logx and v > 0 else v

        def ty(v):
            return math.log10(v) if self.logy and v > 0 else v

        xs, ys = [tx(x) for x, _ in pts], [ty(y) for _, y in pts]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

        def px(v):
            return left + (tx(v) - x0) / (x1 - x0) * (w - left - 10)

        def py(v):
            return h - bottom - (ty(v) - y0) / (y1 - y0) * (h - bottom - top)

        parts = [
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h + 16 * len(self.series)}' class='nd-chart'>",
            f"<text x='0' y='14' font-size='13' font-weight='bold'>{html.escape(self.title)}</text>",
            f"<line x1='{left}' y1='{h - bottom}' x2='{w - 10}' y2='{h - bottom}' stroke='#999'/>",
            f"<line x1='{left}' y1='{top}' x2='{left}' y2='{h - bottom}' stroke='#999'/>",
        ]
        for v, anchor_y in ((min(p[1] for p in pts), h - bottom), (max(p[1] for p in pts), top)):
            parts.append(
                f"<text x='{left - 4}' y='{anchor_y + 4}' font-size='10' text-anchor='end'>{v:.3g}</text>"
            )
        for v, anchor_x, anchor in (
            (min(p[0] for p in pts), left, "start"),
            (max(p[0] for p in pts), w - 10, "end"),
        ):
            parts.append(
                f"<text x='{anchor_x}' y='{h - bottom + 14}' font-size='10' text-anchor='{anchor}'>{_fmt(v)}</text>"
            )
        parts.append(
            f"<text x='{(w + left) / 2}' y='{h - 6}' font-size='11' text-anchor='middle'>{html.escape(self.xlabel)}</text>"
        )
        parts.append(
            f"<text x='12' y='{(h - bottom + top) / 2}' font-size='11' text-anchor='middle' "
            f"transform='rotate(-90 12 {(h - bottom + top) / 2})'>{html.escape(self.ylabel)}</text>"
        )
        for k, (name, series) in enumerate(self.series.items()):
            color = _rank_color(k)
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in series)
            parts.append(
                f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='2'/>"
            )
            for x, y in series:
                parts.append(f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='2.5' fill='{color}'/>")
            ly = h + 12 + 16 * k
            parts.append(
                f"<rect x='{left}' y='{ly - 9}' width='10' height='10' fill='{color}'/>"
                f"<text x='{left + 14}' y='{ly}' font-size='11'>{html.escape(name)}</text>"
            )
        parts.append("</svg>")
        return "".join(parts)


def line_chart(title: str, series: dict, **kwargs: Any) -> LineChart:
    """``series``: name -> [(x, y), ...]; ``xlabel``, ``ylabel``, ``logx``, ``logy``."""
    return LineChart(title, series, **kwargs)
