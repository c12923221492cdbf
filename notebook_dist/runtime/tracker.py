"""Collective tracking on a rank: which collective it is in, issued from which cell line.

Wraps the public collectives of ``torch.distributed`` with a few attribute writes per
call (no I/O, no locks): a per-group sequence number, the op, shapes and dtypes of the
tensors, and the cell line that called it. Point-to-point ops (``send``, ``recv``,
``isend``, ``irecv``, ``batch_isend_irecv``) are tracked apart, with their peer and tag:
they take no part in the collective order, and a posted ``isend``/``irecv`` stays
"pending" until its work completes, so the doctor can see what a rank waits for in
``req.wait()``. Collectives issued from inside torch (DDP's gradient all_reduce, FSDP's
gathers) are not seen here; the agent reads them from the Flight Recorder.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import deque
from typing import Any

from .state import STATE as _STATE

CELL_PREFIX = "Cell In["
#: frames from this folder are the tool's own: hidden from what the user sees
RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
#: blocking point-to-point ops: the rank is inside them until the peer takes part
P2P_BLOCKING = ("send", "recv", "send_object_list", "recv_object_list")
#: posting point-to-point ops: they return a work at once; the wait comes later
P2P_POSTING = ("isend", "irecv")
P2P = (*P2P_BLOCKING, *P2P_POSTING, "batch_isend_irecv")
#: the direction of each point-to-point op
SENDS = ("send", "isend", "send_object_list")
MAX_PENDING = 64
#: the root every rank must name alike: broadcast from src, reduce to dst, ...
ROOTS = {
    "broadcast": "src",
    "broadcast_object_list": "src",
    "scatter": "src",
    "scatter_object_list": "src",
    "reduce": "dst",
    "gather": "dst",
    "gather_object": "dst",
}
#: collectives with a reduce op, which every rank must pass alike
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")


def is_tool_frame(filename: str) -> bool:
    """A frame of the rank runtime itself (the tracker's wrapper, the agent, the cell
    runner): never shown in a traceback or a stack."""
    return filename.startswith(RUNTIME_DIR)


class Tracker:
    """What this rank's collectives are doing; read by the agent thread.

    The cell runs in the main thread: ``current`` and ``last`` are its collectives. One
    issued from another thread (an asynchronous checkpoint save, a data-loader thread) is
    tracked too, in ``others`` while it runs (by thread), named with its thread; the nesting
    guard is per thread, so one thread inside a collective never hides another's."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.current: dict[str, Any] | None = None
        #: thread ident -> the collective another thread is in now
        self.others: dict[int, dict[str, Any]] = {}
        self._local = threading.local()
        self._seq_lock = threading.Lock()
        self.history: deque[dict[str, Any]] = deque(maxlen=32)
        #: posted isend/irecv not yet seen completed: (record, work)
        self.pending: deque[tuple[dict[str, Any], Any]] = deque(maxlen=MAX_PENDING)
        #: the last collective or blocking point-to-point op that ran (or failed)
        self.last: dict[str, Any] | None = None
        self.wait_s = 0.0  # time spent inside collectives since the cell started
        self.count = 0
        self.p2p_count = 0
        #: compare every collective's arguments across ranks first (runtime.argcheck)
        self.check = False
        self.device = "cpu"
        #: the current collective, written where the notebook can read it after the rank
        #: dies (a Gloo abort leaves no snapshot of what the rank passed): see persist()
        self.blackbox = None

    def reset_cell(self, keep_all: bool = False) -> None:
        """``keep_all``: the cell's every collective stays in ``history`` (a profiled cell
        names each one's line), not only its last 32."""
        # numbered per cell: "collective #3" is the cell's third, on every rank alike,
        # even when an earlier cell was interrupted with the ranks at different counts
        self.seq.clear()
        self.history = deque(maxlen=None if keep_all else 32)
        self.pending.clear()
        self.last = None
        self.wait_s = 0.0
        self.count = 0
        self.p2p_count = 0

    @property
    def depth(self) -> int:
        """How deep this thread is in tracked calls (a collective built on another)."""
        return getattr(self._local, "depth", 0)

    @depth.setter
    def depth(self, value: int) -> None:
        self._local.depth = value

    def next_seq(self, group: str) -> int:
        with self._seq_lock:  # threads share a group's numbering, as torch's own does
            seq = self.seq[group] = self.seq.get(group, 0) + 1
        return seq

    def pending_p2p(self) -> list[dict[str, Any]]:
        """The posted point-to-point ops whose work has not completed (agent thread)."""
        out = []
        for rec, work in list(self.pending):
            try:
                completed = work is None or work.is_completed()
            except Exception:  # a failed work counts as done: its wait raises
                completed = True
            if not completed:
                out.append(dict(rec))
        return out


TRACKER = Tracker()
_MAIN_THREAD = threading.main_thread().ident
_group_names: dict[int, tuple[str, tuple[int, ...] | None]] = {}


