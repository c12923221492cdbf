"""A rank stopped in the debugger, or at input(): its user's turn, never a hang."""

from __future__ import annotations

from ..words import each_rank
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
rule = registrar(RULES)


@rule("ND001", "a rank is in the debugger or waits for input")
def in_the_debugger(f: Facts) -> Diagnosis | None:
    stopped = f.in_kind("debugger")
    if not stopped:
        return None
    what = each_rank((r, f"is in {f.wait_text(r)}") for r in stopped)
    others = [r for r in f.waits if r not in stopped]
    tail = f" Meanwhile {f.waiting_phrase(others)}." if others else ""
    return make(
        f,
        "debugger",
        f"{cap(what)}.{tail} This is not a hang: continue (c), step (n) or quit (q) in the "
        "debugger, or answer the prompt.",
        stopped,
        f.wait_line(stopped[0]),
    )
