"""Collectives the tracker saw: the first point where the ranks' sequences diverge
(a rank-conditional branch, another op, other shapes or dtypes, a missing call)."""

from __future__ import annotations

from ..facts import records
from ..words import call_text, cell_line, each_rank, plural, shape_text, thread_of
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
rule = registrar(RULES)


def _key(rec: dict, by_line: bool) -> tuple:
    return (rec["op"], tuple(rec.get("where") or ()) if by_line else None)


#: how a verdict says a rank's root: "rank 0 broadcasts from src=0", "ranks 0, 1 broadcast ..."
ROOT_VERBS = {
    "broadcast": ("broadcasts", "broadcast", "from"),
    "broadcast_object_list": ("broadcasts", "broadcast", "from"),
    "scatter": ("scatters", "scatter", "from"),
    "scatter_object_list": ("scatters", "scatter", "from"),
    "reduce": ("reduces", "reduce", "to"),
    "gather": ("gathers", "gather", "to"),
    "gather_object": ("gathers", "gather", "to"),
}
#: an argument's name as the user wrote it (the tracker's "reduce_op" is torch's ``op=``)
ARG_NAMES = {"reduce_op": "op"}
#: what a differing argument means, and the fix
ARG_FIXES = {
    "src": "every rank must pass the same src (the rank whose data is sent): a src computed "
    "from the rank itself, such as src=rank or src=local_rank, makes every rank a source",
    "dst": "every rank must pass the same dst (the rank that receives the result): a dst "
    "computed from the rank itself, such as dst=rank, makes every rank a destination",
    "reduce_op": "every rank must reduce with the same op",
}


def agreeing(rec: dict) -> dict:
    """The arguments of a record that every rank must pass alike (not async_op)."""
    return {k: v for k, v in (rec.get("args") or {}).items() if k != "async_op"}


def differing_args(present: dict[int, dict]) -> list[str]:
    """The names of the arguments the ranks pass differently, in the tracker's order."""
    names: list[str] = []
    for rec in present.values():
        names += [k for k in agreeing(rec) if k not in names]
    return [k for k in names if len({repr(agreeing(rec).get(k)) for rec in present.values()}) > 1]


def argument_text(op: str, name: str, present: dict[int, dict]) -> str:
    """'rank 0 broadcasts from src=0 and rank 1 from src=1'."""
    by_value: dict[str, list[int]] = {}
    for r, rec in sorted(present.items()):
        by_value.setdefault(repr(agreeing(rec).get(name)), []).append(r)
    verbs = ROOT_VERBS.get(op) if name in ("src", "dst") else None
    parts = []
    for i, (value, ranks) in enumerate(by_value.items()):
        shown = "?" if value == "None" else value.strip("'")
        if verbs:
            one, many, prep = verbs
            lead = f"{one if len(ranks) == 1 else many} " if i == 0 else ""
            parts.append(f"{plural(ranks)} {lead}{prep} {name}={shown}")
        else:
            said = "passes" if len(ranks) == 1 else "pass"
            parts.append(f"{plural(ranks)} {said} {ARG_NAMES.get(name, name)}={shown}")
    return " and ".join(parts) if len(parts) == 2 else "; ".join(parts)


def first_divergence(f: Facts):
    """The earliest (group, seq) at which the ranks' tracked collectives disagree:
    (group, seq, kind, present records).

    A rank lacking a record only counts once it has finished the cell: a rank still
    running may simply not have got there yet (a "busy" rank). Completed calls of the same
    op from different lines paired up at run time; they count as the divergence only when
    the ranks end up out of step later (a collective some ranks never reach).
    """
    best = None
    for group, group_ranks in f.members.items():
        by_rank = {
            r: {rec["seq"]: rec for rec in records(f.snaps[r]) if rec["group"] == group}
            for r in group_ranks
        }
        shifted = None  # the first completed seq whose calls came from different lines
        for seq in sorted({s for recs in by_rank.values() for s in recs}):
            present = {r: recs[seq] for r, recs in by_rank.items() if seq in recs}
            completed = all("t1" in rec for rec in present.values())
            keys = {_key(rec, False) for rec in present.values()}
            lines = {_key(rec, True) for rec in present.values()}
            shapes = {repr(rec["shapes"]) for rec in present.values()}
            dtypes = {repr(rec["dtypes"]) for rec in present.values()}
            argsets = {repr(agreeing(rec)) for rec in present.values()}
            oldest = {r: min(recs) if recs else None for r, recs in by_rank.items()}
            lacking = [
                r
                for r, recs in by_rank.items()
                if seq not in recs and not (oldest[r] is not None and oldest[r] > seq)
            ]
            if lacking and any(f.status.get(r) != "done" for r in lacking) and len(keys) <= 1:
                break  # someone has not got here yet: no verdict from this group
            if len(keys) == 1 and len(lines) > 1 and completed and not lacking:
                shifted = shifted or (seq, present)
                continue
            if len(keys) > 1 or len(shapes) > 1 or len(dtypes) > 1 or len(argsets) > 1 or lacking:
                kind = (
                    "mismatch"
                    if len(keys) > 1
                    else "shapes"
                    if len(shapes) > 1
                    else "dtypes"
                    if len(dtypes) > 1
                    else "argument"
                    if len(argsets) > 1
                    else "missing"
                )
                if kind == "missing" and shifted is not None:
                    seq, present, kind = shifted[0], shifted[1], "mismatch"
                if best is None or seq < best[1]:
                    best = (group, seq, kind, present)
                break
    return best


