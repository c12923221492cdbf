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