def _describe(value: Any) -> tuple[list, list]:
    torch = sys.modules["torch"]
    shapes, dtypes = [], []
    if isinstance(value, torch.Tensor):
        shapes.append(tuple(value.shape))
        dtypes.append(str(value.dtype).removeprefix("torch."))
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        shapes.append([tuple(t.shape) for t in value[:8]])
        dtypes.append(str(value[0].dtype).removeprefix("torch."))
    return shapes, dtypes


def forget_groups() -> None:
    """Forget the names of process groups (keyed by object id): after a rebuild the old
    groups are gone, and a new object may take an old one's id."""
    _group_names.clear()


def _group(group: Any) -> tuple[str, tuple[int, ...] | None]:
    if group is None:
        return "default", None
    key = id(group)
    known = _group_names.get(key)
    if known is None:
        dist = sys.modules["torch.distributed"]
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except Exception:
            ranks = None
        name = getattr(group, "group_name", None) or f"group-{len(_group_names) + 1}"
        known = _group_names[key] = (str(name), ranks)
    return known


def locate(rec: dict[str, Any]) -> dict[str, Any]:
    """Where in the notebook the op was called: ``where``, the innermost frame in a cell
    (filename, line); when that frame is a function's, ``func`` (its name) and ``site``,
    the line of the running cell that called into it (a helper defined in an earlier cell
    is in that cell's file, so its line alone would name the wrong cell)."""
    f = sys._getframe(1)  # outward from the caller: our own frames are in no cell
    inner = site = func = None
    running = _STATE.cell_file
    for _ in range(60):
        if f is None:
            break
        code = f.f_code
        name = code.co_filename
        if name.startswith(CELL_PREFIX):
            if inner is None:
                inner = (name, f.f_lineno)
                if code.co_name != "<module>":
                    func = code.co_name
            if name == running:
                site = (name, f.f_lineno)
                if code.co_name == "<module>":
                    break  # the running cell's own body: nothing outward is the user's
        f = f.f_back
    rec["where"] = inner
    if func is not None:
        rec["func"] = func
        if site is not None and site != inner:
            rec["site"] = site
    return rec


def agreeing_args(op: str, bound: dict[str, Any], group_ranks) -> dict[str, Any]:
    """The arguments besides tensors that every rank must pass alike: the root (``src`` or
    ``dst``, as a global rank), the reduce op; and ``async_op``, which need not agree but
    is said."""
    out: dict[str, Any] = {}
    root = ROOTS.get(op)
    if root is not None:
        value, in_group = bound.get(root), bound.get(f"group_{root}")
        if value is None and in_group is not None:
            value = (
                group_ranks[in_group] if group_ranks and in_group < len(group_ranks) else in_group
            )
        out[root] = None if value is None else int(value)
    if op in REDUCING:
        out["reduce_op"] = _reduce_name(bound.get("op"))
    out["async_op"] = bool(bound.get("async_op", False))
    return out


def _reduce_name(value: Any) -> str:
    if value is None:
        return "SUM"
    name = getattr(value, "name", None)  # ReduceOp.SUM is a RedOpType
    return str(name) if name else str(value).rsplit(".", 1)[-1]


