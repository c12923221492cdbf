"""The profile drawn: text for a terminal, HTML with a timeline for the notebook. Each
function takes the ``model.Profile`` (``p``) it draws."""

from __future__ import annotations

import html

from ..phrases import COMPACT_FROM, rank_numbers
from ..phrases import size_text as bytes_text
from ..table import format_table

#: the times a rank's row shows, in the order of its columns after the rank
_TIMES = ("wall_s", "compute_s", "collectives_s", "waiting_s", "exposed_s")
#: what makes a rank one of those a compact table names, and how its row says so
_ENDS = (
    ("compute_s", max, "most compute"),
    ("compute_s", min, "least compute"),
    ("waiting_s", max, "waits most"),
    ("waiting_s", min, "waits least"),
)


def rank_columns(p) -> tuple[str, ...]:
    cols = ("rank", "wall", "compute", "collectives", "waiting for peers")
    return cols + ("exposed",) if p.cuda else cols


def rank_cells(p, r) -> tuple:
    """A rank's row: its number, then each time (``?`` where not known)."""
    return (r.rank, *(_span(p, [r], name) for name in _TIMES[: len(rank_columns(p)) - 1]))


def compact(p, full: bool = False) -> bool:
    """Whether the rank table names a few ranks and gives the others one row (from
    ``phrases.COMPACT_FROM`` ranks, unless ``full``)."""
    return not full and len(p.ranks) >= COMPACT_FROM


def ends(p) -> dict[int, str]:
    """The ranks a compact table names, each with why: the ranks at either end of compute
    and of waiting for peers (the one the others wait for computes most and waits least)."""
    times = list(p.ranks.values())
    why: dict[int, list[str]] = {}
    for name, pick, said in _ENDS:
        if p.unrecorded:
            break  # (neither is known without the ranks' collectives)
        why.setdefault(pick(times, key=lambda t: getattr(t, name)).rank, []).append(said)
    return {r: ", ".join(words) for r, words in sorted(why.items())}


def table_rows(p, full: bool = False) -> tuple[tuple[str, ...], list[tuple]]:
    """The rank table's columns and rows: a row a rank; or, compact, a row for each rank
    :func:`ends` names and one for all the others, each column as a range ('1.20-1.25 s')."""
    cols = rank_columns(p)
    if not compact(p, full):
        return cols, [rank_cells(p, r) for r in p.ranks.values()]
    named = ends(p)
    rows = [(*rank_cells(p, p.ranks[r]), why) for r, why in named.items()]
    others = [t for r, t in p.ranks.items() if r not in named]
    if others:
        spans = [_span(p, others, name) for name in _TIMES[: len(cols) - 1]]
        said = "the others" if named else "every rank"
        rows.append((rank_numbers(t.rank for t in others), *spans, said))
    return (*cols, ""), rows


def _span(p, times: list, name: str) -> str:
    """One column of several ranks as one: '1.201-1.305 s' ('?' where not known)."""
    if p.unrecorded and name != "wall_s":
        return "?"
    low, high = (f"{f(getattr(t, name) for t in times):.3f}" for f in (min, max))
    return f"{low} s" if low == high else f"{low}-{high} s"


def text(p, full: bool = False) -> str:
    lines = [f"profile of {p.cell} on {len(p.world)} ranks"]
    cols, cells = table_rows(p, full)
    lines += format_table(cols, [dict(zip(cols, row)) for row in cells])
    if compact(p, full):
        lines.append("(every rank's row: profile.text(full=True))")
    if p.ops:
        lines.append("")
        lines += format_table(
            ("op", "count", "size", "mean time", "algbw", "busbw"),
            [
                {
                    "op": o.op,
                    "count": o.count,
                    "size": bytes_text(o.bytes),
                    "mean time": f"{o.mean_s * 1e3:.3f} ms",
                    "algbw": f"{o.algbw:.3f} GB/s",
                    "busbw": f"{o.busbw:.3f} GB/s",
                }
                for o in p.ops
            ],
        )
    lines.append("")
    lines.append(p.finding())
    if p.trace_path:
        lines.append(f"Trace (Perfetto, chrome://tracing): {p.trace_path}")
    return "\n".join(lines)


