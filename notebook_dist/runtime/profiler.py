"""A cell under torch.profiler on one rank (``%%distributed --profile``): what it collects.

Three sources, joined here and sent to the kernel in a compact form:

- the Flight Recorder: every collective this rank issued (its process group and sequence
  number, the same on every rank, so the kernel can match them across ranks), its sizes
  and dtypes, and when it was issued (the rank's *arrival*);
- torch.profiler: when each collective really ran (Gloo's ``gloo:*`` events on its worker
  threads; NCCL's kernels on the GPU), and what the main thread computed meanwhile;
- the collective tracker: the cell line that issued each collective the user called.

Times are Unix epoch nanoseconds of this rank's clock; the kernel aligns the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from .host import clock_id
from .state import STATE

MAX_EVENTS = 20_000  # per rank, for the merged trace: a long cell is cut, not sent whole
MARK = "notebook_dist::cell"
_warm = {"done": False}


def _profiler(torch, activities):
    """A torch.profiler for one cycle. Its events are kept across cycles (there is one):
    torch 2.11 warns at every start that they are not, unless asked to keep them."""
    import inspect

    keep = "acc_events" in inspect.signature(torch.profiler.profile).parameters
    return torch.profiler.profile(activities=activities, **({"acc_events": True} if keep else {}))


def _first_start(torch, activities) -> None:
    """Start and stop a profiler once, with what the C++ side prints to the process's
    stderr set aside: the engine imports torch on a background thread (to start faster),
    and kineto then says, harmlessly, that its client registered on another thread. The
    rest of what was printed meanwhile is written back."""
    import os
    import tempfile

    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            with _profiler(torch, activities):
                pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        said = caught.read().decode(errors="replace")
    rest = [line for line in said.splitlines(True) if "External init callback" not in line]
    if rest:
        os.write(2, "".join(rest).encode())


def _fr_entries() -> list[dict[str, Any]]:
    """Every collective the Flight Recorder holds for this rank's backend."""
    torch = sys.modules["torch"]
    c10d = torch._C._distributed_c10d
    dump = (
        c10d._dump_nccl_trace_json
        if STATE.backend == "nccl" and hasattr(c10d, "_dump_nccl_trace_json")
        else getattr(c10d, "_dump_fr_trace_json", None)
    )
    if dump is None:
        return []
    try:
        return json.loads(dump(True, False)).get("entries") or []
    except Exception:
        return []


def _schedstat_at(path: str) -> tuple[int, int] | None:
    """A thread's time on a CPU and its time runnable but waiting for one, in ns: Linux's
    schedstat. None where the kernel does not say."""
    try:
        with open(path) as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return None


def threads_schedstat() -> dict[str, tuple[int, int]] | None:
    """The schedstat of every thread of this process, by thread id: the cell's thread and
    those that run for it (Gloo's, torch's, the engine's). None where the kernel does not
    say."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    threads = {t: _schedstat_at(f"/proc/self/task/{t}/schedstat") for t in tids}
    return {t: v for t, v in threads.items() if v is not None} or None  # (some ended)


class CellProfile:
    """Starts before the cell, stops after it; :meth:`collect` is what the kernel gets."""

    def __init__(self, align: bool = True) -> None:
        import torch

        self.cuda = STATE.device.startswith("cuda") and torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not _warm["done"]:  # the first profiler in a process takes about a second to start
            _first_start(torch, activities)
            _warm["done"] = True
        if align:  # every rank starts the cell together: skew inside it is the cell's own
            barrier = torch.distributed.barrier
            getattr(barrier, "_notebook_dist_original", barrier)()
        # the ranks left that barrier together (within a message's flight): one moment on
        # every machine's clock, which puts machines on one clock better than a round trip
        self.aligned = time.time_ns() if align else None
        self.before = {(str(e.get("pg_id")), e.get("collective_seq_id")) for e in _fr_entries()}
        self.prof = _profiler(torch, activities)
        # spans the cell on the main thread: how the profiler numbers that thread
        self.mark = torch.autograd.profiler.record_function(MARK)
        self.t_start = self.t_end = 0
        self.tid = ""  # the cell's thread, which enters and exits this
        self.threads: list[dict[str, tuple[int, int]] | None] = []

    def __enter__(self) -> CellProfile:
        self.prof.__enter__()
        self.mark.__enter__()
        self.t_start = time.time_ns()
        self.tid = str(threading.get_native_id())
        self.threads = [threads_schedstat()]
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            sys.modules["torch"].cuda.synchronize()
        self.t_end = time.time_ns()
        self.threads.append(threads_schedstat())
        self.mark.__exit__(None, None, None)
        self.prof.__exit__(None, None, None)

    def collect(self, tracked: list[dict[str, Any]]) -> dict[str, Any]:
        """Collectives, the main thread's busy intervals and a trace, as plain data."""
        events = self.prof.profiler.kineto_results.events()
        main = next((e.start_thread_id() for e in events if e.name() == MARK), None)
        runs: list[tuple[str, int, int]] = []  # a collective running: gloo:* or an NCCL kernel
        busy: list[tuple[int, int]] = []  # the main thread computing (its CPU ops)
        trace: list[dict[str, Any]] = []
        for e in events:
            name, start = e.name(), e.start_ns()
            end = start + e.duration_ns()  # (torch 2.4's events have no end_ns())
            device = e.device_type().name
            if name.startswith("gloo:") or (device == "CUDA" and "nccl" in name.lower()):
                runs.append((_op_of(name), start, end))
                trace.append({"name": name, "start": start, "end": end, "lane": "collectives"})
            elif (
                device == "CPU"
                and e.start_thread_id() == main
                and not name.startswith((MARK, "c10d::", "record_param_comms"))
            ):
                busy.append((start, end))
                if len(trace) < MAX_EVENTS:
                    trace.append({"name": name, "start": start, "end": end, "lane": "main"})
            elif self.cuda and device == "CUDA" and len(trace) < MAX_EVENTS:
                trace.append({"name": name, "start": start, "end": end, "lane": "gpu"})
        entries = [
            e
            for e in _fr_entries()
            if (str(e.get("pg_id")), e.get("collective_seq_id")) not in self.before
        ]
        collectives = _join(entries, runs, tracked)
        return {
            "rank": STATE.rank,
            "start": self.t_start,
            "end": self.t_end,
            "collectives": collectives,
            "busy": union([(s, e) for s, e in busy if e > s]),
            "trace": trace[:MAX_EVENTS],
            "cuda": self.cuda,
            **_spent([(t or {}).get(self.tid) for t in self.threads]),
            **_spent_by_threads(self.threads),
            "clock": clock_id(),
            "aligned": self.aligned,
            # collectives ran, but the Flight Recorder (how ranks are matched) saw none
            "unrecorded": 0 if entries else len(runs) + sum(1 for t in tracked if t.get("seq")),
        }


