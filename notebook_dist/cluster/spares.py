"""More engines for a running cluster: stand-ins for dead ranks (``%dist_heal``) and the
warm pool they are taken from.

An engine is started through the cluster's own ipyparallel launcher (one more engine set
of the same controller, the same command and environment as the ranks'), recorded as
started here and watched by the reaper like every other. Each engine imports torch as it
starts (``runtime/engine.py``), so a spare waiting in the pool becomes a rank in the time
it takes to make a process group, not to start a Python with torch.

The pool holds ``DistConfig.spare_engines`` idle engines (none by default: each costs the
memory of a Python with torch imported) and is refilled in the background after one is
taken. Only local clusters have one: engines of MPI, Slurm or ssh belong to their job or
host.
"""

from __future__ import annotations

import threading
import time

from ..errors import ClusterError


class Spare:
    """An engine that is no rank yet: its engine id and its launcher (its exit code)."""

    def __init__(self, engine_id: int, launcher, proc):
        self.engine_id = engine_id
        self.launcher = launcher
        self.proc = proc  # notebook_dist.signals.Started

    def alive(self) -> bool:
        from .engines import has_ended

        return not has_ended(self.launcher)


def start_engines(processes, k: int) -> list[Spare]:
    """``k`` more engines of the cluster's controller, registered, each with its launcher."""
    from . import engines

    client = processes.client
    if processes.forks is not None:  # what a rank loads later, in every engine from now on
        processes.forks.preload()
    before = set(client.ids)
    _, launchers, recorded = engines.start_recorded(processes, k)
    procs = {el.pid: (el, proc) for el, proc in recorded}
    deadline = time.monotonic() + processes.config.start_timeout_s
    while len(set(client.ids) - before) < k:
        if any(engines.has_ended(el) for el in launchers):
            raise ClusterError(
                f"a new engine exited as it started; its log is in {processes.profile_dir}/log"
            )
        if time.monotonic() > deadline:
            raise ClusterError(
                f"only {len(set(client.ids) - before)} of {k} new engines registered within "
                f"{processes.config.start_timeout_s:.0f} s"
            )
        time.sleep(0.02)
    new = sorted(set(client.ids) - before)[:k]
    from ..runtime.heal import warm

    pids = engines.answered(  # ready: torch and the rank's modules in
        processes.view(new),
        warm,
        within=processes.config.start_timeout_s,
        what="a new spare's first call (its imports)",
    )
    return [Spare(eid, *procs[pid]) for eid, pid in zip(new, pids)]


def stand_in(processes, rank: int, spare: Spare) -> None:
    """``spare`` is ``rank``'s engine from now on."""
    processes.engine_ids[rank] = spare.engine_id
    processes.rank_launchers[rank] = spare.launcher
    processes.by_pid[spare.proc.pid] = spare.launcher
    processes.rank_procs[rank] = spare.proc


def retire_ranks(processes) -> dict[int, str]:
    """End every rank's engine (a restart gives the ranks fresh ones; the controller and
    the spares stay): idle ones are asked to exit at once, and those still running after a
    moment are ended by their records, in the background (the fresh ranks need not wait).
    Returns the ranks that had already ended, and how."""
    from ..runtime import bootstrap as rt_bootstrap
    from ..signals import end

    dead = processes.dead_ranks()
    procs = list(processes.rank_procs.values())
    alive = [processes.engine_ids[r] for r in range(len(processes.engine_ids)) if r not in dead]
    if alive:
        try:
            processes.view(alive).apply_async(rt_bootstrap.exit_now)
        except Exception:  # an engine that cannot be asked is ended below all the same
            pass
    ending = threading.Thread(target=end, args=(procs,), name="notebook_dist-retire", daemon=True)
    ending.start()
    processes.retiring.append(ending)
    return dead


class SparePool:
    """Idle engines kept ready for a cluster: :meth:`take` hands out ``k`` (started now if
    the pool has fewer) and refills the pool in the background."""

    def __init__(self, processes, size: int):
        self.processes = processes
        self.size = size
        self.spares: list[Spare] = []
        self._lock = threading.Lock()  # one start of engines at a time
        self._filling: threading.Thread | None = None
        self._later: threading.Timer | None = None
        self.error: str | None = None  # why the last refill failed

    def fill_later(self, after_s: float) -> None:
        """:meth:`fill` once the cluster has run ``after_s`` (a cluster that is stopped
        sooner, as a script's or a test's often is, never starts a spare)."""
        if self.size <= 0:
            return
        self._later = threading.Timer(after_s, self.fill)
        self._later.daemon = True
        self._later.name = "notebook_dist-spares-later"
        self._later.start()

    def _cancel_later(self) -> None:
        if self._later is not None:
            self._later.cancel()

    def fill(self, wait: bool = False) -> None:
        """Start engines until the pool holds ``size`` (in the background unless ``wait``)."""
        if self.size <= 0 or (self._filling is not None and self._filling.is_alive()):
            if wait and self._filling is not None:
                self._filling.join()
            return
        self._filling = threading.Thread(
            target=self._fill, name="notebook_dist-spares", daemon=True
        )
        self._filling.start()
        if wait:
            self._filling.join()

    def _fill(self) -> None:
        with self._lock:
            self.spares = [s for s in self.spares if s.alive()]
            missing = self.size - len(self.spares)
            if missing <= 0:
                return
            try:
                self.spares += start_engines(self.processes, missing)
                self.error = None
            except Exception as exc:  # said when a spare is next wanted
                self.error = f"{type(exc).__name__}: {exc}"

    def resize(self, size: int) -> None:
        """Keep ``size`` spares from now on (more start in the background; fewer: the extra
        ones wait, idle, until the cluster stops)."""
        if not self.processes.spares_possible():
            return
        self.size = size
        if self.processes.client is not None:
            self.fill()

    def close(self) -> None:
        """No more engines: wait for a refill under way (the cluster is stopping), as long
        as an engine's start may take, once; one still starting then is ended with the
        cluster."""
        self.size = 0
        self._cancel_later()
        deadline = time.monotonic() + self.processes.config.start_timeout_s
        if self._later is not None:
            self._later.join(max(0.0, deadline - time.monotonic()))
        if self._filling is not None:  # (a fill the later one began, too)
            self._filling.join(max(0.0, deadline - time.monotonic()))

    def take(self, k: int) -> list[Spare]:
        """``k`` engines for ranks: from the pool first, the rest started now."""
        self._cancel_later()
        if self._filling is not None:
            self._filling.join()
        with self._lock:
            ready = [s for s in self.spares if s.alive()]
            taken, self.spares = ready[:k], ready[k:]
            if len(taken) < k:
                taken += start_engines(self.processes, k - len(taken))
        self.fill()
        return taken
