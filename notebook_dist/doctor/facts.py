"""What the rules read: the per-rank snapshots, sorted once into plain facts.

A rank is in exactly one *wait*: a tracked collective, a point-to-point op (a blocking
``send``/``recv``, or a posted ``isend``/``irecv`` it has not seen complete), a
collective torch issued itself (the Flight Recorder's in-flight entry, or ``backward()``
for DDP/FSDP), or none (running Python, or ended). The table rows come from the same
facts as the verdicts, so a verdict cannot see a rank differently from its row.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ..phrases import rank_list

RANK_WORDS = ("rank", "is_main", "local_rank")
# how a collective fails when a peer's connections close under it (a peer that died or was
# released); torch-internal ones, such as DDP's gradient all_reduce, never pass the tracker
TRANSPORT_ERROR = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe", re.IGNORECASE
)
CELL_PREFIX = "Cell In["


@dataclass
class Wait:
    """What a running rank waits in."""

    kind: str  # collective, p2p, internal, backward
    op: str
    record: dict[str, Any] = field(default_factory=dict)
    # p2p: the direction, the peer (None: any source) and the tag of each op waited on
    p2p: list[dict[str, Any]] = field(default_factory=list)


def where_text(rec_where: Any, cell_file: str | None) -> str:
    if not rec_where:
        return "?"
    filename, line = rec_where
    return f"line {line}" if filename == cell_file else f"{filename}, line {line}"


def thread_of(rec: dict) -> str:
    """' (in thread 'saver')' for a collective another thread issued, else ''."""
    return f" (in thread {rec['thread']!r})" if rec.get("thread") else ""


def line_of(rec_where: Any) -> int | None:
    return rec_where[1] if rec_where else None


def call_text(rec: dict, cell_file: str | None) -> str:
    """Where an op was called, never two places as one bare "line N": 'line 4', 'line 4 in
    step() (called at line 9)', or for a helper from an earlier cell 'line 4 of evaluate()
    in Cell In[6], called at line 3'."""
    where, site, func = rec.get("where"), rec.get("site"), rec.get("func")
    if not where:
        return "?"
    if where[0] == cell_file:
        text = f"line {where[1]}"
        if func:
            text += f" in {func}()"
            if site:
                text += f" (called at line {site[1]})"
        return text
    inside = f" of {func}() in {where[0]}" if func else f" of {where[0]}"
    text = f"line {where[1]}{inside}"
    if site and site[0] == cell_file:
        text += f", called from line {site[1]} of this cell"
    return text


def cell_line(rec: dict, cell_file: str | None) -> int | None:
    """The running cell's line of an op: its own line, or the line that called the helper
    it is in (a helper from an earlier cell has no line in this cell of its own)."""
    where, site = rec.get("where"), rec.get("site")
    if where and where[0] == cell_file:
        return where[1]
    if site and (cell_file is None or site[0] == cell_file):
        return site[1]
    return None if cell_file is not None or not where else where[1]


def shape_text(shapes: list) -> str:
    if not shapes:
        return ""
    return ", ".join(
        str(tuple(s))
        if not isinstance(s, list)
        else "[" + ", ".join(str(tuple(x)) for x in s) + "]"
        for s in shapes
    )


plural = rank_list  # the doctor's name for the package's one way of writing ranks


def verb(ranks: list[int], singular: str, plural_form: str) -> str:
    return singular if len(ranks) == 1 else plural_form


def _short_file(path: str) -> str:
    """torch/distributed/tensor/_api.py rather than the whole site-packages path."""
    for anchor in ("/site-packages/", "/dist-packages/"):
        if anchor in path:
            return path.split(anchor, 1)[1]
    return path.rsplit("/", 1)[-1]