def _spent(marks: list[tuple[int, int] | None]) -> dict[str, int]:
    """The cell thread's time on a CPU (``cpu_busy``) and waiting for one (``cpu_wait``)
    between two readings; nothing when either is missing."""
    if len(marks) != 2 or None in marks:
        return {}
    (busy0, wait0), (busy1, wait1) = marks
    return {"cpu_busy": busy1 - busy0, "cpu_wait": wait1 - wait0}


def _spent_by_threads(marks: list[dict[str, tuple[int, int]] | None]) -> dict[str, int]:
    """Every thread's time waiting for a CPU between two readings, summed over the threads
    (``process_wait``); a thread started between them counts from its start, one that
    ended is left out. Nothing when either reading is missing."""
    if len(marks) != 2 or None in marks:
        return {}
    before, after = marks
    return {"process_wait": sum(w - before.get(t, (0, 0))[1] for t, (_, w) in after.items())}


def _op_of(name: str) -> str:
    """'gloo:all_reduce' -> 'all_reduce'; an NCCL kernel 'ncclDevKernel_AllReduce_Sum_f32...'
    -> 'all_reduce'."""
    if ":" in name:
        return name.split(":", 1)[1]
    lowered = name.lower()
    for nccl, op in (
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("sendrecv", "all_to_all"),
        ("reduce", "reduce"),
    ):
        if nccl in lowered:
            return op
    return lowered


DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "Long": 8,
    "Byte": 1,
    "Char": 1,
    "Short": 2,
    "Bool": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}


def _bytes(entry: dict[str, Any]) -> int:
    """The bytes of one rank's input to a collective."""
    total = 0
    for size, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        n = 1
        for d in size:
            n *= int(d)
        total += n * DTYPE_BYTES.get(str(dtype), 4)
    return total


def _join(entries: list[dict], runs: list[tuple[str, int, int]], tracked: list[dict]) -> list[dict]:
    """Each Flight Recorder entry (arrival, group, sequence) with the run that executed it
    (the earliest unused one of the same op that started after the arrival) and the cell
    line that issued it (the tracked call of the same op nearest in time)."""
    used = [False] * len(runs)
    taken = [False] * len(tracked)
    out = []
    for e in sorted(entries, key=lambda e: e.get("time_created_ns", 0)):
        op = _op_of(str(e.get("profiling_name", "")))
        arrive = int(e.get("time_created_ns", 0))
        end = None
        start = None
        for i, (run_op, s, t) in enumerate(runs):
            if not used[i] and run_op == op and s >= arrive - 100_000:
                used[i] = True
                start, end = s, t
                break
        line = None
        best = None
        for j, rec in enumerate(tracked):
            if taken[j] or not op.startswith(rec["op"].split("_single")[0].split("_tensor")[0]):
                continue
            gap = abs(rec["t0"] * 1e9 - arrive)
            if gap < 5e6 and (best is None or gap < best[0]):
                best = (gap, j)
        if best is not None:
            taken[best[1]] = True
            where = tracked[best[1]].get("where")
            line = where[1] if where else None
            if end is None:  # the call returned when the collective was done
                end = int(tracked[best[1]].get("t1", 0) * 1e9) or None
        out.append(
            {
                "op": op,
                "group": str(
                    (e.get("process_group") or [e.get("pg_id"), ""])[-1] or e.get("pg_id")
                ),
                "seq": e.get("collective_seq_id"),
                "bytes": _bytes(e),
                "arrive": arrive,
                "start": start or arrive,
                "end": end or arrive,
                "line": line,
            }
        )
    return out


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching intervals merged, sorted (the profile's kernel side uses it too)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def clock() -> tuple[str, int]:
    """Which clock this rank reads, and its time, for the kernel to align the ranks."""
    return clock_id(), time.time_ns()