def _bound(fn, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (peer, tag, group, src), as the op's signature names
    them: positional ones matched to its parameter names (a wrong call is torch's to
    refuse), keywords as given. On every collective's path: no signature binding."""
    names = _param_names.get(fn)
    if names is None:
        import inspect

        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = ()
        _param_names[fn] = names
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


_param_names: dict[Any, tuple[str, ...]] = {}


def p2p_record(op: str, tensor: Any, peer: Any, group_peer: Any, group: Any, tag: Any) -> dict:
    """A point-to-point op: its direction, peer (a global rank; None: any source) and tag."""
    gname, granks = _group(group)
    if peer is None and group_peer is not None:
        peer = granks[group_peer] if granks and group_peer < len(granks) else group_peer
    shapes, dtypes = _describe(tensor) if tensor is not None else ([], [])
    return {
        "kind": "p2p",
        "op": op,
        "direction": "send" if op in SENDS else "recv",
        "peer": None if peer is None else int(peer),
        "tag": int(tag or 0),
        "group": gname,
        "group_ranks": granks,
        "shapes": shapes,
        "dtypes": dtypes,
        "where": None,
        "t0": time.time(),
    }


def _p2p_from_call(op: str, fn, args: tuple, kwargs: dict) -> dict:
    a = _bound(fn, args, kwargs)
    if op in SENDS:
        peer, group_peer = a.get("dst"), a.get("group_dst")
    else:
        peer, group_peer = a.get("src"), a.get("group_src")
    tensor = a.get("tensor", a.get("object_list"))
    if op.endswith("object_list"):
        tensor = None
    return p2p_record(op, tensor, peer, group_peer, a.get("group"), a.get("tag", 0))


def _wrap_collective(op: str, fn):
    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        t = TRACKER
        if t.depth:  # a collective built on another (all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        bound = _bound(fn, args, kwargs)
        group, group_ranks = _group(bound.get("group"))
        seq = t.next_seq(group)
        values = list(bound.values())
        shapes, dtypes = _describe(values[0]) if values else ([], [])
        if op in ("all_gather", "all_to_all") and len(values) > 1:
            s2, d2 = _describe(values[1])
            shapes, dtypes = shapes + s2, dtypes + d2
        rec = {
            "seq": seq,
            "op": op,
            "group": group,
            "group_ranks": group_ranks,
            "shapes": shapes,
            "dtypes": dtypes,
            "args": agreeing_args(op, bound, group_ranks),
            "t0": time.time(),
        }
        locate(rec)
        if t.blackbox is not None:
            persist(t.blackbox, rec)
        before = None
        if t.check:
            from .argcheck import check

            def before():
                check(rec, bound.get("group"), t.device)

        try:
            return _run(t, rec, fn, args, kwargs, history=True, before=before)
        finally:
            if t.blackbox is not None:  # ended: a death from now on was not in it
                t.blackbox[0] = 0

    tracked._notebook_dist_original = fn
    return tracked


def _wrap_p2p(op: str, fn):
    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        t = TRACKER
        if t.depth:  # send_object_list -> send
            return fn(*args, **kwargs)
        if op == "batch_isend_irecv":
            return _batch(t, fn, args, kwargs)
        rec = locate(_p2p_from_call(op, fn, args, kwargs))
        if op in P2P_POSTING:
            t.depth = 1
            try:
                work = fn(*args, **kwargs)
            finally:
                t.depth = 0
            t.p2p_count += 1
            t.pending.append((rec, work))
            return work
        t.p2p_count += 1
        return _run(t, rec, fn, args, kwargs, history=False)

    tracked._notebook_dist_original = fn
    return tracked


def _batch(t: Tracker, fn, args: tuple, kwargs: dict):
    ops = args[0] if args else kwargs.get("p2p_op_list", [])
    here = locate({})
    recs = []
    for p in ops or []:
        name = getattr(getattr(p, "op", None), "__name__", "")
        rec = p2p_record(
            "isend" if name == "isend" else "irecv",
            getattr(p, "tensor", None),
            getattr(p, "peer", None),
            getattr(p, "group_peer", None),
            getattr(p, "group", None),
            getattr(p, "tag", 0),
        )
        rec.update(here, batch=True)
        recs.append(rec)
    t.depth = 1
    try:
        works = fn(*args, **kwargs)
    finally:
        t.depth = 0
    t.p2p_count += len(recs)
    # one work may stand for the whole batch (NCCL coalesces): then it guards every op
    works = list(works or [])
    for i, rec in enumerate(recs):
        t.pending.append((rec, works[i] if i < len(works) else (works[-1] if works else None)))
    return works


def _run(t: Tracker, rec: dict, fn, args: tuple, kwargs: dict, history: bool, before=None):
    ident = threading.get_ident()
    main = ident == _MAIN_THREAD
    if main:
        t.current = rec
    else:
        rec["thread"] = threading.current_thread().name
        t.others[ident] = rec
    t.depth = 1
    try:
        if before is not None:
            before()
        return fn(*args, **kwargs)
    except BaseException as exc:
        rec["failed"] = True  # the kernel tells a release's consequence from a cause
        # torch's timeout or a closed pair leaves the group unusable even when the user's
        # code catches the error (or another thread's does): the cell's reply says so
        from .group import note_failure

        note_failure(exc, in_collective=True, record=rec)
        raise
    finally:
        t.depth = 0
        if main:
            t.current = None
            t.last = rec
        else:
            t.others.pop(ident, None)
        rec["t1"] = time.time()
        t.wait_s += rec["t1"] - rec["t0"]
        t.count += 1
        if history:
            t.history.append(rec)


BLACKBOX_SIZE = 1024


def open_blackbox(path: str):
    """A small file, mapped into memory, that holds the current collective's record:
    written with a copy into memory per collective (no system call), read by the notebook
    when the rank has died (``notebook_dist.cluster.reports.rank_report``)."""
    import mmap

    with open(path, "w+b") as f:
        f.truncate(BLACKBOX_SIZE)
        return mmap.mmap(f.fileno(), BLACKBOX_SIZE)


def persist(box, rec: dict[str, Any]) -> None:
    keep = {k: rec.get(k) for k in ("op", "seq", "group", "shapes", "dtypes", "args", "where")}
    data = repr(keep).encode()[: BLACKBOX_SIZE - 1]
    box[: len(data) + 1] = data + b"\0"


def read_blackbox(text: str) -> dict[str, Any] | None:
    """The record :func:`persist` wrote (kernel side), or None."""
    import ast

    try:
        rec = ast.literal_eval(text.split("\0", 1)[0])
    except (ValueError, SyntaxError):
        return None
    return rec if isinstance(rec, dict) and rec.get("op") else None


def install(dist_module) -> None:
    """Wrap the collectives and point-to-point ops on ``torch.distributed`` and
    ``distributed_c10d`` (once)."""
    c10d = dist_module.distributed_c10d
    for op in (*COLLECTIVES, *P2P):
        fn = getattr(c10d, op, None) or getattr(dist_module, op, None)
        if fn is None or hasattr(fn, "_notebook_dist_original"):
            continue
        wrapped = (_wrap_p2p if op in P2P else _wrap_collective)(op, fn)
        for module in (dist_module, c10d):
            if getattr(module, op, None) is fn:
                setattr(module, op, wrapped)