def html_of(p) -> str:
    def table(cols, rows):
        head = "".join(f"<th style='padding:1px 8px;text-align:left'>{c}</th>" for c in cols)
        body = "".join(
            "<tr>"
            + "".join(f"<td style='padding:1px 8px'>{html.escape(str(v))}</td>" for v in row)
            + "</tr>"
            for row in rows
        )
        return f"<table style='font-size:12px;border-collapse:collapse'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    ranks = table(*table_rows(p))
    ops = table(
        ("op", "count", "size", "mean time", "algbw", "busbw"),
        [
            (
                o.op,
                o.count,
                bytes_text(o.bytes),
                f"{o.mean_s * 1e3:.3f} ms",
                f"{o.algbw:.3f} GB/s",
                f"{o.busbw:.3f} GB/s",
            )
            for o in p.ops
        ],
    )
    verdict = (
        f"<div class='nd-profile-verdict' style='color:#e65100'><b>Verdict:</b> {html.escape(p.verdict)}</div>"
        if p.verdict
        else f"<div class='nd-profile-verdict' style='color:{'#777' if p.machine or p.unrecorded else '#43a047'}'>{html.escape(p.finding())}</div>"
    )
    trace = (
        f"<div style='color:#777;font-size:11px'>Trace (Perfetto, chrome://tracing): <code>{html.escape(p.trace_path)}</code></div>"
        if p.trace_path
        else ""
    )
    return (
        f"<div class='nd-profile' style='line-height:1.3'><b>profile of {html.escape(p.cell)}</b>"
        f"{ranks}<br>{ops}{verdict}{timeline_svg(p)}{trace}</div>"
    )


def timeline_svg(p, width: int = 640) -> str:
    """One lane per rank: compute (blue), collectives (purple), waiting for peers (orange)."""
    if not p.lanes or p.span_s <= 0:
        return ""
    left, lane_h, gap = 56, 14, 6
    scale = (width - left - 10) / p.span_s
    colors = {"compute": "#42a5f5", "collective": "#8e24aa", "waiting": "#fb8c00"}
    parts = []
    y = 22
    shown = ends(p) if compact(p) else p.lanes  # (at many ranks: those the table names)
    others = (
        f" · the other {len(p.lanes) - len(shown)} ranks' lanes: in the trace" if compact(p) else ""
    )
    for rank, lanes in sorted((r, lanes) for r, lanes in p.lanes.items() if r in shown):
        parts.append(f"<text x='0' y='{y + lane_h - 3}' font-size='11'>rank {rank}</text>")
        for kind in ("compute", "collective", "waiting"):
            for s, e in _coalesce(lanes.get(kind, []), 1 / scale):
                w = max(0.5, (e - s) * scale)
                parts.append(
                    f"<rect class='nd-lane-{kind}' x='{left + s * scale:.1f}' y='{y}' width='{w:.1f}' "
                    f"height='{lane_h}' fill='{colors[kind]}'/>"
                )
        y += lane_h + gap
    legend = "".join(
        f"<rect x='{left + i * 110}' y='{y + 2}' width='10' height='10' fill='{c}'/>"
        f"<text x='{left + i * 110 + 14}' y='{y + 11}' font-size='11'>{k}</text>"
        for i, (k, c) in enumerate(
            (
                ("compute", colors["compute"]),
                ("collective", colors["collective"]),
                ("waiting for peers", colors["waiting"]),
            )
        )
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='nd-timeline' width='{width}' height='{y + 20}'>"
        f"<text x='0' y='12' font-size='11' fill='#777'>timeline, {p.span_s:.3f} s{others}</text>"
        + "".join(parts)
        + legend
        + "</svg>"
    )


def _coalesce(intervals: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    """Intervals closer than a pixel merged: a 10,000-step loop draws as bands, not rects."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s - out[-1][1] <= min_gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out