def stack_line(stack: list[dict] | None, cell_file: str | None) -> tuple[str, int | None]:
    """Where in the cell the main thread is: 'line 5 in crunch (called at line 8)'."""
    if not stack:
        return "?", None

    def at(f):
        return f"line {f['line']}" if f["file"] == cell_file else f"{f['file']}, line {f['line']}"

    cell_frames = [f for f in stack if f["file"].startswith(CELL_PREFIX)]
    inner = stack[-1]
    if not cell_frames:
        return f"{inner['func']} ({inner['file'].rsplit('/', 1)[-1]}:{inner['line']})", None
    innermost, outermost = cell_frames[-1], cell_frames[0]
    text = at(innermost)
    if innermost["func"] != "<module>":
        text += f" in {innermost['func']}"
    if innermost is not outermost:
        text += f" (called at {at(outermost)})"
    if inner is not innermost:
        text += f", now in {inner['func']} ({inner['file'].rsplit('/', 1)[-1]}:{inner['line']})"
    # the running cell's line: a helper from an earlier cell has its line in that cell
    here = [f for f in cell_frames if f["file"] == cell_file] if cell_file else cell_frames
    return text, (here[-1]["line"] if here else None)


def library_call(stack: list[dict] | None) -> dict[str, Any] | None:
    """The library function the cell called, on the way to where the rank is now: the
    first frame outside the cell after its innermost cell frame, with that cell line."""
    if not stack:
        return None
    last_cell = max(
        (i for i, f in enumerate(stack) if f["file"].startswith(CELL_PREFIX)), default=None
    )
    if last_cell is None or last_cell + 1 >= len(stack):
        return None
    called = stack[last_cell + 1]
    cell = stack[last_cell]
    return {
        "func": called["func"],
        "file": _short_file(called["file"]),
        "line": cell["line"],
        "code": cell.get("code", ""),
    }


#: torch's op dispatch: a thread blocked in a torch op shows these frames innermost
_DISPATCH = ("/torch/_ops.py", "/torch/_library/", "/torch/utils/_python_dispatch.py")
#: the functions of torch.distributed code that wait for a collective it issued
_WAITS = ("wait_tensor", "wait")


def collective_in_stack(stack: list[dict] | None) -> dict[str, Any] | None:
    """A collective torch issued itself, seen in the main thread's stack, for when the Flight
    Recorder cannot say (torch before 2.8 records no Gloo collective; TORCH_FR_BUFFER_SIZE=0
    turns it off): below the cell's call, the innermost frame outside torch's op dispatch
    is torch.distributed code waiting for one (a functional collective's ``wait_tensor``,
    as DTensor and FSDP2 use), or a c10d call the tracker did not see. ``op`` is that
    call's name, or empty where only the wait is on the stack."""
    if not stack:
        return None
    last_cell = max(
        (i for i, f in enumerate(stack) if f["file"].startswith(CELL_PREFIX)), default=None
    )
    if last_cell is None:
        return None
    inner = stack[last_cell + 1 :]
    while inner and any(part in inner[-1]["file"] for part in _DISPATCH):
        inner = inner[:-1]
    if not inner or "/torch/distributed/" not in inner[-1]["file"]:
        return None
    top = inner[-1]
    if top["func"] in _WAITS:
        return {"op": ""}
    if top["file"].endswith("/distributed_c10d.py"):
        return {"op": top["func"].lstrip("_")}
    return None


def internal_op(rec: dict[str, Any]) -> str:
    """The name of a collective torch issued: 'all_gather', or 'a collective' where only its
    wait was seen."""
    return rec.get("op") or "a collective"


def in_backward(stack: list[dict] | None) -> bool:
    return bool(stack) and any(
        f["func"] in ("backward", "_engine_run_backward", "run_backward") for f in stack
    )


def _enclosing(
    source: str | None, line: int | None, first_line: int, header
) -> tuple[int, str] | None:
    """The innermost statement around ``line`` for which ``header(node)`` gives a text:
    (its first line in the cell, that text)."""
    if not source or line is None:
        return None
    body = "\n".join(source.splitlines()[first_line - 1 :])
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return None
    found = None
    for node in ast.walk(tree):
        said = header(node)
        if said is None:
            continue
        start = node.lineno + first_line - 1
        end = (node.end_lineno or node.lineno) + first_line - 1
        if start < line <= end and (found is None or start > found[0]):
            found = (start, said)
    return found


def _ranked(text: str) -> bool:
    return any(w in text for w in RANK_WORDS)


