"""When nobody is missing: every rank in the same collective, no rank in any, or a
pattern no rule knows (said plainly rather than guessed)."""

from __future__ import annotations

from ..words import call_text, plural
from .base import Diagnosis, Facts, make, registrar

RULES: list = []
rule = registrar(RULES)


@rule("ND601", "every rank waits in the same collective")
def stalled(f: Facts) -> Diagnosis | None:
    if not f.waits or f.busy or f.done or len(f.waits) != len(f.info):
        return None
    kinds = {w.kind for w in f.waits.values()}
    if kinds == {"collective"}:
        recs = [w.record for w in f.waits.values()]
        if len({(rec["group"], rec["seq"], rec["op"]) for rec in recs}) != 1:
            return None
        rec = recs[0]
        where = call_text(rec, f.cell_file)
        return make(
            f,
            "stalled",
            f"Every rank is in {rec['op']} #{rec['seq']} at {where} with matching arguments, but it "
            "has not completed: the network, or a rank of another process group, may be at fault.",
            [],
        )
    in_collective = kinds <= {"internal", "backward", "gpu"} and not f.gpu_busy()
    if in_collective and len(kinds) == 1 and len({w.op for w in f.waits.values()}) == 1:
        r0 = min(f.waits)
        return make(
            f,
            "stalled",
            f"Every rank waits in {f.wait_text(r0)}, and none is missing from it, but it has not "
            "completed: a collective issued on only some ranks earlier (in a library call, or "
            "torch's own), or the network, may be at fault. %dist_stacks shows each rank's stack.",
            [],
        )
    return None


@rule("ND701", "no rank is in a collective")
def python(f: Facts) -> Diagnosis | None:
    gpu_busy = f.gpu_busy()
    if any(r not in gpu_busy for r in f.waits) or not (f.busy or gpu_busy):
        return None
    doing = (
        "running Python"
        if not gpu_busy
        else ("busy on the GPU" if not f.busy else "running Python or busy on the GPU")
    )
    return make(
        f,
        "python",
        f"No rank is in a collective; all are {doing}. This is slow code or a loop, not a distributed hang.",
        [],
    )


@rule("ND801", "the ranks wait, and no rule explains it")
def unexplained(f: Facts) -> Diagnosis | None:
    if not f.waits:
        return None
    return make(
        f,
        "unknown",
        f"No known pattern explains this: {f.waiting_phrase()}"
        + (f"; {plural(f.done)} finished the cell" if f.done else "")
        + ". %dist_stacks shows each rank's stack.",
        [],
    )
