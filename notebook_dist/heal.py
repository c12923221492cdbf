"""Heal: a dead rank replaced alone, the survivors' variables kept (``%dist_heal``).

``%dist_restart`` starts every rank afresh and loses what the survivors held. Healing
keeps them: each dead rank gets a fresh engine (from the warm pool when it has one,
:mod:`notebook_dist.cluster.spares`), which

1. becomes rank r of the same world in a group of its own that only pretends to
   communicate, and runs the cells ``%dist_restart --replay`` would replay, alone (their
   collectives return at once: what it would have received is copied next);
2. joins the survivors in a new default process group at the same ranks and world size
   (``dist.get_rank()`` is unchanged everywhere), as after a release;
3. gets ``copy`` (``--copy model,opt``) from a survivor as one object graph: an optimizer
   still refers to the copied model's parameters, and tensors land on its device.

The rank side is :mod:`notebook_dist.runtime.heal`.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

from .errors import ClusterError, UsageMistake
from .phrases import rank_list


class HealError(UsageMistake, RuntimeError):
    """Nothing to heal, nobody to heal from, or a cluster that cannot be healed."""


@dataclass
class Healed:
    """What a heal did, for the notebook to say."""

    ranks: list[int]  # the ranks replaced
    how: dict[int, str]  # how each had ended
    source: int  # the survivor copied from
    replayed: int = 0  # cells replayed on the new ranks
    replay_stopped: str | None = None  # where and why the replay stopped early
    copied: list[str] = field(default_factory=list)
    took_s: float = 0.0
    #: what the rebuild did to the groups besides the default one, in words
    groups: str = ""
    #: seconds per phase: engines (from the pool or started), join (alone), replay,
    #: group (made again over every rank), copy
    phases: dict[str, float] = field(default_factory=dict)

    def text(self) -> str:
        ended = "; ".join(f"rank {r} {how}" for r, how in sorted(self.how.items()))
        said = [f"notebook_dist: healed {rank_list(self.ranks)} in {self.took_s:.1f} s ({ended})."]
        if self.replayed or self.replay_stopped:
            said.append(
                f"{'They' if len(self.ranks) > 1 else 'It'} replayed {self.replayed} setup "
                f"cell{'s' if self.replayed != 1 else ''} alone"
                + (f", then stopped at {self.replay_stopped}" if self.replay_stopped else "")
                + "."
            )
        said.append(
            "The process group was made again over every rank (dist.get_rank() is unchanged); "
            "the survivors kept their variables."
        )
        if self.copied:
            said.append(f"Copied {', '.join(self.copied)} from rank {self.source}.")
        elif self.replay_stopped:
            said.append("Copy what the rest would have made with --copy NAMES.")
        if self.groups:
            said.append(self.groups)
        return " ".join(said)


def heal(cluster, copy: list[str] | tuple[str, ...] = (), source: int | None = None) -> Healed:
    """Replace every dead rank of ``cluster`` with a fresh one, keep every survivor's
    variables, and copy ``copy`` to the new ranks from ``source`` (default: the lowest
    surviving rank)."""
    from .runtime import heal as rt_heal

    t0 = time.perf_counter()
    dead, survivors = _check(cluster, copy, source)
    source = survivors[0] if source is None else source
    healed = Healed(sorted(dead), dead, source)
    clock = _Phases(healed.phases)
    cluster.stand_in_for(healed.ranks, clock)
    # the new ranks replay alone: nothing may make the real group before they are done
    cluster.group_lost, cluster.replaying_alone = None, True
    try:
        healed.replayed, healed.replay_stopped = _replay_alone(cluster, healed.ranks)
    finally:
        cluster.replaying_alone = False
    clock("replay")
    cluster.rebuild_process_group()
    healed.groups = cluster.groups_rebuilt
    clock("group")
    if copy:
        blob = cluster.apply(rt_heal.pack, list(copy), ranks=[source])[source]
        cluster.apply(rt_heal.unpack, blob, ranks=healed.ranks)
        healed.copied = list(copy)
        clock("copy")
    for r in healed.ranks:
        cluster.healed[r] = cluster.healed.get(r, 0) + 1
    healed.took_s = time.perf_counter() - t0
    return healed


class _Phases:
    """Seconds per phase of a heal, each call closing the phase named."""

    def __init__(self, into: dict[str, float]):
        self.into, self.t = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name], self.t = now - self.t, now


def _check(cluster, copy, source) -> tuple[dict[int, str], list[int]]:
    cluster.require_running()
    if not cluster.processes.spares_possible():
        raise HealError(
            "only a cluster whose engines this notebook started on this machine can be healed "
            "(this one's belong to an MPI or Slurm job, to ssh hosts, or to whoever started "
            "them): %dist_restart starts every rank afresh"
        )
    for name in copy:
        if not name.isidentifier():
            raise HealError(f"--copy {name!r}: not a valid Python name")
    dead = cluster.dead_ranks()
    if not dead:
        raise HealError("every rank is alive: there is nothing to heal")
    survivors = [r for r in range(cluster.world_size) if r not in dead]
    if not survivors:
        raise HealError(
            "every rank has ended, so no rank holds state to heal from: %dist_restart starts "
            "fresh ranks (add --replay to re-run your setup cells)"
        )
    if source is not None and source not in survivors:
        raise HealError(f"--from {source}: copy from a surviving rank ({rank_list(survivors)})")
    return dead, survivors


def _replay_alone(cluster, ranks: list[int]) -> tuple[int, str | None]:
    """The cells ``%dist_restart --replay`` would replay, on ``ranks`` only; their output
    is not shown. (cells replayed, where it stopped and why, or None)"""
    out = io.StringIO()
    for n, prepared in enumerate(cluster.history):
        try:
            result = cluster.run(prepared, ranks=ranks, out=out, err=out)
        except ClusterError as exc:
            return n, f"{prepared.filename} ({exc})"
        if result.errors:
            rank, err = sorted(result.errors.items())[0]
            return n, f"{prepared.filename} (rank {rank}: {err.ename}: {err.evalue})"
    return len(cluster.history), None
