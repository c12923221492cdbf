"""Where the time of a cell goes, across ranks (``%%distributed --profile``).

Each rank ran the cell under torch.profiler (``runtime/profiler.py``) and sent back its
collectives (process group, sequence number, bytes, when it arrived, when the collective
ran) and when its main thread was computing. Here the ranks are put on one clock and
matched collective by collective, which gives what no single rank's trace shows:

- how long each rank **waited for its peers**: for each collective, the time from its own
  arrival to the last rank's arrival (arrival skew);
- a per-op table with algorithm and bus bandwidth by the nccl-tests formulas;
- a plain verdict when one rank holds the others back, naming it and its cell line, and
  none when the machine did it (the late rank waited for a CPU: Linux's schedstat);
- a timeline, one lane per rank, and one merged Chrome trace (Perfetto, chrome://tracing).

The events come from torch.profiler's own results. Holistic Trace Analysis, the usual tool
for such traces, finds communication only in NCCL kernels on GPU streams: on CPU traces
(Gloo) its overlap, temporal and straggler analyses return nothing or fail (tried with HTA
0.5), so the matching across ranks is done here, on the Flight Recorder's sequence numbers.
"""

from __future__ import annotations

import html
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .runtime.profiler import union
from .table import format_table

# nccl-tests (PERFORMANCE.md): algbw = S / t with S the "size" of each op's test, and
# busbw = algbw * factor(n), the rate each link runs at, comparable across ops
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
# a straggler: last to arrive at this share of the collectives, and its lateness cost the
# others this share of the cell
STRAGGLER_SHARE = 0.75
STRAGGLER_COST = 0.10
MIN_LATE_NS = 1_000_000
# ... unless the machine held it back: its cell thread waited for a CPU, beyond the others',
# for this share of what they waited for it, and spent less than this share more time on a
# CPU than they did (it did not do more work). The thread's own wait is a lower bound of
# the machine's part: its other threads (holding the GIL, running Gloo) wait too.
MACHINE_SHARE = 0.25
MORE_WORK_SHARE = 0.25


def size_of(op: str, rank_bytes: int, n: int) -> int:
    """S as nccl-tests counts it: all_gather's whole output (n inputs), the others' input."""
    return rank_bytes * n if op == "all_gather" else rank_bytes


@dataclass
class RankTime:
    rank: int
    wall_s: float
    compute_s: float
    collectives_s: float  # time inside collectives (from arrival to completion, merged)
    waiting_s: float  # of which, waiting for the last peer to arrive
    exposed_s: float  # communication the main thread did not overlap with its own work
    # the cell's thread: runnable but not running (waiting for a CPU), and on a CPU (Linux)
    cpu_wait_s: float | None = None
    cpu_busy_s: float | None = None


@dataclass
class OpTime:
    op: str
    count: int
    bytes: int  # S, as nccl-tests counts it
    mean_s: float  # from the last arrival to completion: the transfer itself
    algbw: float  # GB/s
    busbw: float  # GB/s


