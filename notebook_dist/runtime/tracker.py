"""Collective tracking on a rank: which collective it is in, issued from which cell line.

Wraps the public collectives of ``torch.distributed`` with a few attribute writes per
call (no I/O, no locks): a per-group sequence number, the op, shapes and dtypes of the
tensors, and the cell line that called it. Collectives issued from inside torch (DDP's
gradient all_reduce, FSDP's gathers) are not seen here; the stack sampled by the agent
shows where they came from (``loss.backward()`` at a cell line).
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from typing import Any

CELL_PREFIX = "Cell In["

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "gather",
    "scatter",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "batch_isend_irecv",
)


class Tracker:
    """What this rank's collectives are doing; read by the agent thread."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.current: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=32)
        self.depth = 0
        self.wait_s = 0.0  # time spent inside collectives since the cell started
        self.count = 0

    def reset_cell(self) -> None:
        # numbered per cell: "collective #3" is the cell's third, on every rank alike,
        # even when an earlier cell was interrupted with the ranks at different counts
        self.seq.clear()
        self.history.clear()
        self.wait_s = 0.0
        self.count = 0


TRACKER = Tracker()
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


def cell_line() -> tuple[str, int] | None:
    """(filename, line) of the innermost frame in a notebook cell, if any."""
    f = sys._getframe(2)
    for _ in range(40):
        if f is None:
            return None
        if f.f_code.co_filename.startswith(CELL_PREFIX):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return None


def _wrap(op: str, fn):
    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        t = TRACKER
        if t.depth:  # a collective built on another (all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        group, group_ranks = _group(kwargs.get("group"))
        seq = t.seq.get(group, 0) + 1
        t.seq[group] = seq
        shapes, dtypes = _describe(args[0]) if args else ([], [])
        if op in ("all_gather", "all_to_all") and len(args) > 1:
            s2, d2 = _describe(args[1])
            shapes, dtypes = shapes + s2, dtypes + d2
        rec = {
            "seq": seq,
            "op": op,
            "group": group,
            "group_ranks": group_ranks,
            "shapes": shapes,
            "dtypes": dtypes,
            "where": cell_line(),
            "t0": time.time(),
        }
        t.current = rec
        t.depth = 1
        try:
            return fn(*args, **kwargs)
        except BaseException:
            rec["failed"] = True  # the kernel tells a release's consequence from a cause
            raise
        finally:
            t.depth = 0
            t.current = None
            rec["t1"] = time.time()
            t.wait_s += rec["t1"] - rec["t0"]
            t.count += 1
            t.history.append(rec)

    tracked._notebook_dist_original = fn
    return tracked


def install(dist_module) -> None:
    """Wrap the collectives on ``torch.distributed`` and ``distributed_c10d`` (once)."""
    c10d = dist_module.distributed_c10d
    for op in COLLECTIVES:
        fn = getattr(c10d, op, None) or getattr(dist_module, op, None)
        if fn is None or hasattr(fn, "_notebook_dist_original"):
            continue
        wrapped = _wrap(op, fn)
        for module in (dist_module, c10d):
            if getattr(module, op, None) is fn:
                setattr(module, op, wrapped)
