"""Ranks that ended: a rank died, or raised while others wait."""

from __future__ import annotations

from ..facts import TRANSPORT_ERROR
from .base import Diagnosis, Facts, make, registrar

RULES: list = []
rule = registrar(RULES)


@rule("ND101", "a rank died")
def dead(f: Facts) -> Diagnosis | None:
    if not f.dead:
        return None

    def at(r):
        info = f.info[r]
        text = f" in {info['op']}" if info.get("op") else ""
        if info.get("line"):
            text += (
                f" at line {info['line']}"
                if info.get("file") in (None, f.cell_file)
                else f" at {info['file']}, line {info['line']}"
            )
        elif f.snaps[r].get("stack"):  # SIGKILL leaves no report: where its agent last saw it
            found = info.get("found_dead") or f.now
            age = max(0.0, found - f.snaps[r].get("time", found))
            text += f" (last seen at {f.stack_at(r)}, {age:.1f} s before it was found dead)"
        return text

    how = "; ".join(f"rank {r} {f.info[r].get('exit', 'died')}{at(r)}" for r in f.dead)
    then = "Run %dist_restart (add --replay to re-run your setup cells)."
    if len(f.dead) > 1 and set(f.dead) == set(f.info):
        how = f"Every rank of the cell has ended: {how}"
        then = "Run %dist_restart for fresh ranks (add --replay to re-run your setup cells), or %dist_shutdown."
    hint = ""
    if any("SIGABRT" in str(f.info[r].get("exit", "")) for r in f.dead):
        hint = (
            " Gloo aborts a rank when the tensors of one collective differ in shape or dtype across"
            " ranks: check what each rank passes there."
        )
    waiting = f.waiting_phrase()
    tail = f" {waiting}." if waiting else ""
    broken = [r for r in f.raised if TRANSPORT_ERROR.search(str(f.info[r]["error"][1]))]
    for r in broken:  # its collective failed when the dead rank's connections closed
        line = f.info[r]["error"][2]
        at = f" at line {line}" if line else ""
        tail += f" Rank {r}'s collective{at} failed when the connections closed."
    line = next((f.info[r].get("line") for r in f.dead if f.info[r].get("line")), None)
    return make(
        f,
        "dead",
        f"{how}.{tail}{hint} {then}",
        f.dead,
        line,
    )


@rule("ND102", "a rank raised")
def raised(f: Facts) -> Diagnosis | None:
    if not f.raised:
        return None
    what = "; ".join(
        f"rank {r} raised {f.info[r]['error'][0]}"
        + (f" at line {f.info[r]['error'][2]}" if f.info[r]["error"][2] else "")
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