@rule("ND301", "the ranks' collectives diverge")
def divergence(f: Facts) -> Diagnosis | None:
    div = first_divergence(f)
    if div is None:
        return None
    group, seq, kind, present = div
    gname = "" if group == "default" else f" in process group {group}"
    if kind in ("shapes", "dtypes"):
        return _tensors_differ(f, kind, seq, gname, present)
    if kind == "argument":
        return _arguments_differ(f, seq, gname, present)
    if kind == "mismatch":
        calls = each_rank(
            (r, f"called {rec['op']} at {call_text(rec, f.cell_file)}{thread_of(rec)}")
            for r, rec in sorted(present.items())
        )
        base = f"The ranks disagree at collective #{seq}{gname}: {calls}."
        missing = []
    else:
        missing = [r for r in f.members[group] if r not in present]
        rec = next(iter(present.values()))
        never = (
            "finished the cell"
            if all(f.status.get(r) == "done" for r in missing)
            else "went on without it"
        )
        base = (
            f"{cap(plural(list(present)))} called {rec['op']} #{seq}{gname} at "
            f"{call_text(rec, f.cell_file)}{thread_of(rec)}, but {plural(missing)} {never} without calling it."
        )
    found = _in_a_rank_branch(f, base, kind, present)
    if found is not None:
        return found
    if kind == "missing" and any(
        f.waits.get(r) and f.waits[r].kind == "backward" for r in f.running
    ):
        return None  # uneven data: the uneven rule explains it
    if kind == "mismatch":
        return make(
            f,
            "mismatch",
            base + " Every rank must issue the same collectives in the same order.",
            present,
            cell_line(next(iter(present.values())), f.cell_file),
        )
    line, loop = f.guarded(next(iter(present.values())), f.loop)
    if loop:
        said = (
            f" Line {line} is inside `{loop[1]}:` (line {loop[0]}), which runs a different number "
            "of times on different ranks: make every rank run it as often (the same count on every "
            "rank), or take the collective out of it."
        )
    else:
        said = " Look for a loop or branch whose length depends on the rank or its data."
    return make(f, "finished", base + said, missing, line)


@rule("ND302", "the ranks wait in collectives of different process groups")
def other_groups(f: Facts) -> Diagnosis | None:
    """Every running rank blocked in a tracked collective, not all on one group: each
    group's collective waits for members that are in another group's."""
    if not f.waits or f.busy or any(w.kind != "collective" for w in f.waits.values()):
        return None
    by_group: dict[str, list[int]] = {}
    for r, w in sorted(f.waits.items()):
        by_group.setdefault(w.record["group"], []).append(r)
    if len(by_group) < 2:
        return None
    parts = []
    for group, ranks in by_group.items():
        rec = f.waits[ranks[0]].record
        on = "the default group" if group == "default" else f"process group {group}"
        verb = "waits" if len(ranks) == 1 else "wait"
        parts.append(
            f"{plural(ranks)} {verb} in {rec['op']} #{rec['seq']} on {on} "
            f"({call_text(rec, f.cell_file)})"
        )
    first = f.waits[min(f.waits)].record
    return make(
        f,
        "groups",
        "The ranks wait in collectives of different process groups: "
        + "; ".join(parts)
        + ". A collective completes only when every member of its group calls it, and these "
        "members are in another group's collective. Every member of a group must call that "
        "group's collectives in the same order as the others (pass the same group=).",
        sorted(f.waits),
        cell_line(first, f.cell_file),
    )


def _tensors_differ(f: Facts, kind: str, seq: int, gname: str, present: dict) -> Diagnosis:
    parts = each_rank(
        (
            (r, f"{rec['op']} of {shape_text(rec['shapes'])} {'/'.join(rec['dtypes'])}")
            for r, rec in sorted(present.items())
        ),
        between=": ",
    )
    rec0 = next(iter(present.values()))
    noun = "shape" if kind == "shapes" else "dtype"
    return make(
        f,
        kind,
        f"Collective #{seq}{gname} at {call_text(rec0, f.cell_file)} gets different "
        f"{kind} on different ranks ({parts}). Every rank must pass tensors of the same {noun}.",
        present,
        cell_line(rec0, f.cell_file),
    )


def _arguments_differ(f: Facts, seq: int, gname: str, present: dict) -> Diagnosis:
    rec0 = next(iter(present.values()))
    names = differing_args(present)
    said = "; ".join(argument_text(rec0["op"], n, present) for n in names)
    shown = [ARG_NAMES.get(n, n) for n in names]
    fixes = " ".join(
        cap(ARG_FIXES.get(n, f"every rank must pass the same {n}")) + "." for n in names
    )
    return make(
        f,
        "argument",
        f"At {rec0['op']} #{seq}{gname} ({call_text(rec0, f.cell_file)}) the ranks pass different "
        f"{'arguments' if len(names) > 1 else shown[0]}: {said}. {fixes}",
        present,
        cell_line(rec0, f.cell_file),
    )


def _in_a_rank_branch(f: Facts, base: str, kind: str, present: dict) -> Diagnosis | None:
    """The verdict when a rank's call sits inside an ``if`` on the rank (around the op, or
    around the call into the helper it is in)."""
    for r, rec in sorted(present.items()):
        line, cond = f.guarded(rec, f.condition)
        if cond:
            own = tuple(rec.get("where") or ()) == (f.cell_file, line)  # not a call into a helper
            what = f"Line {line}" if own else f"The call at line {line}"
            return make(
                f,
                "conditional",
                f"{base} {what} is inside `if {cond[1]}:` (line {cond[0]}), so only some ranks "
                "reach it: every rank must call the same collectives in the same order. Move the "
                "collective out of the branch, or make every rank call it.",
                list(present) if kind == "missing" else [r],
                line,
            )
    return None
