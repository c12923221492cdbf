"""The ranks' profiles on one clock, matched collective by collective (process group and
sequence number, from torch's Flight Recorder): each rank's time waiting for its peers,
per op the transfer time and bandwidth, and a verdict when one rank holds the others back
(none when the machine did: the late rank waited for a CPU). Pure: no file is written."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..bandwidth import busbw, size_of
from ..phrases import rank_list
from ..runtime.profiler import union
from .model import OpTime, Profile, RankTime
from .trace import trace_events

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
# ... or the others waited for it no longer than this many times what a rank's threads
# waited for a CPU, on average over the ranks: on a machine so busy, a rank that is last by
# so little may be last by the scheduler's turns alone (Linux favours the thread that slept
# in a collective, so the same rank keeps arriving last), and its code is not blamed
MACHINE_NOISE = 1.5
# ... but never when its cell thread was off the CPU (neither on one nor waiting for one)
# outside its collectives for this share of what the others waited, beyond their own time
# off it: a thread that sleeps, reads or waits on a lock is not runnable, and no machine
# makes it so. Measured beside two burners: a rank sleeping 30 ms a step, 0.66-1.14 of the
# others' wait; balanced and computing ranks, within 0.07 either way.
OFF_CPU_SHARE = 0.5


def length(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
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
    profiles: dict[int, dict[str, Any]], offsets: dict[int, int], cell: str = "the cell"
) -> Profile:
    """The ranks' profiles (``runtime.profiler.CellProfile.collect``) on the kernel's clock
    (``offsets``: each rank's clock minus the kernel's, in ns). Computes; writes nothing
    (``Profile.save_trace`` writes the merged trace)."""
    world = sorted(profiles)
    shift = clock_shifts(profiles, offsets)
    m = _Matching(profiles, shift)
    t_min = min(profiles[r]["start"] - shift[r] for r in world)
    t_max = max(profiles[r]["end"] - shift[r] for r in world)
    ranks, lanes = {}, {}
    for r in world:
        ranks[r], lanes[r] = _rank_time(r, profiles[r], shift[r], m.waiting[r], t_min)
    verdict = machine = None
    # where nothing could be matched, no rank can be called late
    unrecorded = [r for r in world if profiles[r].get("unrecorded")]
    late = None if unrecorded else _straggler(ranks, m)
    if late:
        off = _off_cpu_beyond_the_others(ranks, late)
        if off is None and (held := _held_by_machine(ranks, late)):
            machine = f"{late.fact[0].upper()}{late.fact[1:]} But {held}"
        else:
            verdict = f"{late.fact} {_where_to_look(late, off)}"
    return Profile(
        cell,
        world,
        ranks,
        _op_times(m.op_samples, len(world)),
        verdict,
        None,
        lanes,
        (t_max - t_min) / 1e9,
        any(p.get("cuda") for p in profiles.values()),
        machine,
        unrecorded,
        trace_events(profiles, shift, t_min),
    )


class _Matching:
    """The collectives matched across ranks by process group and sequence number: each
    rank's time from its arrival to the last rank's, who arrived last and how late, and
    per op the transfer time from the last arrival."""

    def __init__(self, profiles: dict[int, dict[str, Any]], shift: dict[int, int]):
        world = sorted(profiles)
        self.by_key: dict[tuple[str, Any], dict[int, dict]] = {}
        for r in world:
            for c in profiles[r]["collectives"]:
                at = {k: c[k] - shift[r] for k in ("arrive", "start", "end")}
                self.by_key.setdefault((c["group"], c["seq"]), {})[r] = dict(c, **at)
        self.waiting: dict[int, list[tuple[int, int]]] = {r: [] for r in world}
        self.last_count: Counter = Counter()
        self.late_ns: dict[int, list[int]] = {r: [] for r in world}
        self.late_lines: dict[int, Counter] = {r: Counter() for r in world}
        self.matched = 0
        self.op_samples: dict[str, list[tuple[int, int]]] = {}
        for per_rank in self.by_key.values():
            if len(per_rank) >= 2:
                self._match(per_rank)

    def _match(self, per_rank: dict[int, dict]) -> None:
        self.matched += 1
        arrivals = {r: c["arrive"] for r, c in per_rank.items()}
        last_arrival = max(arrivals.values())
        for r, c in per_rank.items():  # overlapping waits (DDP's buckets) count once, later
            if min(last_arrival, c["end"]) > c["arrive"]:
                self.waiting[r].append((c["arrive"], min(last_arrival, c["end"])))
        ordered = sorted(arrivals.items(), key=lambda kv: kv[1])
        late_rank, late_at = ordered[-1]
        lateness = late_at - ordered[-2][1]
        if lateness >= MIN_LATE_NS:
            self.last_count[late_rank] += 1
            self.late_ns[late_rank].append(lateness)
            line = per_rank[late_rank].get("line")
            if line is not None:
                self.late_lines[late_rank][line] += 1
        op = next(iter(per_rank.values()))["op"]
        done = statistics.median(c["end"] for c in per_rank.values())
        rank_bytes = max(c["bytes"] for c in per_rank.values())
        self.op_samples.setdefault(op, []).append((rank_bytes, max(0, int(done - last_arrival))))


def _rank_time(r: int, p: dict, shift: int, waiting: list, t_min: int):
    """One rank's wall, compute, collectives, waiting and exposed time, and its lanes for
    the timeline (seconds from ``t_min``)."""
    start, end = p["start"] - shift, p["end"] - shift
    colls = [(c["arrive"] - shift, c["end"] - shift) for c in p["collectives"]]
    colls = [(max(s, start), min(e, end)) for s, e in colls if e > s]
    busy = [(s - shift, e - shift) for s, e in p["busy"]]
    in_colls = union(colls)
    exposed = minus(in_colls, union(busy))
    waited = union(waiting)
    wall = max(0, end - start)
    time = RankTime(
        rank=r,
        wall_s=wall / 1e9,
        compute_s=max(0, wall - length(exposed)) / 1e9,
        collectives_s=length(in_colls) / 1e9,
        waiting_s=length(waited) / 1e9,
        exposed_s=length(exposed) / 1e9,
        cpu_wait_s=None if p.get("cpu_wait") is None else p["cpu_wait"] / 1e9,
        cpu_busy_s=None if p.get("cpu_busy") is None else p["cpu_busy"] / 1e9,
        process_wait_s=None if p.get("process_wait") is None else p["process_wait"] / 1e9,
        off_cpu_s=None
        if p.get("cpu_wait") is None or p.get("cpu_busy") is None
        else (wall - length(exposed) - p["cpu_busy"] - p["cpu_wait"]) / 1e9,
    )

    def rel(intervals):
        return [((s - t_min) / 1e9, (e - t_min) / 1e9) for s, e in intervals]

    return time, {"compute": rel(busy), "collective": rel(in_colls), "waiting": rel(waited)}


def _op_times(op_samples: dict[str, list[tuple[int, int]]], n: int) -> list[OpTime]:
    """Per op: how many, S (nccl-tests' size), the mean transfer time, algbw and busbw."""
    ops = []
    for op, samples in sorted(op_samples.items()):
        size = size_of(op, int(statistics.median(b for b, _ in samples)), n)
        mean_s = statistics.fmean(t for _, t in samples) / 1e9
        ops.append(OpTime(op, len(samples), size, mean_s, *busbw(op, size, mean_s, n)))
    return ops


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


@dataclass(frozen=True)
class _Late:
    """The rank that held the others back, as :func:`_straggler` found it."""

    rank: int
    others: list[int]
    waited: float  # how long the others waited for it, on average (s)
    fact: str  # what it cost them, in words
    line: int | None  # the cell line it was late at most often (None: torch issued them)


def _held_by_machine(ranks: dict[int, RankTime], late: _Late) -> str | None:
    """Why the last rank was last, when the machine is the reason. Either the cell's thread
    on it sat runnable, waiting for a CPU, for a good part of the time the others waited
    for it, and it did no more work than they did; or the ranks' processes waited for a
    CPU about as long as the others waited for it. A rank that sleeps or reads data is not
    runnable while it does, and one that computes more is more time on a CPU: their verdict
    stands. Where the kernel keeps no schedstat, so does every verdict."""
    if late.waited <= 0:
        return None
    return _late_for_a_cpu(ranks, late) or _busy_machine(ranks, late)


def _waited_for(ranks: dict[int, RankTime], late: int) -> float:
    """How long the other ranks waited for ``late``, on average (0 where it is alone)."""
    others = [ranks[r].waiting_s for r in ranks if r != late]
    return statistics.fmean(others) if others else 0.0


def _off_cpu_beyond_the_others(ranks: dict[int, RankTime], late: _Late) -> float | None:
    """How much longer the last rank's cell thread was off the CPU outside its collectives
    (asleep, reading, on a lock) than the others' were, where that explains a good part
    (``OFF_CPU_SHARE``) of the others' wait for it; None otherwise, or without schedstat."""
    if not late.others or any(ranks[r].off_cpu_s is None for r in ranks):
        return None
    theirs = statistics.fmean(ranks[r].off_cpu_s for r in late.others)
    beyond = ranks[late.rank].off_cpu_s - theirs
    return beyond if late.waited > 0 and beyond >= OFF_CPU_SHARE * late.waited else None


def _where_to_look(late: _Late, off: float | None) -> str:
    """The verdict's advice: the line before which the last rank arrived late (or, for the
    collectives torch issued itself, between them), and whether it waited there or computed."""
    rank, line = late.rank, late.line
    if line is not None:
        where = f"before line {line}"
    else:
        where = f"between its collectives{_TORCH_ISSUED}"
    if off is None:
        return f"Look at what rank {rank} {'does' if line is not None else 'computes'} {where}."
    return (
        f"Rank {rank}'s cell thread spent {off:.2f} s more than the others' off the CPU outside "
        "collectives, neither computing nor waiting for a CPU: it slept, read data or waited "
        f"on a lock. Look at what rank {rank} waits for {where}."
    )


_TORCH_ISSUED = " (torch issued these itself, as DDP does inside backward())"


def _late_for_a_cpu(ranks: dict[int, RankTime], late: _Late) -> str | None:
    if any(ranks[r].cpu_wait_s is None or ranks[r].cpu_busy_s is None for r in ranks):
        return None
    rank, others, waited = late.rank, late.others, late.waited
    more_wait = ranks[rank].cpu_wait_s - statistics.fmean(ranks[r].cpu_wait_s for r in others)
    more_work = ranks[rank].cpu_busy_s - statistics.fmean(ranks[r].cpu_busy_s for r in others)
    if more_wait < MACHINE_SHARE * waited or more_work >= MORE_WORK_SHARE * waited:
        return None
    theirs = ", ".join(f"rank {r}: {ranks[r].cpu_wait_s:.2f} s" for r in others)
    return (
        f"rank {rank} itself waited {ranks[rank].cpu_wait_s:.2f} s for a CPU ({theirs}), and "
        "computed no more than the others: the machine runs more busy processes than it has "
        f"cores, and that, not the code, held it back. {_QUIETER}"
    )


def _busy_machine(ranks: dict[int, RankTime], late: _Late) -> str | None:
    if any(ranks[r].process_wait_s is None for r in ranks):
        return None
    machine = statistics.fmean(ranks[r].process_wait_s for r in ranks)
    if late.waited > MACHINE_NOISE * machine:
        return None
    return (
        f"each rank's threads waited {machine:.2f} s for a CPU on average, about as long: "
        "the machine runs more busy processes than it has cores, and it alone can keep one "
        f"rank last by this much, so rank {late.rank}'s code is not blamed. {_QUIETER}"
    )


_QUIETER = "Profile again on a quieter machine, or with fewer ranks per machine."


def _straggler(ranks: dict[int, RankTime], m: _Matching) -> _Late | None:
    """The rank that held the others back, what it cost them, and the cell line it was late
    at most often (None where torch issued the collectives itself)."""
    matched, last_count, late_ns, late_lines = m.matched, m.last_count, m.late_ns, m.late_lines
    if matched < 3 or not last_count:
        return None
    rank, times = last_count.most_common(1)[0]
    if times < STRAGGLER_SHARE * matched:
        return None
    others = [r for r in ranks if r != rank]
    waited = _waited_for(ranks, rank)
    wall = statistics.fmean(ranks[r].wall_s for r in others) or 1e-9
    if waited < STRAGGLER_COST * wall:
        return None
    ops = Counter(
        c["op"]
        for per_rank in m.by_key.values()
        if rank in per_rank and len(per_rank) > 1
        for c in [per_rank[rank]]
    )
    op_text = ops.most_common(1)[0][0] + ("s" if matched > 1 else "")
    who = rank_list(others)
    fact = (
        f"rank {rank} arrived last at {times} of {matched} {op_text}, "
        f"{statistics.fmean(late_ns[rank]) / 1e6:.0f} ms late on average: {who} waited "
        f"{waited:.1f} s{' each' if len(others) > 1 else ''} ({100 * waited / wall:.0f}% of the cell)."
    )
    line = late_lines[rank].most_common(1)[0][0] if late_lines[rank] else None
    return _Late(rank, others, waited, fact, line)
