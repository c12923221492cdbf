"""DistCluster: an ipyparallel cluster whose engines are torch.distributed ranks.

The Python API every magic calls; it works without IPython:

>>> from notebook_dist import DistCluster
>>> with DistCluster(n=2) as c:
...     c.run("import torch.distributed as dist\\ndist.get_rank()").values
RankValues({0: 0, 1: 1})

:class:`DistCluster` is a facade; each of its jobs has a module of its own:

- ``launchers.py``: how engines start (local, MPI, Slurm, ssh), behind one interface;
- ``processes.py``: the controller and engine processes, watched and stopped by pid;
- ``ranks.py``: engines become ranks of the default process group;
- ``cells.py``: what runs on the ranks (cells, functions, values, status);
- ``recovery.py``: interrupting, releasing, rebuilding, restarting, replaying;
- ``reports.py``: what a dead rank left on its host (its fault file, its record);
- ``attach.py``: a cluster on engines someone else started (``ipcluster``).

Ranks are positions in the cluster's ordered engine list, never raw engine ids (ids
change when engines restart).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import sys
import time
import weakref
from typing import Any

from .. import signals
from ..config import DistConfig
from ..errors import ClusterError, PreflightError
from ..execute import PreparedCell
from ..phrases import COMPACT_FROM
from ..plan import ClusterPlan, plan_cluster, plan_on_engines
from ..ranks import parse_ranks
from ..values import RankValues, shm_dir_for
from ..watch import CellWatch
from . import cells, recovery, reports
from . import ranks as rank_setup
from .launchers import make as make_launcher
from .processes import (
    Processes,
    check_port,
    check_python,
    ended_message,
    free_port,
    stop_note,
)
from .ranks import RankInfo

__all__ = ["DistCluster", "RankInfo", "free_port"]

#: the clusters started here and not shut down yet, shut down as the interpreter exits (a
#: script that never called ``shutdown()``), before ipyparallel's own clean-up. Garbage
#: collection at the interpreter's very end comes too late: no thread starts there, and a
#: stop that started one (``processes.within``) waited for it for ever
RUNNING: weakref.WeakSet = weakref.WeakSet()


def stop_at_exit(cluster) -> None:
    RUNNING.add(cluster)
    atexit.unregister(shutdown_running)  # registered last: run first (atexit runs the last first)
    atexit.register(shutdown_running)


def shutdown_running() -> None:
    for cluster in list(RUNNING):
        with contextlib.suppress(Exception):
            cluster.shutdown()


def _request(n, backend, gpus, port, launcher, config: DistConfig) -> dict[str, Any]:
    """What a restart asks for again: the same cluster."""
    ssh = getattr(launcher, "hosts", {})
    return {
        "n": n,
        "backend": (backend or "auto").lower(),
        "gpus": gpus,
        "timeout": config.timeout_s,
        "port": port,
        "launcher": launcher.name,
        "slurm": dict(config.slurm),
        "ssh": (dict(ssh), repr(config.ssh)),
    }


def _first_plan(launcher, config: DistConfig, n, backend, gpus, placement) -> ClusterPlan:
    """The layout, decided before anything starts: for engines that already run, from their
    probes; over ssh, provisional (the hosts' GPUs are known once their engines run)."""
    ssh = getattr(launcher, "hosts", {})
    if placement is not None:
        return plan_on_engines(*placement, config.loopback_only, n, backend, gpus)
    if ssh:
        hosts = [h for h, count in ssh.items() for _ in range(count)]
        return plan_cluster(len(hosts), "gloo", None, gpu_ids=[], hosts=hosts)
    return plan_cluster(n, backend, gpus)


class DistCluster:
    """A set of ranks, one ipyparallel engine each, with the default process group ready.

    ``DistCluster(n=None, backend="auto", gpus=None, timeout=None)`` decides the layout
    at once (raising :class:`~notebook_dist.errors.PreflightError` for a request that cannot
    work) and starts nothing until :meth:`start`.
    """

    def __init__(
        self,
        n: int | None = None,
        backend: str = "auto",
        gpus: str | list[int] | None = None,
        timeout: float | None = None,
        *,
        port: int | None = None,
        launcher: str = "local",
        config: DistConfig | None = None,
        ssh_hosts: dict[str, int] | None = None,
        placement: tuple[list[dict], str] | None = None,
    ):
        """``launcher``: local, mpi, slurm or ssh (``notebook_dist.cluster.launchers``).
        ``ssh_hosts`` (``--launcher ssh``): engines per host, e.g. ``{"node1": 2}``.
        ``placement``: for engines that already run, their probes in rank order and this
        machine's id (see :func:`notebook_dist.plan.plan_on_engines`)."""
        self.config = config or DistConfig()
        self.launcher = make_launcher(launcher, self.config, n, ssh_hosts)
        if timeout is not None:
            if not math.isfinite(timeout) or timeout <= 0:
                raise PreflightError(f"--timeout {timeout}: give a positive number of seconds")
            self.config.timeout_s = float(timeout)
        self.request = _request(n, backend, gpus, port, self.launcher, self.config)
        self.plan: ClusterPlan = _first_plan(
            self.launcher, self.config, n, backend, gpus, placement
        )
        self.port = port  # the rendezvous port (MASTER_PORT); None: the OS picks one
        if not self.launcher.remote:  # (a remote port and Python are the hosts' to check)
            if port is not None:
                check_port(port, "127.0.0.1" if self.config.loopback_only else "")
            check_python(self.config.python)
        self.processes = self._processes()
        self.ranks: list[RankInfo] = []
        self.notes: list[str] = list(self.plan.notes)
        self.bootstrap_info: list[dict] = []  # per rank: import_s, init_s (benchmarks read these)
        self.startup_s: float | None = None
        self.state = "new"
        self.last_watch: CellWatch | None = None
        self.shm_dir: str | None = None  # tmpfs folder for large tensors (local clusters)
        #: cells that ran cleanly on every rank since start, for %dist_restart --replay
        self.history: list[PreparedCell] = []
        #: why the ranks have no process group (a rebuild failed); the next cell tries again
        self.group_lost: str | None = None
        #: what the last rebuild did to the groups besides the default one, in words
        self.groups_rebuilt = ""
        #: what shutdown() stopped, in a sentence
        self.stop_note = ""
        #: the %dist_init request it was made from (notebook_dist.request), if any
        self.asked = None
        #: rank -> how many times it was healed (replaced by a fresh engine)
        self.healed: dict[int, int] = {}
        #: a heal's new ranks replay cells alone: the group is not to be made meanwhile
        self.replaying_alone = False

    def _processes(self) -> Processes:
        return Processes(self.config, self.launcher)

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def cluster_id(self) -> str:
        return self.processes.cluster_id

    @property
    def running(self) -> bool:
        return self.state == "running"

    def start(self) -> DistCluster:
        """Start the controller and engines, then make every engine a rank."""
        if self.state != "new":
            raise ClusterError(
                f"this cluster is {self.state}; make a new DistCluster to start again"
            )
        if foreign := signals.foreign_proc():
            raise PreflightError(foreign)
        self.state = "starting"
        t0 = time.perf_counter()
        asked: list[tuple] = []  # rank 0's port, asked for as soon as its engine registers

        def ask(engine_id: int) -> None:
            if self.port is None:
                asked.append(rank_setup.ask_rendezvous(self.processes, self.plan, engine_id))

        try:
            ordered = self.processes.start(self.world_size, first_registered=ask)
            plan = ordered and self.launcher.replan(ordered, self.processes.here, self.request)
            if plan:  # the hosts' own GPUs and addresses are known now (ssh)
                self.plan, self.notes = plan, list(plan.notes)
            self.ranks, self.bootstrap_info, notes = rank_setup.join(
                self.processes, self.plan, self.config, self.port, asked[0] if asked else None
            )
            self.notes += notes
            self.processes.ranks_joined(self.ranks)
        except BaseException:
            self.shutdown()
            raise
        self.startup_s = time.perf_counter() - t0
        self.state = "running"
        stop_at_exit(self)
        self.processes.pool.fill_later(self.config.spares_after_s)  # in the background
        if self.config.loopback_only:  # every rank is on this machine: tensors go through tmpfs
            self.shm_dir = shm_dir_for(self.cluster_id)
            if self.shm_dir and self.processes.reaper is not None:
                self.processes.reaper.remove_on_exit(self.shm_dir)
        return self

    def discard(self) -> None:
        """Let go of a cluster that was planned but will not start (nothing to do here)."""

    def shutdown(self) -> str:
        """Stop every process this cluster started; safe to call more than once. Returns
        what it stopped, in a sentence (ranks that had already ended are named)."""
        if self.state == "stopped":
            return self.stop_note
        dead: dict[int, str] = {}
        gone = False
        if self.state == "running":
            with contextlib.suppress(Exception):  # a broken controller must not stop the stop
                gone = not self.processes.controller_alive()
                dead = self.processes.dead_ranks()
        self.state = "stopping"
        self.processes.stop(also_remove=(self.shm_dir,))
        self.state = "stopped"
        self.stop_note = stop_note(self.world_size, dead, gone) if self.ranks else "the controller"
        return self.stop_note

    def __enter__(self) -> DistCluster:
        return self.start() if self.state == "new" else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        # a garbage-collected cluster must not leave processes behind (at the interpreter's
        # end no thread starts, and the stop would wait for one: stopped at exit instead)
        if getattr(self, "state", "stopped") in ("running", "starting") and not sys.is_finalizing():
            try:
                self.shutdown()
            except Exception:
                pass

    def require_running(self) -> None:
        if self.state != "running":
            raise ClusterError(
                f"the cluster is {self.state}: start one with %dist_init (or DistCluster.start())"
            )

    def select(self, spec: Any = None) -> list[int]:
        return parse_ranks(spec, self.world_size)

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has ended, with how it ended."""
        return self.processes.dead_ranks()

    def controller_alive(self) -> bool:
        return self.processes.controller_alive()

    def dead_note(self) -> str:
        """What to say when ranks have ended, and what to do; "" while every rank lives."""
        dead = self.dead_ranks() if self.running else {}
        healable = self.processes.spares_possible()
        return ended_message(dead, self.world_size, healable) if dead else ""

    # ---- running on the ranks (cells.py): each is that module's function, self first ----

    run = cells.run
    apply = cells.apply
    push = cells.push
    push_modules = cells.push_modules
    pull = cells.pull
    status = cells.status
    clock_offsets = cells.clock_offsets

    # ---- inspection (notebook_dist.inspect) ---------------------------------------------

    def heal(self, copy=(), source: int | None = None):
        """Replace every dead rank with a fresh one and keep the survivors' variables
        (:func:`notebook_dist.heal.heal`)."""
        from ..heal import heal

        return heal(self, copy, source)

    def compare(self, expr: str, ranks: Any = None, atol: float = 0.0, rtol: float = 0.0):
        """What differs across ranks in EXPR (a tensor, module, optimizer or container)."""
        from ..inspect import compare

        return compare(self, expr, ranks, atol, rtol)

    def inspect(self, expr: str, ranks: Any = None) -> RankValues:
        """EXPR evaluated on each rank, without running a cell."""
        from ..inspect import inspect

        return inspect(self, expr, ranks)

    def debug(self, rank: int | None = None, expr: str | None = None, frame: int = 0):
        """Post-mortem: the frame where ``rank`` raised in the last cell, its locals, EXPR there."""
        from ..inspect import debug

        return debug(self, rank, expr, frame)

    # ---- recovery (recovery.py), likewise ----------------------------------------------

    interrupt = recovery.interrupt
    stop_ranks = recovery.stop_ranks
    release_collectives = recovery.release_collectives
    rebuild_process_group = recovery.rebuild_process_group
    fault_report = reports.fault_report
    restarted = recovery.restarted
    replay = recovery.replay
    stand_in_for = recovery.stand_in_for
    tell_ranks = recovery.tell_ranks

    # ---- display ----------------------------------------------------------------------------

    def table(
        self,
        rows: list[dict[str, Any]] | None = None,
        columns: tuple[str, ...] = ("rank", "host", "pid", "device", "backend"),
    ) -> str:
        """The rank table as fixed-width text; without ``rows``, from ``phrases.COMPACT_FROM``
        ranks, the ranks alike on a host share a row (``ranks.grouped_table``)."""
        from ..table import format_table

        if rows is None and len(self.ranks) >= COMPACT_FROM:
            return rank_setup.grouped_table(self.ranks)
        rows = [{c: getattr(r, c) for c in columns} for r in self.ranks] if rows is None else rows
        return "\n".join(format_table(columns, rows))

    def __repr__(self) -> str:
        return f"<DistCluster {self.state}: {self.world_size} ranks, {self.backend}>"
