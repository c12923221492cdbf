"""What a running rank waits in, one class per kind, each with its words, its table row
and its cell line: a tracked collective, a point-to-point op (a blocking ``send``/``recv``,
or a posted ``isend``/``irecv`` not seen complete), a collective torch issued itself (the
Flight Recorder's in-flight entry, or one seen only in the stack), the gradient
collectives of ``backward()``, or the GPU (a long kernel, or an NCCL collective)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .stacks import collective_in_stack, in_backward, library_call, stack_line
from .words import call_text, cell_line, gpu_text, internal_op, p2p_text, shape_text, thread_of


@dataclass
class Wait:
    kind: ClassVar[str] = ""
    op: str
    record: dict[str, Any] = field(default_factory=dict)
    # p2p: the direction, the peer (None: any source) and the tag of each op waited on
    p2p: list[dict[str, Any]] = field(default_factory=list)

    def text(self, f, r: int) -> str:
        """What rank r waits in, and where: 'all_reduce #2 at line 6' (``f``: the cell's
        ``facts.Facts``, as in every method here)."""
        raise NotImplementedError

    def row(self, f, r: int) -> dict[str, str]:
        """The table's state, op, shapes, where and waiting columns."""
        raise NotImplementedError

    def line(self, f, r: int) -> int | None:
        """The running cell's line of what rank r waits in."""
        return stack_line(f.snaps[r].get("stack"), f.cell_file)[1]


def _row(state="", op="", shapes="", where="", waiting="") -> dict[str, str]:
    return {"state": state, "op": op, "shapes": shapes, "where": where, "waiting": waiting}


class CollectiveWait(Wait):
    kind = "collective"

    def text(self, f, r):
        rec = self.record
        return f"{rec['op']} #{rec['seq']} at {call_text(rec, f.cell_file)}{thread_of(rec)}"

    def row(self, f, r):
        rec = self.record
        group = "" if rec["group"] == "default" else f" ({rec['group']})"
        return _row(
            f"in collective #{rec['seq']}{group}{thread_of(rec)}",
            rec["op"],
            shape_text(rec["shapes"]),
            call_text(rec, f.cell_file),
            f"{f.waited(r, rec):.1f} s",
        )

    def line(self, f, r):
        if self.record.get("where"):
            return cell_line(self.record, f.cell_file)
        return super().line(f, r)


class P2PWait(Wait):
    kind = "p2p"

    def where(self, f, r) -> str:
        """The blocking call's line, or for posted ops the line the main thread waits at
        (``req.wait()``) and where they were posted."""
        rec = self.record
        posted = call_text(rec, f.cell_file)
        if rec is f.snaps[r].get("collective"):
            return posted
        now, _ = stack_line(f.snaps[r].get("stack"), f.cell_file)
        return f"{now} (posted at {posted})" if now not in ("?", posted) else posted

    def text(self, f, r):
        return f"{', '.join(p2p_text(p) for p in self.p2p[:3])} at {self.where(f, r)}"

    def row(self, f, r):
        rec = self.record
        more = f" (+{len(self.p2p) - 1} more)" if len(self.p2p) > 1 else ""
        return _row(
            f"in {p2p_text(rec)}{more}",
            rec["op"],
            shape_text(rec.get("shapes") or []),
            self.where(f, r),
            f"{f.waited(r, rec):.1f} s",
        )

    line = CollectiveWait.line


def _sizes(rec: dict) -> str:
    return ", ".join(str(tuple(x)) for x in rec.get("sizes") or [])


class InternalWait(Wait):
    kind = "internal"

    def text(self, f, r):
        call = library_call(f.snaps[r].get("stack"))
        inside = f" inside {call['func']}()" if call else ""
        return f"{internal_op(self.record)} (issued by torch{inside}) at {f.stack_at(r)}"

    def row(self, f, r):
        op = f"{internal_op(self.record).removeprefix('a ')} (torch)"
        return _row("in an internal collective", op, _sizes(self.record), f.stack_at(r))


class BackwardWait(Wait):
    kind = "backward"

    def text(self, f, r):
        return f"the gradient all_reduce inside backward() at {f.stack_at(r)}"

    def row(self, f, r):
        rec = self.record
        op = f"{internal_op(rec).removeprefix('a ')} (torch)" if rec.get("op") else ""
        return _row("in backward (DDP/FSDP collectives)", op, _sizes(rec), f.stack_at(r))


class GpuWait(Wait):
    kind = "gpu"

    def text(self, f, r):
        return f"the GPU ({gpu_text(self.record)}) at {f.stack_at(r)}"

    def row(self, f, r):
        nccl = self.record.get("nccl")
        since = {"t0": self.record.get("since", f.now)}
        return _row(
            "waiting on the GPU" if nccl else "busy on the GPU",
            f"{nccl['op']} (NCCL)" if nccl else "kernel",
            _sizes(nccl or {}),
            f.stack_at(r),
            f"{f.waited(r, since):.1f} s",
        )


class DebuggerWait(Wait):
    """A rank stopped in the debugger (or at input()), waiting for the notebook's user."""

    kind = "debugger"

    def _at(self, f) -> str:
        where = self.record.get("where")
        if not where:
            return "?"
        return f"line {where[1]}" if where[0] == f.cell_file else f"{where[0]}, line {where[1]}"

    def text(self, f, r):
        what = "the debugger" if self.op == "pdb" else "input()"
        return f"{what} at {self._at(f)}, waiting for you"

    def row(self, f, r):
        state = "in the debugger" if self.op == "pdb" else "waiting for input()"
        return _row(state, "", "", self._at(f))

    def line(self, f, r):
        where = self.record.get("where")
        return where[1] if where and where[0] == f.cell_file else None


def wait_of(snap: dict) -> Wait | None:
    """What a running rank's snapshot says it waits in, if anything."""
    asking = snap.get("asking")
    if asking:  # its user's turn: never a hang
        return DebuggerWait(asking.get("kind", "input"), asking)
    coll = snap.get("collective")
    if coll and coll.get("kind") == "p2p":
        return P2PWait(coll["op"], coll, [coll])
    if coll:
        return CollectiveWait(coll["op"], coll)
    others = [r for r in snap.get("threads") or [] if r.get("kind") != "p2p"]
    if others:  # the cell's thread waits for another (join), which is in a collective
        return CollectiveWait(others[0]["op"], others[0])
    pending = snap.get("p2p_pending") or []
    if pending:
        return P2PWait(pending[0]["op"], pending[0], list(pending))
    internal = snap.get("internal") or {}
    if in_backward(snap.get("stack")):  # DDP's gradient buckets, FSDP's reduce-scatters
        return BackwardWait(internal.get("op", "all_reduce"), internal)
    if internal:
        return InternalWait(internal["op"], internal)
    gpu = snap.get("gpu_wait")
    if gpu:  # the host thread waits for the GPU: a long kernel, or an NCCL collective
        return GpuWait((gpu.get("nccl") or {}).get("op", "kernel"), gpu)
    seen = collective_in_stack(snap.get("stack"))
    if seen:  # the Flight Recorder is blind, the stack is not
        return InternalWait(seen["op"], seen)
    return None
