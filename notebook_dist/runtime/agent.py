"""The agent thread on each rank: reports the rank's state while a cell runs.

Every ``interval`` seconds during a cell it publishes a snapshot through ipyparallel's
data channel (signed messages on the engine's existing IOPub socket, so no new port):
cell state, the collective the rank is in, the main thread's stack mapped to cell lines,
memory, and the metrics from ``nd.report``. It runs while the main thread is blocked in a
collective (the wait releases the GIL). It also watches a control file through which the
notebook asks it to release a collective that will never complete.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from .bars import bar_states
from .devices import gpu_state
from .state import STATE, rank_file
from .tracker import CELL_PREFIX, TRACKER, is_tool_frame

TICK_S = 0.1


def main_stack(limit: int = 16) -> list[dict[str, Any]]:
    """The main thread's Python stack, innermost last, from the first cell frame down.

    The tool's own frames (the tracker's wrapper) are left out. A deep stack keeps its
    cell frames and the library call the cell made, then the innermost frames: the
    middle becomes one placeholder frame (empty ``file``).
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        code = frame.f_code
        if not is_tool_frame(code.co_filename):
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    frames.reverse()
    start = next((i for i, f in enumerate(frames) if f[0].startswith(CELL_PREFIX)), None)
    frames = frames[start:] if start is not None else frames[-4:]
    import linecache

    out = [
        {"file": f, "line": ln, "func": fn, "code": linecache.getline(f, ln).strip()}
        for f, ln, fn in frames
    ]
    if len(out) <= limit:
        return out
    last_cell = (
        max(i for i, f in enumerate(out) if f["file"].startswith(CELL_PREFIX))
        if start is not None
        else -1
    )
    head = out[: last_cell + 2]  # the cell's frames and the call it made
    tail_n = max(limit - len(head), 4)
    if len(head) + tail_n >= len(out):
        return out
    skipped = len(out) - len(head) - tail_n
    gap = {"file": "", "line": 0, "func": f"... {skipped} frames ...", "code": ""}
    return [*head, gap, *out[-tail_n:]]


#: {pid: its /proc/self/statm, kept open}: read at every snapshot (an open, read and
#: close cost a tenth of an empty cell's time on the rank); a forked child opens its own
_STATM: dict[int, int] = {}


def _rss_bytes() -> int:
    pid = os.getpid()
    try:
        fd = _STATM.get(pid)
        if fd is None:
            fd = _STATM[pid] = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _fr_dump():
    """The Flight Recorder's JSON dump for this rank's backend: NCCL keeps its own recorder
    (``_dump_nccl_trace_json``, CUDA builds only); the generic one has Gloo's entries."""
    torch = sys.modules.get("torch")
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    if STATE.backend == "nccl" and hasattr(c10d, "_dump_nccl_trace_json"):
        return c10d._dump_nccl_trace_json
    return getattr(c10d, "_dump_fr_trace_json", None)


def fr_progress() -> dict[str, tuple[int, int]] | None:
    """Per process group: (last enqueued, last completed) collective, from the Flight
    Recorder's status alone (about 0.1 ms; the full trace can take 50 ms)."""
    import json

    dump = _fr_dump()
    if dump is None:
        return None
    try:
        status = json.loads(dump(False, False)).get("pg_status") or {}
    except Exception:
        return None
    return {
        pg: (
            int(st.get("last_enqueued_collective", -1)),
            int(st.get("last_completed_collective", -1)),
        )
        for pg, st in status.items()
    }


def in_flight_internal() -> dict[str, Any] | None:
    """The oldest collective torch issued that has not completed (DDP's gradient
    all_reduce, FSDP's gathers), from the Flight Recorder: those never pass our wrappers.

    On Gloo an entry's own state stays "scheduled"; the group's last completed sequence
    number tells which are still in flight.
    """
    import json

    dump = _fr_dump()
    if dump is None:
        return None
    try:
        trace = json.loads(dump(True, False))
    except Exception:
        return None
    done = {
        pg: int(st.get("last_completed_collective", -1))
        for pg, st in (trace.get("pg_status") or {}).items()
    }
    for entry in trace.get("entries") or []:
        pg = str(entry.get("pg_id"))
        if entry.get("collective_seq_id", -1) > done.get(pg, -1):
            return {
                "op": str(entry.get("profiling_name", "?")).split(":")[-1],
                "seq": entry.get("collective_seq_id"),
                "sizes": entry.get("input_sizes"),
                "dtypes": entry.get("input_dtypes"),
                "group": (entry.get("process_group") or [pg, ""])[-1],
                "state": entry.get("state"),  # NCCL: scheduled, started (its kernel runs)
            }
    return None


_stuck: dict[str, Any] = {"progress": None, "since": 0.0}


def _internal_if_stuck(now: float) -> dict[str, Any] | None:
    """The full trace only when torch has a collective in flight that has not moved for a
    second: a healthy training loop never pays for it."""
    progress = fr_progress()
    if not progress or not any(enq > done for enq, done in progress.values()):
        _stuck.update(progress=None)
        return None
    if progress != _stuck["progress"]:
        _stuck.update(progress=progress, since=now)
        return None
    if now - _stuck["since"] < 1.0:
        return None
    return in_flight_internal()


_gpu_busy: dict[str, float | None] = {"since": None}


