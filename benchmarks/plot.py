"""The scale benchmark as a picture: each measure at 4-32 ranks as a ratio to the same
measure at 2 ranks (pair medians with their 95% intervals), on a log-log grid, with the
issue's bounds. Plain SVG, nothing to install.

    python -m benchmarks.plot [RESULTS_JSON] [OUT_SVG]
    (defaults: benchmarks/results/latest.json, docs/images/scale.svg)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: (key in the results, label, colour)
SERIES = [
    ("start_s", "start", "#1b9e77"),
    ("cell_s", "empty cell, wall", "#d95f02"),
    ("cell_cpu_s", "empty cell, notebook CPU", "#7570b3"),
    ("gather_1MB_each_s", "gather of 1 MB per rank", "#e7298a"),
    ("verdict_s", "time to the doctor's verdict", "#66a61e"),
    ("echo_floor_s", "floor: bare processes, wall", "#999999"),
    ("pipe_floor_s", "floor: the same by pipes", "#cccccc"),
]
#: the issue's bounds at 16 ranks: (ratio, what)
BOUNDS = [(1.5, "notebook CPU bound at 16 (1.5x)"), (2.0, "start and wall bound at 16 (2x)")]

W, H = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 250, 30, 60


def _x(ranks: int, sizes: list[int]) -> float:
    lo, hi = math.log2(sizes[0]), math.log2(sizes[-1])
    return LEFT + (math.log2(ranks) - lo) / (hi - lo) * (W - LEFT - RIGHT)


def _y(ratio: float, top: float) -> float:
    return TOP + (1 - math.log2(ratio) / math.log2(top)) * (H - TOP - BOTTOM)


def svg(scale: dict) -> str:
    sizes = sorted(int(k.split("_")[0]) for k in scale)
    top = 2 ** math.ceil(
        math.log2(
            max(
                max(g[f"{k}_vs_2"]["pair_median_ci95"][1] for k, *_ in SERIES if f"{k}_vs_2" in g)
                for g in scale.values()
            )
        )
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
    ]
    ticks = [2**i for i in range(int(math.log2(top)) + 1)]
    for t in ticks:  # horizontal grid: ratios
        y = _y(t, top)
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{t}x</text>')
    for n in [2, *sizes]:  # vertical grid: ranks
        x = _x(n, [2, *sizes])
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{n}</text>')
    out.append(
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 15}" text-anchor="middle">ranks (2 CPU cores)</text>'
    )
    out.append(
        f'<text x="18" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 18 {(TOP + H - BOTTOM) / 2})">the same at 2 ranks = 1x</text>'
    )
    for ratio, what in BOUNDS:
        y = _y(ratio, top)
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#999" '
            'stroke-dasharray="4 4"/>'
        )
        out.append(f'<text x="{W - RIGHT + 6}" y="{y + 4:.1f}" fill="#666">{what}</text>')
    legend_y = TOP + 120
    for i, (key, label, colour) in enumerate(SERIES):
        points = []
        for n in sizes:
            r = scale[f"{n}_ranks"].get(f"{key}_vs_2")
            if r is None:
                continue
            lo, hi = r["pair_median_ci95"]
            x, y = _x(n, [2, *sizes]), _y(r["pair_median"], top)
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_y(lo, top):.1f}" y2="{_y(hi, top):.1f}" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}"/>')
            points.append(f"{x:.1f},{y:.1f}")
        if points:
            start = f"{_x(2, [2, *sizes]):.1f},{_y(1, top):.1f}"
            out.append(
                f'<polyline points="{start} {" ".join(points)}" fill="none" stroke="{colour}"/>'
            )
            y = legend_y + 18 * i
            out.append(
                f'<line x1="{W - RIGHT + 6}" x2="{W - RIGHT + 26}" y1="{y}" y2="{y}" '
                f'stroke="{colour}" stroke-width="3"/>'
            )
            out.append(f'<text x="{W - RIGHT + 32}" y="{y + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    results = Path(argv[0]) if argv else HERE / "results" / "latest.json"
    target = Path(argv[1]) if len(argv) > 1 else HERE.parent / "docs" / "images" / "scale.svg"
    scale = json.loads(results.read_text())["scale"]
    target.write_text(svg(scale))
    print(f"written to {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