@dataclass
class Profile:
    cell: str
    world: list[int]
    ranks: dict[int, RankTime]
    ops: list[OpTime]
    verdict: str | None
    trace_path: str | None
    lanes: dict[int, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    span_s: float = 0.0
    cuda: bool = False  # GPU ranks: the table also shows exposed (not overlapped) communication
    #: a rank was last because it waited for a CPU: said instead of a verdict on the code
    machine: str | None = None
    #: ranks whose collectives the Flight Recorder did not record: nothing can be matched
    unrecorded: list[int] = field(default_factory=list)

    def finding(self) -> str:
        """The sentence under the tables: the verdict, the machine's part, or all clear."""
        if self.unrecorded:
            return (
                f"No verdict: torch's Flight Recorder, by which the profile matches each "
                f"collective across the ranks, recorded none of this cell's collectives on "
                f"rank{'s' if len(self.unrecorded) > 1 else ''} "
                f"{', '.join(map(str, self.unrecorded))} (torch before 2.8 records none on Gloo; "
                "TORCH_FR_BUFFER_SIZE=0 turns it off), so time in collectives, waiting for "
                "peers and compute are not known."
            )
        if self.verdict:
            return f"Verdict: {self.verdict}"
        if self.machine:
            return f"No rank's code holds the others back. {self.machine}"
        return "No rank holds the others back."

    def rank_columns(self) -> tuple[str, ...]:
        cols = ("rank", "wall", "compute", "collectives", "waiting for peers")
        return cols + ("exposed",) if self.cuda else cols

    def rank_cells(self, r: RankTime) -> tuple:
        def secs(value: float) -> str:
            return "?" if self.unrecorded else f"{value:.3f} s"

        cells = (
            r.rank,
            f"{r.wall_s:.3f} s",
            secs(r.compute_s),
            secs(r.collectives_s),
            secs(r.waiting_s),
        )
        return cells + (secs(r.exposed_s),) if self.cuda else cells

    def text(self) -> str:
        lines = [f"profile of {self.cell} on {len(self.world)} ranks"]
        cols = self.rank_columns()
        rows = [dict(zip(cols, self.rank_cells(r))) for r in self.ranks.values()]
        lines += format_table(cols, rows)
        if self.ops:
            lines.append("")
            lines += format_table(
                ("op", "count", "size", "mean time", "algbw", "busbw"),
                [
                    {
                        "op": o.op,
                        "count": o.count,
                        "size": _bytes_text(o.bytes),
                        "mean time": f"{o.mean_s * 1e3:.3f} ms",
                        "algbw": f"{o.algbw:.3f} GB/s",
                        "busbw": f"{o.busbw:.3f} GB/s",
                    }
                    for o in self.ops
                ],
            )
        lines.append("")
        lines.append(self.finding())
        if self.trace_path:
            lines.append(f"Trace (Perfetto, chrome://tracing): {self.trace_path}")
        return "\n".join(lines)

    __repr__ = text

    def _repr_html_(self) -> str:
        def table(cols, rows):
            head = "".join(f"<th style='padding:1px 8px;text-align:left'>{c}</th>" for c in cols)
            body = "".join(
                "<tr>"
                + "".join(f"<td style='padding:1px 8px'>{html.escape(str(v))}</td>" for v in row)
                + "</tr>"
                for row in rows
            )
            return f"<table style='font-size:12px;border-collapse:collapse'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        ranks = table(self.rank_columns(), [self.rank_cells(r) for r in self.ranks.values()])
        ops = table(
            ("op", "count", "size", "mean time", "algbw", "busbw"),
            [
                (
                    o.op,
                    o.count,
                    _bytes_text(o.bytes),
                    f"{o.mean_s * 1e3:.3f} ms",
                    f"{o.algbw:.3f} GB/s",
                    f"{o.busbw:.3f} GB/s",
                )
                for o in self.ops
            ],
        )
        verdict = (
            f"<div class='nd-profile-verdict' style='color:#e65100'><b>Verdict:</b> {html.escape(self.verdict)}</div>"
            if self.verdict
            else f"<div class='nd-profile-verdict' style='color:{'#777' if self.machine or self.unrecorded else '#43a047'}'>{html.escape(self.finding())}</div>"
        )
        trace = (
            f"<div style='color:#777;font-size:11px'>Trace (Perfetto, chrome://tracing): <code>{html.escape(self.trace_path)}</code></div>"
            if self.trace_path
            else ""
        )
        return (
            f"<div class='nd-profile' style='line-height:1.3'><b>profile of {html.escape(self.cell)}</b>"
            f"{ranks}<br>{ops}{verdict}{self.timeline_svg()}{trace}</div>"
        )

    def timeline_svg(self, width: int = 640) -> str:
        """One lane per rank: compute (blue), collectives (purple), waiting for peers (orange)."""
        if not self.lanes or self.span_s <= 0:
            return ""
        left, lane_h, gap = 56, 14, 6
        scale = (width - left - 10) / self.span_s
        colors = {"compute": "#42a5f5", "collective": "#8e24aa", "waiting": "#fb8c00"}
        parts = []
        y = 22
        for rank, lanes in sorted(self.lanes.items()):
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
            f"<text x='0' y='12' font-size='11' fill='#777'>timeline, {self.span_s:.3f} s</text>"
            + "".join(parts)
            + legend
            + "</svg>"
        )


