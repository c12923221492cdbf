"""The hang and fault doctor: per-rank snapshots in, a table and a plain verdict out.

A pure function (:func:`diagnose`) of what each rank reported: its state, the collective
it is in (sequence number per process group, op, shapes, dtypes, the cell line that
issued it), the collectives it completed in this cell, and its Python stack. It looks
for the *first* point where the ranks' collective sequences diverge, not the last
collective that is stuck, because the last one is usually a victim.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

RANK_WORDS = ("rank", "is_main", "local_rank")


@dataclass
class Diagnosis:
    kind: str  # conditional, mismatch, shapes, dtypes, raised, dead, busy, uneven, finished, stalled, python, none
    verdict: str
    culprits: list[int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    line: int | None = None

    def text(self) -> str:
        from .table import format_table

        cols = ("rank", "state", "op", "shapes", "where", "waiting")
        lines = format_table(cols, self.rows) if self.rows else []
        lines.append(f"Diagnosis: {self.verdict}")
        return "\n".join(lines)


def _where(rec_where: Any, cell_file: str | None) -> str:
    if not rec_where:
        return "?"
    filename, line = rec_where
    return f"line {line}" if filename == cell_file else f"{filename}, line {line}"


def _line_of(rec_where: Any) -> int | None:
    return rec_where[1] if rec_where else None


def _shape_text(shapes: list) -> str:
    if not shapes:
        return ""
    return ", ".join(
        str(tuple(s))
        if not isinstance(s, list)
        else "[" + ", ".join(str(tuple(x)) for x in s) + "]"
        for s in shapes
    )


def _stack_line(stack: list[dict] | None, cell_file: str | None) -> tuple[str, int | None]:
    """Where in the cell the main thread is: 'line 5 in crunch (called at line 8)'."""
    if not stack:
        return "?", None

    def at(f):
        return f"line {f['line']}" if f["file"] == cell_file else f"{f['file']}, line {f['line']}"

    cell_frames = [f for f in stack if f["file"].startswith("Cell In[")]
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
    return text, innermost["line"]


def _in_backward(stack: list[dict] | None) -> bool:
    return bool(stack) and any(
        f["func"] in ("backward", "_engine_run_backward", "run_backward") for f in stack
    )


def rank_condition(
    source: str | None, line: int | None, first_line: int = 1
) -> tuple[int, str] | None:
    """If ``line`` sits inside an ``if`` whose test mentions the rank: (if line, test text)."""
    if not source or line is None:
        return None
    lines = source.splitlines()
    body = "\n".join(lines[first_line - 1 :])
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return None
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if not any(w in test for w in RANK_WORDS):
                continue
            start = node.lineno + first_line - 1
            end = (node.end_lineno or node.lineno) + first_line - 1
            if start < line <= end and (found is None or start > found[0]):
                found = (start, test)
    return found


def _records(snap: dict) -> list[dict]:
    recs = list(snap.get("history") or [])
    if snap.get("collective"):
        recs.append(snap["collective"])
    return recs


def _first_divergence(
    ranks: dict[int, dict], members: dict[str, list[int]], status: dict[int, str]
):
    """The earliest (group, seq) at which the ranks' collective records disagree.

    A rank lacking a record only counts as diverging once it has finished the cell: a
    rank still running may simply not have got there yet (that is a "busy" rank).
    """
    best = None
    for group, group_ranks in members.items():
        by_rank = {
            r: {rec["seq"]: rec for rec in _records(ranks[r]["snap"]) if rec["group"] == group}
            for r in group_ranks
        }
        seqs = sorted({s for recs in by_rank.values() for s in recs})
        for seq in seqs:
            present = {r: recs[seq] for r, recs in by_rank.items() if seq in recs}
            keys = {(rec["op"], _line_of(rec.get("where"))) for rec in present.values()}
            shapes = {repr(rec["shapes"]) for rec in present.values()}
            dtypes = {repr(rec["dtypes"]) for rec in present.values()}
            oldest_known = {r: min(recs) if recs else None for r, recs in by_rank.items()}
            lacking = [
                r
                for r, recs in by_rank.items()
                if seq not in recs and not (oldest_known[r] is not None and oldest_known[r] > seq)
            ]
            if lacking and any(status.get(r) != "done" for r in lacking) and len(keys) <= 1:
                break  # someone has not got here yet: no verdict from this group
            complete = not lacking
            if len(keys) > 1 or len(shapes) > 1 or len(dtypes) > 1 or not complete:
                kind = (
                    "mismatch"
                    if len(keys) > 1
                    else (
                        "shapes"
                        if len(shapes) > 1
                        else ("dtypes" if len(dtypes) > 1 else "missing")
                    )
                )
                if best is None or seq < best[1]:
                    best = (group, seq, kind, present)
                break
    return best


def diagnose(
    ranks: dict[int, dict],
    *,
    now: float,
    cell_file: str | None = None,
    source: str | None = None,
    first_line: int = 2,
) -> Diagnosis:
    """``ranks``: rank -> {"status": running|done|error|dead, "snap": agent snapshot or {},
    "exit": how a dead rank ended, "error": (ename, evalue, line) for a rank that raised}."""
    rows = []
    for r in sorted(ranks):
        info = ranks[r]
        snap = info.get("snap") or {}
        coll = snap.get("collective")
        status = info["status"]
        if status == "dead":
            state, op, shapes, where, waiting = f"dead ({info.get('exit', '?')})", "", "", "", ""
        elif status == "error":
            ename, evalue, line = info.get("error", ("Error", "", None))
            state, op, shapes, where, waiting = (
                f"raised {ename}",
                "",
                "",
                f"line {line}" if line else "",
                "",
            )
        elif status == "done":
            state, op, shapes, where, waiting = "finished the cell", "", "", "", ""
        elif coll:
            state = f"in collective #{coll['seq']}" + (
                "" if coll["group"] == "default" else f" ({coll['group']})"
            )
            op, shapes, where = (
                coll["op"],
                _shape_text(coll["shapes"]),
                _where(coll.get("where"), cell_file),
            )
            waiting = f"{max(0.0, now - coll['t0']):.1f} s"
        else:
            at, _ = _stack_line(snap.get("stack"), cell_file)
            internal = snap.get("internal")  # a collective torch issued itself (Flight Recorder)
            if _in_backward(snap.get("stack")):
                state = "in backward (DDP/FSDP collectives)"
            else:
                state = "in an internal collective" if internal else "running Python"
            op = f"{internal['op']} (torch)" if internal else ""
            shapes = ", ".join(str(tuple(x)) for x in (internal or {}).get("sizes") or [])
            where, waiting = at, ""
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

    def d(kind, verdict, culprits, line=None):
        return Diagnosis(kind, verdict, sorted(culprits), rows, line)

    status = {r: info["status"] for r, info in ranks.items()}
    dead = [r for r, s in status.items() if s == "dead"]
    raised = [r for r, s in status.items() if s == "error"]
    done = [r for r, s in status.items() if s == "done"]
    running = [r for r, s in status.items() if s == "running"]
    snaps = {r: ranks[r].get("snap") or {} for r in ranks}
    in_coll = [r for r in running if snaps[r].get("collective")]
    waiting_desc = _waiting_phrase(in_coll, snaps, cell_file)

    if dead:

        def _at(r):
            info = ranks[r]
            at = f" in {info['op']}" if info.get("op") else ""
            if info.get("line"):
                at += (
                    f" at line {info['line']}"
                    if info.get("file") in (None, cell_file)
                    else f" at {info['file']}, line {info['line']}"
                )
            return at

        how = "; ".join(f"rank {r} {ranks[r].get('exit', 'died')}{_at(r)}" for r in dead)
        hint = ""
        if any("SIGABRT" in str(ranks[r].get("exit", "")) for r in dead):
            hint = (
                " Gloo aborts a rank when the tensors of one collective differ in shape or dtype across ranks:"
                " check what each rank passes there."
            )
        tail = f" {waiting_desc}." if waiting_desc else ""
        line = next((ranks[r].get("line") for r in dead if ranks[r].get("line")), None)
        return d(
            "dead",
            f"{how}.{tail}{hint} Run %dist_restart (add --replay to re-run your setup cells).",
            dead,
            line,
        )
    if raised:
        what = "; ".join(
            f"rank {r} raised {ranks[r]['error'][0]}"
            + (f" at line {ranks[r]['error'][2]}" if ranks[r]["error"][2] else "")
            for r in raised
        )
        tail = f"; {waiting_desc} that will never come" if waiting_desc else ""
        return d(
            "raised",
            f"{what}{tail}. Fix the error; the waiting ranks are released and the process group is rebuilt.",
            raised,
        )

    # group membership: default group has every rank
    members: dict[str, list[int]] = {"default": sorted(ranks)}
    for r in ranks:
        for rec in _records(snaps[r]):
            if rec["group"] != "default" and rec.get("group_ranks"):
                members[rec["group"]] = sorted(rec["group_ranks"])
    live = {r: {"snap": snaps[r]} for r in ranks}
    div = _first_divergence(live, members, status)
    if div is not None:
        group, seq, kind, present = div
        gname = "" if group == "default" else f" in process group {group}"
        if kind in ("mismatch", "missing"):
            cond = None
            for r, rec in sorted(present.items()):
                c = rank_condition(source, _line_of(rec.get("where")), first_line)
                if c:
                    cond = (r, rec, c)
                    break
            if kind == "mismatch":
                calls = "; ".join(
                    f"rank {r} called {rec['op']} at {_where(rec.get('where'), cell_file)}"
                    for r, rec in sorted(present.items())
                )
                base = f"The ranks disagree at collective #{seq}{gname}: {calls}."
            else:
                missing = [r for r in members[group] if r not in present]
                rec = next(iter(present.values()))
                who = ", ".join(map(str, sorted(present)))
                never = (
                    "finished the cell"
                    if all(status.get(r) == "done" for r in missing)
                    else "went on without it"
                )
                base = (
                    f"Rank{'s' if len(present) > 1 else ''} {who} called {rec['op']} #{seq}{gname} at "
                    f"{_where(rec.get('where'), cell_file)}, but rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} {never} without calling it."
                )
            if cond:
                r, rec, (if_line, test) = cond
                line = _line_of(rec.get("where"))
                culprits = sorted(present) if kind == "missing" else [r]
                return d(
                    "conditional",
                    f"{base} Line {line} is inside `if {test}:` (line {if_line}), so only some ranks reach it: "
                    "every rank must call the same collectives in the same order. Move the collective out of the "
                    "branch, or make every rank call it.",
                    culprits,
                    line,
                )
            if kind == "missing" and any(_in_backward(snaps[r].get("stack")) for r in running):
                pass  # handled as uneven data below
            else:
                culprits = (
                    [r for r in members[group] if r not in present]
                    if kind == "missing"
                    else list(present)
                )
                fix = (
                    " Every rank must issue the same collectives in the same order."
                    if kind == "mismatch"
                    else " Look for a loop or branch whose length depends on the rank or its data."
                )
                return d(
                    "mismatch" if kind == "mismatch" else "finished",
                    base + fix,
                    culprits,
                    _line_of(next(iter(present.values())).get("where")),
                )
        else:
            parts = "; ".join(
                f"rank {r}: {rec['op']} of {_shape_text(rec['shapes'])} {'/'.join(rec['dtypes'])}"
                for r, rec in sorted(present.items())
            )
            rec0 = next(iter(present.values()))
            what = "shapes" if kind == "shapes" else "dtypes"
            return d(
                kind,
                f"Collective #{seq}{gname} at {_where(rec0.get('where'), cell_file)} gets different {what} on different ranks ({parts}). "
                f"Every rank must pass tensors of the same {'shape' if kind == 'shapes' else 'dtype'}.",
                sorted(present),
                _line_of(rec0.get("where")),
            )

    backward = [
        r for r in running if not snaps[r].get("collective") and _in_backward(snaps[r].get("stack"))
    ]
    if backward and (done or in_coll):
        others = done + in_coll
        at = _stack_line(snaps[backward[0]].get("stack"), cell_file)[0]
        ahead = "finished the cell" if done and not in_coll else "moved past the loop"
        return d(
            "uneven",
            f"Rank{'s' if len(backward) > 1 else ''} {', '.join(map(str, backward))} wait{'' if len(backward) > 1 else 's'} in the "
            f"gradient all_reduce inside backward() at {at}, while rank{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, sorted(others)))} {ahead}: the ranks ran different numbers of steps (uneven data per rank). "
            "Give every rank the same number of batches (DistributedSampler with drop_last=True, or truncate to the "
            "smallest rank's length), or run the loop under ddp.join().",
            sorted(others),
        )
    busy = [
        r
        for r in running
        if not snaps[r].get("collective") and not _in_backward(snaps[r].get("stack"))
    ]
    if in_coll and busy:
        where = "; ".join(
            f"rank {r} at {_stack_line(snaps[r].get('stack'), cell_file)[0]}" for r in busy
        )
        return d(
            "busy",
            f"Rank{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} {'are' if len(busy) > 1 else 'is'} busy in Python, "
            f"not in a collective ({where}); {waiting_desc}. It may just be slow: %dist_stacks shows where it is.",
            busy,
        )
    if in_coll and done:
        recs = [snaps[r]["collective"] for r in in_coll]
        return d(
            "finished",
            f"Rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} finished the cell while {waiting_desc}: "
            "those ranks made fewer collective calls. Look for a loop or branch whose length depends on the rank or its data.",
            done,
            _line_of(recs[0].get("where")),
        )
    if in_coll and not busy and not done:
        rec = snaps[in_coll[0]]["collective"]
        return d(
            "stalled",
            f"Every rank is in {rec['op']} #{rec['seq']} at {_where(rec.get('where'), cell_file)} with matching arguments, "
            "but it has not completed: the network, or a rank of another process group, may be at fault.",
            [],
        )
    if busy:
        return d(
            "python",
            "No rank is in a collective; all are running Python. This is slow code or a loop, not a distributed hang.",
            [],
        )
    return d("none", "Nothing is stuck.", [])


def _waiting_phrase(in_coll: list[int], snaps: dict[int, dict], cell_file: str | None) -> str:
    if not in_coll:
        return ""
    parts = []
    by_call: dict[tuple, list[int]] = {}
    for r in in_coll:
        rec = snaps[r]["collective"]
        by_call.setdefault((rec["op"], rec["seq"], _where(rec.get("where"), cell_file)), []).append(
            r
        )
    for (op, seq, where), rs in by_call.items():
        who = f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        parts.append(f"{who} wait{'' if len(rs) > 1 else 's'} in {op} #{seq} at {where}")
    return "; ".join(parts)


def format_stacks(snaps: dict[int, dict], cell_file: str | None = None) -> str:
    """Every rank's main-thread stack, innermost last, cell frames as cell lines."""
    out = []
    for r in sorted(snaps):
        snap = snaps[r] or {}
        stack = snap.get("stack") or []
        coll = snap.get("collective")
        head = f"rank {r}"
        if coll:
            head += f": in {coll['op']} #{coll['seq']}"
        out.append(head)
        if not stack:
            out.append("  (no stack reported)")
        for f in stack:
            where = (
                f"line {f['line']}" if f["file"] == cell_file else f"{f['file']}, line {f['line']}"
            )
            out.append(f"  {where}, in {f['func']}")
            if f.get("code"):
                out.append(f"    {f['code']}")
    return "\n".join(out)
