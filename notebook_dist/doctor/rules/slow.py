"""Data-dependent and slow ranks: uneven data under DDP, a rank busy in Python or on the
GPU, ranks that finished while others wait."""

from __future__ import annotations

from ..words import each_rank, plural, verb
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
rule = registrar(RULES)


@rule("ND501", "uneven data in a DDP/FSDP loop")
def uneven(f: Facts) -> Diagnosis | None:
    backward = f.in_kind("backward")
    ahead = f.done + f.in_kind("collective")
    if not backward or not ahead:
        return None
    at = f.stack_at(backward[0])
    moved = "finished the cell" if f.done and not f.in_kind("collective") else "moved past the loop"
    return make(
        f,
        "uneven",
        f"{cap(plural(backward))} {verb(backward, 'waits', 'wait')} in the gradient all_reduce "
        f"inside backward() at {at}, while {plural(ahead)} {moved}: the ranks ran different numbers "
        "of steps (uneven data per rank). Give every rank the same number of batches "
        "(DistributedSampler with drop_last=True, or truncate to the smallest rank's length), or "
        "run the loop under ddp.join().",
        ahead,
    )


@rule("ND502", "a rank busy in Python or on the GPU while others wait")
def busy(f: Facts) -> Diagnosis | None:
    gpu_busy = f.gpu_busy()
    slow = f.busy + gpu_busy
    waiting = [r for r in f.waits if r not in gpu_busy]
    if not slow or not waiting:
        return None
    parts = []
    if f.busy:
        where = each_rank((r, f"at {f.stack_at(r)}") for r in f.busy)
        parts.append(
            f"{cap(plural(f.busy))} {verb(f.busy, 'is', 'are')} busy in Python, not in a collective ({where})"
        )
    if gpu_busy:
        where = each_rank((r, f"at {f.stack_at(r)}") for r in gpu_busy)
        parts.append(
            f"{cap(plural(gpu_busy))} {verb(gpu_busy, 'is', 'are')} busy on the GPU (a kernel "
            f"still running; the host thread waits for it at {where})"
        )
    return make(
        f,
        "busy" if f.busy else "gpu-busy",
        f"{'; '.join(parts)}; {f.waiting_phrase(waiting)}. It may just be slow: %dist_stacks shows where it is.",
        slow,
    )


@rule("ND503", "ranks finished while others wait")
def finished(f: Facts) -> Diagnosis | None:
    waiting = [r for r in f.in_kind("collective", "gpu", "backward") if r not in f.gpu_busy()]
    if not waiting or not f.done:
        return None
    return make(
        f,
        "finished",
        f"{cap(plural(f.done))} finished the cell while {f.waiting_phrase(waiting)}: those ranks "
        "made fewer collective calls. Look for a loop or branch whose length depends on the rank or its data.",
        f.done,
        f.wait_line(waiting[0]),
    )