def _bytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _coalesce(intervals: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    """Intervals closer than a pixel merged: a 10,000-step loop draws as bands, not rects."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s - out[-1][1] <= min_gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the (merged) intervals ``a`` that no interval of ``b`` covers."""
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def analyze(
    profiles: dict[int, dict[str, Any]],
    offsets: dict[int, int],
    cell: str = "the cell",
    trace_dir: str | None = None,
) -> Profile:
    """The ranks' profiles (``runtime.profiler.CellProfile.collect``) on the kernel's clock
    (``offsets``: each rank's clock minus the kernel's, in ns)."""
    world = sorted(profiles)
    n = len(world)
    shift = clock_shifts(profiles, offsets)

    def at(r: int, t: int) -> int:
        return t - shift[r]

    # collectives matched across ranks by process group and sequence number
    by_key: dict[tuple[str, Any], dict[int, dict]] = {}
    for r in world:
        for c in profiles[r]["collectives"]:
            c = dict(c, arrive=at(r, c["arrive"]), start=at(r, c["start"]), end=at(r, c["end"]))
            by_key.setdefault((c["group"], c["seq"]), {})[r] = c
    # each rank's time from its arrival to the last rank's (overlapping collectives, as
    # DDP's buckets are, count once)
    waiting: dict[int, list[tuple[int, int]]] = {r: [] for r in world}
    last_count: Counter = Counter()
    late_ns: dict[int, list[int]] = {r: [] for r in world}
    late_lines: dict[int, Counter] = {r: Counter() for r in world}
    matched = 0
    op_samples: dict[str, list[tuple[int, int]]] = {}
    for per_rank in by_key.values():
        if len(per_rank) < 2:
            continue
        matched += 1
        arrivals = {r: c["arrive"] for r, c in per_rank.items()}
        last_arrival = max(arrivals.values())
        for r, c in per_rank.items():
            if min(last_arrival, c["end"]) > c["arrive"]:
                waiting[r].append((c["arrive"], min(last_arrival, c["end"])))
        ordered = sorted(arrivals.items(), key=lambda kv: kv[1])
        late_rank, late_at = ordered[-1]
        lateness = late_at - ordered[-2][1]
        if lateness >= MIN_LATE_NS:
            last_count[late_rank] += 1
            late_ns[late_rank].append(lateness)
            line = per_rank[late_rank].get("line")
            if line is not None:
                late_lines[late_rank][line] += 1
        op = next(iter(per_rank.values()))["op"]
        done = statistics.median(c["end"] for c in per_rank.values())
        rank_bytes = max(c["bytes"] for c in per_rank.values())
        op_samples.setdefault(op, []).append((rank_bytes, max(0, int(done - last_arrival))))
    ranks: dict[int, RankTime] = {}
    lanes: dict[int, dict[str, list[tuple[float, float]]]] = {}
    t_min = min(at(r, profiles[r]["start"]) for r in world)
    t_max = max(at(r, profiles[r]["end"]) for r in world)
    for r in world:
        p = profiles[r]
        start, end = at(r, p["start"]), at(r, p["end"])
        colls = [(at(r, c["arrive"]), at(r, c["end"])) for c in p["collectives"]]
        colls = [(max(s, start), min(e, end)) for s, e in colls if e > s]
        busy = [(at(r, s), at(r, e)) for s, e in p["busy"]]
        in_colls = union(colls)
        exposed = _minus(in_colls, union(busy))
        waited = union(waiting[r])
        wall = max(0, end - start)
        ranks[r] = RankTime(
            rank=r,
            wall_s=wall / 1e9,
            compute_s=max(0, wall - _length(exposed)) / 1e9,
            collectives_s=_length(in_colls) / 1e9,
            waiting_s=_length(waited) / 1e9,
            exposed_s=_length(exposed) / 1e9,
            cpu_wait_s=None if p.get("cpu_wait") is None else p["cpu_wait"] / 1e9,
            cpu_busy_s=None if p.get("cpu_busy") is None else p["cpu_busy"] / 1e9,
        )

        def rel(intervals):
            return [((s - t_min) / 1e9, (e - t_min) / 1e9) for s, e in intervals]

        lanes[r] = {"compute": rel(busy), "collective": rel(in_colls), "waiting": rel(waited)}
    ops = []
    for op, samples in sorted(op_samples.items()):
        size = size_of(op, int(statistics.median(b for b, _ in samples)), n)
        mean_ns = statistics.fmean(t for _, t in samples)
        algbw = size / mean_ns if mean_ns > 0 else 0.0  # bytes per ns = GB/s
        ops.append(
            OpTime(
                op,
                len(samples),
                size,
                mean_ns / 1e9,
                algbw,
                algbw * BUS_FACTOR.get(op, lambda n: 1.0)(n),
            )
        )
    verdict = machine = None
    # where nothing could be matched, no rank can be called late
    unrecorded = [r for r in world if profiles[r].get("unrecorded")]
    found = (
        None if unrecorded else _straggler(ranks, matched, last_count, late_ns, late_lines, by_key)
    )
    if found:
        rank, fact, look = found
        if held := _held_by_machine(ranks, rank):
            machine = f"{fact[0].upper()}{fact[1:]} But {held}"
        else:
            verdict = f"{fact} {look}"
    path = write_trace(profiles, shift, t_min, cell, trace_dir)
    cuda = any(p.get("cuda") for p in profiles.values())
    return Profile(
        cell,
        world,
        ranks,
        ops,
        verdict,
        path,
        lanes,
        (t_max - t_min) / 1e9,
        cuda,
        machine,
        unrecorded,
    )


def clock_shifts(profiles: dict[int, dict[str, Any]], offsets: dict[int, int]) -> dict[int, int]:
    """What to take from each rank's times to put every rank on one clock. Ranks on one
    machine share its clock, so they share a shift. Between machines: where the ranks left
    one barrier as the cell began (``aligned``), that moment is the same moment on every
    machine, to within a message's flight; otherwise the kernel's estimate (``offsets``)."""
    machines: dict[Any, list[int]] = {}
    for r, p in profiles.items():
        machines.setdefault(p.get("clock") or ("rank", r), []).append(r)
    aligned = all(p.get("aligned") for p in profiles.values())
    shift = {}
    for ranks in machines.values():
        ranks.sort()
        value = (
            min(profiles[r]["aligned"] for r in ranks)
            if aligned and len(machines) > 1
            else offsets.get(ranks[0], 0)
        )
        for r in ranks:
            shift[r] = value
    return shift


def _held_by_machine(ranks: dict[int, RankTime], late: int) -> str | None:
    """Why the last rank was last, when the machine is the reason: the cell's thread on it
    sat runnable, waiting for a CPU, for a good part of the time the others waited for it,
    and it did no more work than they did. A rank that sleeps or reads data is not runnable
    while it does, and one that computes more is more time on a CPU: their verdict stands.
    Where the kernel keeps no schedstat, so does every verdict."""
    others = [r for r in ranks if r != late]
    if not others or any(ranks[r].cpu_wait_s is None for r in ranks):
        return None
    waited = statistics.fmean(ranks[r].waiting_s for r in others)
    more_wait = ranks[late].cpu_wait_s - statistics.fmean(ranks[r].cpu_wait_s for r in others)
    more_work = ranks[late].cpu_busy_s - statistics.fmean(ranks[r].cpu_busy_s for r in others)
    if waited <= 0 or more_wait < MACHINE_SHARE * waited or more_work >= MORE_WORK_SHARE * waited:
        return None
    theirs = ", ".join(f"rank {r}: {ranks[r].cpu_wait_s:.2f} s" for r in others)
    return (
        f"rank {late} itself waited {ranks[late].cpu_wait_s:.2f} s for a CPU ({theirs}), and "
        "computed no more than the others: the machine runs more busy processes than it has "
        "cores, and that, not the code, held it back. Profile again on a quieter machine, or "
        "with fewer ranks per machine."
    )


def _straggler(
    ranks, matched, last_count, late_ns, late_lines, by_key
) -> tuple[int, str, str] | None:
    """The rank that held the others back, what it cost them, and where to look."""
    if matched < 3 or not last_count:
        return None
    rank, times = last_count.most_common(1)[0]
    if times < STRAGGLER_SHARE * matched:
        return None
    others = [r for r in ranks if r != rank]
    waited = statistics.fmean(ranks[r].waiting_s for r in others)
    wall = statistics.fmean(ranks[r].wall_s for r in others) or 1e-9
    if waited < STRAGGLER_COST * wall:
        return None
    ops = Counter(
        c["op"]
        for per_rank in by_key.values()
        if rank in per_rank and len(per_rank) > 1
        for c in [per_rank[rank]]
    )
    op_text = ops.most_common(1)[0][0] + ("s" if matched > 1 else "")
    who = f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    fact = (
        f"rank {rank} arrived last at {times} of {matched} {op_text}, "
        f"{statistics.fmean(late_ns[rank]) / 1e6:.0f} ms late on average: {who} waited "
        f"{waited:.1f} s{' each' if len(others) > 1 else ''} ({100 * waited / wall:.0f}% of the cell)."
    )
    if late_lines[rank]:
        line = late_lines[rank].most_common(1)[0][0]
        return rank, fact, f"Look at what rank {rank} does before line {line}."
    return (
        rank,
        fact,
        f"Look at what rank {rank} computes between its collectives (torch issued these "
        "itself, as DDP does inside backward()).",
    )


def write_trace(
    profiles: dict[int, dict[str, Any]],
    shift: dict[int, int],
    t0: int,
    cell: str,
    folder: str | None,
) -> str | None:
    """One Chrome trace (JSON) of every rank: a process per rank, on the kernel's clock."""
    events: list[dict[str, Any]] = []
    tids = {"main": 0, "collectives": 1, "gpu": 2}
    for r, p in sorted(profiles.items()):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for lane, tid in tids.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}}
            )
        for e in p["trace"]:
            events.append(
                {
                    "name": e["name"],
                    "ph": "X",
                    "pid": r,
                    "tid": tids.get(e["lane"], 0),
                    "ts": (e["start"] - shift[r] - t0) / 1e3,
                    "dur": max(0, e["end"] - e["start"]) / 1e3,
                }
            )
        for c in p["collectives"]:
            events.append(
                {
                    "name": f"{c['op']} #{c['seq']} ({c['group']})",
                    "ph": "X",
                    "pid": r,
                    "tid": 3,
                    "ts": (c["arrive"] - shift[r] - t0) / 1e3,
                    "dur": max(0, c["end"] - c["arrive"]) / 1e3,
                    "args": {"bytes": c["bytes"], "line": c.get("line")},
                }
            )
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": r,
                "tid": 3,
                "args": {"name": "arrival to completion"},
            }
        )
    folder = folder or os.path.join(tempfile.gettempdir(), f"notebook_dist-profiles-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    name = "".join(ch if ch.isalnum() else "-" for ch in cell).strip("-") or "cell"
    path = os.path.join(folder, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