def _rank_if(node) -> str | None:
    if isinstance(node, ast.If) and _ranked(test := ast.unparse(node.test)):
        return test
    return None


def _rank_loop(node) -> str | None:
    if isinstance(node, ast.For) and _ranked(ast.unparse(node.iter)):
        return f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
    if isinstance(node, ast.While) and _ranked(test := ast.unparse(node.test)):
        return f"while {test}"
    return None


def rank_condition(
    source: str | None, line: int | None, first_line: int = 1
) -> tuple[int, str] | None:
    """If ``line`` sits inside an ``if`` whose test mentions the rank: (if line, test text)."""
    return _enclosing(source, line, first_line, _rank_if)


def rank_loop(source: str | None, line: int | None, first_line: int = 1) -> tuple[int, str] | None:
    """If ``line`` sits inside a ``for`` or ``while`` loop whose iterable or test mentions the
    rank (so it runs a different number of times on different ranks): (loop line, its
    header without the colon)."""
    return _enclosing(source, line, first_line, _rank_loop)


def records(snap: dict) -> list[dict]:
    """The tracked collectives of a snapshot (completed and current), in order."""
    recs = [r for r in (snap.get("history") or []) if r.get("kind") != "p2p"]
    current = snap.get("collective")
    if current and current.get("kind") != "p2p":
        recs.append(current)
    recs += [r for r in snap.get("threads") or [] if r.get("kind") != "p2p"]  # other threads'
    return recs


def p2p_text(p: dict) -> str:
    """'send to rank 1', 'recv from rank 0 (tag 3)', 'irecv from any rank'."""
    peer = "any rank" if p.get("peer") is None else f"rank {p['peer']}"
    prep = "to" if p["direction"] == "send" else "from"
    tag = f" (tag {p['tag']})" if p.get("tag") else ""
    return f"{p['op']} {prep} {peer}{tag}"


def gpu_text(gpu: dict) -> str:
    """'NCCL all_reduce #3 in flight' or 'a kernel still running'."""
    nccl = gpu.get("nccl")
    if nccl:
        seq = f" #{nccl['seq']}" if nccl.get("seq") is not None else ""
        return f"NCCL {nccl['op']}{seq} in flight"
    return "a kernel still running"