def gpu_wait(now: float, nccl: dict[str, Any] | None) -> dict[str, Any] | None:
    """On a CUDA rank: whether the GPU still has work queued on this rank's default stream
    (cudaStreamQuery, from this thread), since when, and the NCCL collective torch has in
    flight if any. A host thread stuck in ``.item()``, ``.cpu()`` or
    ``torch.cuda.synchronize()`` waits for exactly that: a long kernel (busy), or a kernel
    that waits for a peer in an NCCL collective."""
    torch = sys.modules.get("torch")
    if torch is None or not STATE.device.startswith("cuda") or not torch.cuda.is_initialized():
        return None
    try:
        idle = torch.cuda.default_stream(torch.device(STATE.device)).query()
    except Exception:  # a poisoned context answers with an error: the doctor says so elsewhere
        return None
    if idle and nccl is None:
        _gpu_busy["since"] = None
        return None
    if _gpu_busy["since"] is None:
        _gpu_busy["since"] = now
    return {"nccl": nccl, "since": _gpu_busy["since"], "stream_idle": idle}


#: a snapshot's entries that are empty (None, or an empty list or dict) unless something
#: happened: a cell's reply leaves them out of its final snapshot (:func:`sparse`), which
#: the notebook reads, as every snapshot, with ``.get``
OFTEN_EMPTY = frozenset(
    ("internal", "collective", "threads", "history", "p2p_pending", "stack")
    + ("gpu", "gpu_wait", "metrics", "series", "asking", "bars")
)


def sparse(snap: dict[str, Any]) -> dict[str, Any]:
    """``snap`` without its empty :data:`OFTEN_EMPTY` entries (numbers are all kept): each
    rank's reply to every cell carries one, and half its entries are empty."""
    return {k: v for k, v in snap.items() if v or k not in OFTEN_EMPTY}


def snapshot(with_stack: bool = True) -> dict[str, Any]:
    now = time.time()
    current = TRACKER.current
    wait_s = TRACKER.wait_s + (now - current["t0"] if current else 0.0)
    stack = main_stack() if with_stack else []
    internal = _internal_if_stuck(now) if with_stack and current is None else None
    # on a GPU, what torch has in flight runs on the device: the host waits for the GPU
    gpu = gpu_wait(now, internal) if with_stack and current is None else None
    if gpu is not None:
        internal = None
    return {
        "internal": internal,
        "rank": STATE.rank,
        "pid": os.getpid(),
        "time": now,
        "cell_state": STATE.cell_state,
        "cell_started": STATE.cell_started,
        "cell_token": STATE.cell_token,  # which cell: the kernel never compares two clocks
        "collective": dict(current) if current else None,
        # collectives other threads issued in this cell and are in now, with their names
        # (one left waiting since an earlier cell is not this cell's: its numbers differ)
        "threads": [
            dict(r) for r in list(TRACKER.others.values()) if r["t0"] >= STATE.cell_started
        ],
        "history": [dict(r) for r in list(TRACKER.history)[-8:]],
        "collectives_done": TRACKER.count,
        # posted isend/irecv not completed: what a rank waits for in req.wait()
        "p2p_pending": TRACKER.pending_p2p() if current is None else [],
        "p2p_done": TRACKER.p2p_count,
        "wait_s": wait_s,
        "stack": stack,
        "rss": _rss_bytes(),
        "gpu": gpu_state(),
        "gpu_wait": gpu,
        "metrics": dict(STATE.metrics),
        "series": {
            k: [(float(x), float(y)) for x, y in list(v)] for k, v in list(STATE.series.items())
        },
        "reports": STATE.reports,
        "asking": dict(STATE.asking) if STATE.asking else None,
        "bars": bar_states(),  # (its progress bars: runtime/bars.py)
    }


class Agent(threading.Thread):
    def __init__(self, control_file: str | None, interval: float = 0.5):
        super().__init__(name="notebook_dist-agent", daemon=True)
        self.control_file = control_file
        # the notebook's answers to what this rank asks (runtime.debugger.ask)
        self.answer_file = (
            rank_file(os.path.dirname(control_file), "answer", STATE.rank) if control_file else None
        )
        self.interval = interval
        self._control_mtime = self._mtime()
        self._answer_mtime = self._mtime(self.answer_file)
        self._last_publish = 0.0
        self.stopped = threading.Event()

    def _mtime(self, path: str | None = "") -> float:
        path = self.control_file if path == "" else path
        if not path:
            return 0.0
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return 0.0

    def _take_answer(self) -> None:
        """The notebook wrote an answer ("id<TAB>text") for what this rank asked."""
        mtime = self._mtime(self.answer_file)
        if mtime == self._answer_mtime:
            return
        self._answer_mtime = mtime
        try:
            with open(self.answer_file) as f:
                request, _, text = f.read().partition("\t")
        except OSError:
            return
        if request.isdigit():
            STATE.answers.put((int(request), text))

    def _requested_token(self) -> str | None:
        try:
            with open(self.control_file) as f:
                return f.read().strip()
        except OSError:
            return None

    def run(self) -> None:
        from .recover import release_cell

        while not self.stopped.wait(TICK_S):
            try:
                mtime = self._mtime()
                if mtime != self._control_mtime:
                    self._control_mtime = mtime
                    # only for the cell it names, and only while that cell runs: a late
                    # request must never close the connections of a rebuilt group
                    released = release_cell(self._requested_token() or "")
                    if released is not None:
                        STATE.extras["released"] = released
                if STATE.asking is not None:
                    self._take_answer()
                now = time.monotonic()
                if STATE.cell_state == "running" and now - self._last_publish >= self.interval:
                    self._last_publish = now
                    publish(snapshot())
            except Exception:  # never let the agent die: it is how hangs get explained
                time.sleep(self.interval)


def publish(data: dict[str, Any]) -> None:
    try:
        from ipyparallel.datapub import publish_data
    except ImportError:
        return
    try:
        publish_data({"nd": data})
    except Exception:
        pass
