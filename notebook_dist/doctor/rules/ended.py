"""Ranks that ended: a rank died, or raised while others wait."""

from __future__ import annotations

from ..facts import TRANSPORT_ERROR, records
from ..words import call_text, each_rank, of_many, rank_list, shape_text, verb
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
#: the signals of a process that failed inside itself (not one killed from outside)
FATAL = ("SIGABRT", "SIGSEGV", "SIGBUS")
rule = registrar(RULES)


@rule("ND101", "a rank died")
def dead(f: Facts) -> Diagnosis | None:
    if not f.dead:
        return None

    def at(r):
        info, fault = f.info[r], f.info[r].fault
        text = f" in {fault['op']}" if fault.get("op") else ""
        if fault.get("line"):
            text += (
                f" at line {fault['line']}"
                if fault.get("file") in (None, f.cell_file)
                else f" at {fault['file']}, line {fault['line']}"
            )
        elif f.snaps[r].get("stack"):  # SIGKILL leaves no report: where its agent last saw it
            age = f.seen_ago(r, info.found_dead or f.now)
            text += f" (last seen at {f.stack_at(r)}, {age:.1f} s before it was found dead)"
        return text

    how = each_rank((r, f"{f.info[r].exit or 'died'}{at(r)}") for r in f.dead)
    then = (
        "Run %dist_heal for a fresh rank in its place while the others keep their variables "
        "(--copy NAMES gives it yours), or %dist_restart (add --replay to re-run your setup "
        "cells)."
    )
    if len(f.dead) > 1 and set(f.dead) == set(f.info):
        how = f"Every rank of the cell has ended: {how}"
        then = "Run %dist_restart for fresh ranks (add --replay to re-run your setup cells), or %dist_shutdown."
    elif f.busy or not f.healable:  # a heal needs every survivor in the new group, and
        # engines this notebook starts here (not ranks on ssh hosts, in an MPI or Slurm job)
        then = "Run %dist_restart for fresh ranks (add --replay to re-run your setup cells)."
    hint = ""
    aborted = [r for r in f.dead if _failed_inside(f.info[r])]
    if aborted:
        hint = abort_hint(f, aborted[0]) or (
            " Gloo aborts a rank when the tensors of one collective differ in shape or dtype across"
            " ranks: check what each rank passes there."
        )
    waiting = f.waiting_phrase()
    tail = f" {cap(waiting)}." if waiting else ""
    broken = [r for r in f.raised if TRANSPORT_ERROR.search(str(f.info[r].error[1]))]

    def failed(r: int) -> tuple[int, str, str]:  # when the dead rank's connections closed
        line = f.info[r].error[2]
        at = f" at line {line}" if line else ""
        closed = f"{at} failed when the connections closed"
        return r, f"collective{closed}", f"collectives{closed}"

    if broken:
        lost = each_rank(map(failed, broken), ". ", "'s ", "Rank", "Ranks")
        tail += f" {lost}."
    tail += survivors(f, [r for r in f.raised if r not in broken])
    line = next((f.info[r].fault["line"] for r in f.dead if f.info[r].fault.get("line")), None)
    return make(
        f,
        "dead",
        f"{how}.{tail}{hint} {then}",
        f.dead,
        line,
    )


def survivors(f: Facts, raised: list[int]) -> str:
    """What the ranks that outlived the dead did, beside those waiting in collectives: the
    ones stopped by the interrupt that follows a death, the ones that raised, and the ones
    still in Python code (an interrupt can not stop code that ignores it)."""

    def what(r: int) -> tuple[int, str, str]:
        ename, _, line = f.info[r].error
        did = "was interrupted" if ename == "KeyboardInterrupt" else f"raised {ename}"
        at = f" at line {line}" if line else ""
        return (
            r,
            f"{did}{at} and keeps its variables",
            f"{of_many(did)}{at} and keep their variables",
        )

    alike = each_rank(map(what, raised), sep=". ", one="Rank", many="Ranks")
    said = f" {alike}." if alike else ""
    if f.busy:
        at = (
            f" at {f.stack_at(f.busy[0])}"
            if len(f.busy) == 1
            else " (" + each_rank((r, f"at {f.stack_at(r)}") for r in f.busy) + ")"
        )
        said += (
            f" {rank_list(f.busy, 'Rank', 'Ranks')} still {verb(f.busy, 'runs', 'run')} "
            f"Python code{at}, which the interrupt did not stop (code that ignores interrupts)."
        )
    return said


def _failed_inside(info) -> bool:
    """Gloo's abort, or a fatal signal inside a collective (the memory a mismatched receive
    overran: SIGSEGV, SIGBUS): what each rank passed is the likely cause."""
    exit_ = str(info.exit or "")
    return "SIGABRT" in exit_ or (any(s in exit_ for s in FATAL) and bool(info.fault.get("record")))


def abort_hint(f: Facts, dead: int) -> str:
    """What each rank passed to the collective Gloo aborted ``dead`` in: its record (kept in
    memory that outlives it) beside the others' records of the same collective."""
    rec = f.info[dead].fault.get("record")
    if not rec:
        return ""
    key = (rec.get("group"), rec.get("seq"))
    passed = {dead: rec}
    for r in f.info:
        if r == dead:
            continue
        theirs = [x for x in records(f.snaps[r]) if (x.get("group"), x.get("seq")) == key]
        if theirs:
            passed[r] = theirs[-1]

    def what(x: dict) -> str:
        op = "" if x.get("op") == rec.get("op") else f"{x.get('op')} of "
        return f"{op}{shape_text(x.get('shapes') or [])} {'/'.join(x.get('dtypes') or [])}".strip()

    each = each_rank((r, what(x)) for r, x in sorted(passed.items()))
    unseen = "" if len(passed) > 1 else " (the others' arguments were not seen)"
    who = (
        f"Gloo aborted rank {dead}" if "SIGABRT" in str(f.info[dead].exit) else f"Rank {dead} died"
    )
    return (
        f" {who} in {rec.get('op')} #{rec.get('seq')} at "
        f"{call_text(rec, f.cell_file)}, where the ranks passed: {each}{unseen}. Every rank must "
        "pass tensors of the same shape and dtype to one collective (%%distributed "
        "--check-collectives compares them first, with every rank kept alive)."
    )


@rule("ND102", "a rank raised")
def raised(f: Facts) -> Diagnosis | None:
    if not f.raised:
        return None
    what = each_rank(
        (
            r,
            f"raised {f.info[r].error[0]}"
            + (f" at line {f.info[r].error[2]}" if f.info[r].error[2] else ""),
        )
        for r in f.raised
    )
    waiting = f.waiting_phrase()
    tail = f"; {waiting} that will never come" if waiting else ""
    return make(
        f,
        "raised",
        f"{what}{tail}. Fix the error; the waiting ranks are released and the process group is rebuilt.",
        f.raised,
    )