class Facts:
    """The snapshots of one cell, sorted once, plus the cell it ran."""

    def __init__(
        self,
        ranks: dict[int, dict],
        now: float,
        cell_file: str | None,
        source: str | None,
        first_line: int,
    ):
        self.info = ranks
        self.now = now
        self.cell_file = cell_file
        self.source = source
        self.first_line = first_line
        self.status = {r: info["status"] for r, info in ranks.items()}
        self.snaps = {r: ranks[r].get("snap") or {} for r in ranks}
        self.dead = self._with("dead")
        self.raised = self._with("error")
        self.done = self._with("done")
        self.running = self._with("running")
        self.waits: dict[int, Wait] = {}
        for r in self.running:
            w = self._wait_of(self.snaps[r])
            if w is not None:
                self.waits[r] = w
        #: running ranks in none of the waits above: busy in Python (or in a long op)
        self.busy = [r for r in self.running if r not in self.waits]
        self.members: dict[str, list[int]] = {"default": sorted(ranks)}
        for r in ranks:
            for rec in records(self.snaps[r]):
                if rec["group"] != "default" and rec.get("group_ranks"):
                    self.members[rec["group"]] = sorted(rec["group_ranks"])

    def _with(self, status: str) -> list[int]:
        return sorted(r for r, s in self.status.items() if s == status)

    @staticmethod
    def _wait_of(snap: dict) -> Wait | None:
        coll = snap.get("collective")
        if coll and coll.get("kind") == "p2p":
            return Wait("p2p", coll["op"], coll, [coll])
        if coll:
            return Wait("collective", coll["op"], coll)
        others = [r for r in snap.get("threads") or [] if r.get("kind") != "p2p"]
        if others:  # the cell's thread waits for another (join), which is in a collective
            return Wait("collective", others[0]["op"], others[0])
        pending = snap.get("p2p_pending") or []
        if pending:
            return Wait("p2p", pending[0]["op"], pending[0], list(pending))
        internal = snap.get("internal") or {}
        if in_backward(snap.get("stack")):  # DDP's gradient buckets, FSDP's reduce-scatters
            return Wait("backward", internal.get("op", "all_reduce"), internal)
        if internal:
            return Wait("internal", internal["op"], internal)
        gpu = snap.get("gpu_wait")
        if gpu:  # the host thread waits for the GPU: a long kernel, or an NCCL collective
            return Wait("gpu", (gpu.get("nccl") or {}).get("op", "kernel"), gpu)
        seen = collective_in_stack(snap.get("stack"))
        if seen:  # the Flight Recorder is blind, the stack is not
            return Wait("internal", seen["op"], seen)
        return None

    # ---- helpers the rules share -------------------------------------------------

    def gpu_busy(self) -> list[int]:
        """Ranks whose host thread waits for a kernel that is no collective (a long one)."""
        return [r for r in self.in_kind("gpu") if not self.waits[r].record.get("nccl")]

    def in_kind(self, *kinds: str) -> list[int]:
        return sorted(r for r, w in self.waits.items() if w.kind in kinds)

    def waiting_phrase(self, ranks: list[int] | None = None) -> str:
        """'ranks 0, 2 wait in all_reduce #2 at line 6; rank 1 waits in recv from rank 0 at line 4'."""
        ranks = sorted(self.waits) if ranks is None else ranks
        by_call: dict[str, list[int]] = {}
        for r in ranks:
            by_call.setdefault(self.wait_text(r), []).append(r)
        return "; ".join(
            f"{plural(rs)} {verb(rs, 'waits', 'wait')} in {what}" for what, rs in by_call.items()
        )

    def wait_text(self, r: int) -> str:
        """What rank r waits in, and where: 'all_reduce #2 at line 6'."""
        w = self.waits[r]
        rec = w.record
        if w.kind == "collective":
            return f"{rec['op']} #{rec['seq']} at {call_text(rec, self.cell_file)}{thread_of(rec)}"
        if w.kind == "p2p":
            ops = ", ".join(p2p_text(p) for p in w.p2p[:3])
            return f"{ops} at {self.p2p_where(r)}"
        at = self.stack_at(r)
        if w.kind == "internal":
            call = library_call(self.snaps[r].get("stack"))
            inside = f" inside {call['func']}()" if call else ""
            return f"{internal_op(rec)} (issued by torch{inside}) at {at}"
        if w.kind == "gpu":
            return f"the GPU ({gpu_text(rec)}) at {at}"
        return f"the gradient all_reduce inside backward() at {at}"

    def p2p_where(self, r: int) -> str:
        """Where a rank waits on point-to-point ops: the blocking call's line, or for posted
        ops the line the main thread waits at (``req.wait()``) and where they were posted."""
        w = self.waits[r]
        rec = w.record
        if rec is self.snaps[r].get("collective"):
            return call_text(rec, self.cell_file)
        posted = call_text(rec, self.cell_file)
        now, _ = stack_line(self.snaps[r].get("stack"), self.cell_file)
        return f"{now} (posted at {posted})" if now not in ("?", posted) else posted

    def waited(self, r: int, rec: dict) -> float:
        """How long rank r has been in ``rec``: on the rank's clock up to its snapshot, then
        on the kernel's since the snapshot came (two machines' clocks are never compared)."""
        snap = self.snaps[r]
        if "received" in snap and "time" in snap:
            return max(0.0, snap["time"] - rec["t0"] + self.now - snap["received"])
        return max(0.0, self.now - rec["t0"])

    def seen_ago(self, r: int, at: float) -> float:
        """How long before ``at`` (the kernel's clock) rank r's last snapshot came."""
        snap = self.snaps[r]
        return max(0.0, at - snap.get("received", snap.get("time", at)))

    def stack_at(self, r: int) -> str:
        return stack_line(self.snaps[r].get("stack"), self.cell_file)[0]

    def condition(self, line: int | None) -> tuple[int, str] | None:
        return rank_condition(self.source, line, self.first_line)

    def guarded(self, rec: dict, find) -> tuple[int | None, tuple[int, str] | None]:
        """The running cell's line of ``rec`` and the rank-dependent statement around it
        (``find`` is :meth:`condition` or :meth:`loop`): around the op itself, or, for an op
        inside a function, around the line that called it."""
        lines = [cell_line(rec, self.cell_file)]
        site = rec.get("site")
        if site and site[0] == self.cell_file and site[1] not in lines:
            lines.append(site[1])
        for line in lines:
            found = find(line)
            if found:
                return line, found
        return lines[0], None

    def loop(self, line: int | None) -> tuple[int, str] | None:
        return rank_loop(self.source, line, self.first_line)

    def wait_line(self, r: int) -> int | None:
        """The cell line of what rank r waits in."""
        w = self.waits.get(r)
        if w is None:
            return stack_line(self.snaps[r].get("stack"), self.cell_file)[1]
        if w.kind in ("collective", "p2p") and w.record.get("where"):
            return cell_line(w.record, self.cell_file)
        return stack_line(self.snaps[r].get("stack"), self.cell_file)[1]

    def elsewhere(self, r: int) -> str:
        """Where a rank is that is not where another waits for it."""
        s = self.status[r]
        if s == "done":
            return "finished the cell"
        if s == "error":
            ename, _, line = self.info[r].get("error", ("Error", "", None))
            return f"raised {ename}" + (f" at line {line}" if line else "")
        if s == "dead":
            return str(self.info[r].get("exit", "died"))
        if r in self.waits:
            return f"waits in {self.wait_text(r)}"
        return f"is busy in Python at {self.stack_at(r)}"

    # ---- the table ----------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in sorted(self.info):
            info = self.info[r]
            status = self.status[r]
            state, op, shapes, where, waiting = "", "", "", "", ""
            if status == "dead":
                state = f"dead ({info.get('exit', '?')})"
            elif status == "error":
                ename, _, line = info.get("error", ("Error", "", None))
                state, where = f"raised {ename}", (f"line {line}" if line else "")
            elif status == "done":
                state = "finished the cell"
            elif r in self.waits:
                w = self.waits[r]
                rec = w.record
                if w.kind == "collective":
                    state = (
                        f"in collective #{rec['seq']}"
                        + ("" if rec["group"] == "default" else f" ({rec['group']})")
                        + thread_of(rec)
                    )
                    op, shapes = rec["op"], shape_text(rec["shapes"])
                    where = call_text(rec, self.cell_file)
                    waiting = f"{self.waited(r, rec):.1f} s"
                elif w.kind == "p2p":
                    state = "in " + p2p_text(rec)
                    if len(w.p2p) > 1:
                        state += f" (+{len(w.p2p) - 1} more)"
                    op, shapes = rec["op"], shape_text(rec.get("shapes") or [])
                    where = self.p2p_where(r)
                    waiting = f"{self.waited(r, rec):.1f} s"
                elif w.kind in ("internal", "backward"):
                    state = (
                        "in an internal collective"
                        if w.kind == "internal"
                        else "in backward (DDP/FSDP collectives)"
                    )
                    op = (
                        f"{internal_op(rec).removeprefix('a ')} (torch)"
                        if w.kind == "internal" or rec.get("op")
                        else ""
                    )
                    shapes = ", ".join(str(tuple(x)) for x in rec.get("sizes") or [])
                    where = self.stack_at(r)
                else:  # gpu
                    nccl = rec.get("nccl")
                    state = "waiting on the GPU" if nccl else "busy on the GPU"
                    op = f"{nccl['op']} (NCCL)" if nccl else "kernel"
                    shapes = ", ".join(str(tuple(x)) for x in (nccl or {}).get("sizes") or [])
                    where = self.stack_at(r)
                    waiting = f"{self.waited(r, {'t0': rec.get('since', self.now)}):.1f} s"
            else:
                state, where = "running Python", self.stack_at(r)
            rows.append(
                {
                    "rank": r,
                    "state": state,
                    "op": op,
                    "shapes": shapes,
                    "where": where,
                    "waiting": waiting,
                }
            )
        return rows
