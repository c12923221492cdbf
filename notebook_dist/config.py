"""Interactive-safe defaults, in one place, each field documented.

torch's defaults suit batch jobs: a Gloo collective waits 30 minutes, and NCCL's error
handling tears the process down, which would kill an engine and its state. In a
notebook a stuck collective should surface in minutes and a rank should survive it.
A user-set environment variable that we replace is reported when the cluster starts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

#: torch's collective timeout when the notebook watches for stuck cells itself: a day
COLLECTIVE_WAIT_S = 24 * 3600.0
#: DistConfig.rank_scheduling's values
SCHEDULING = ("auto", "batch", "normal")


@dataclass
class DistConfig:
    timeout_s: float | None = None
    """torch's own collective timeout for the default process group (``--timeout``). None
    (the default): torch lets a collective wait ``COLLECTIVE_WAIT_S`` (a day), and the notebook
    ends a stuck cell itself after ``stuck_after_s``, never while a rank waits at a prompt
    (its debugger, ``input()``). torch's timeout cannot tell a hang from a rank the user is
    stepping through: a collective's deadline is fixed when it is issued."""

    stuck_after_s: float = 300.0
    """When no rank of a running cell has made progress for this long and none waits for
    the user, the notebook stops the cell as the stop button does (the ranks released from
    their collectives, the group rebuilt, every variable kept) and says the doctor's
    verdict: 5 min is long enough for real steps and short enough that a mistake does not
    cost the session. Also the longest a rank waits for the others in the rendezvous store
    (``new_group()``)."""

    def collective_timeout_s(self) -> float:
        """What torch is told: ``timeout_s``, or a wait as long as a cell may take."""
        return self.timeout_s if self.timeout_s is not None else COLLECTIVE_WAIT_S

    def store_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else self.stuck_after_s

    spare_engines: int = 1
    """Idle engines kept ready beside a local cluster's ranks (``%dist_init --spares``),
    torch imported, to stand in for a dead rank (``%dist_heal``) or a restarted one
    (``%dist_restart``) in the time it takes to make a process group; refilled in the
    background when taken. Each costs the memory of a Python with torch imported, about
    240 MiB of its own here (docs/guide.md, "Heal"); as many as ranks make a restart as
    quick as a heal. 0: engines are started when needed."""

    direct_lane: bool = True
    """The notebook's cells and calls reach the ranks over a socket of their own
    (``cluster/lane.py``), not through the controller's queue: one process hop fewer each
    way, the same ipyparallel messages. Ranks on other hosts reach it where they reach the
    controller. False: every request goes through the queue."""

    lane_pipes: bool = True
    """On Linux, a cell's request reaches each local rank, and its reply the notebook,
    through named pipes (``runtime/pipes.py``) rather than the lane's socket: a system
    call each instead of a hop through zmq's IO thread on both sides. The socket still
    carries what does not fit in a pipe. False: the socket alone."""

    relay_from: int | None = None
    """From this many ranks on, a local cluster's cells pass through a relay process
    (``runtime/relay.py``): the notebook sends a cell once and reads the ranks' replies as
    one message, so its CPU per cell grows far less with the ranks, and the relay's own
    CPU is added beside it. None: never. If the relay ends, the cell waiting on it fails
    with a sentence and the next cell reaches the ranks directly. (Through the ranks'
    pipes, ``lane_pipes``, the notebook spends about as little on a cell, and the cell
    takes less time: docs/benchmarks.md.)"""

    fork_engines: bool = True
    """A local cluster's engines are forked from one process that imported torch once
    (``runtime/forkserver.py``), not started as a Python each that imports torch: a
    cluster starts in about the time of one import, whatever its size, and an idle rank
    shares the imported pages. False: each engine is a fresh process, as ipyparallel
    starts it (MPI, Slurm and ssh engines always are)."""

    preload_ranks: bool | None = None
    """The fork server also loads what a rank loads at its first optimizer or DDP module
    (``torch._dynamo`` and about 800 modules: some 2 s of CPU each) before it forks the
    ranks, so they share one load. It delays the start by that load, once, and saves it in
    every rank's first training cell. None (the default): when there are more local ranks
    than cores, where the ranks' own loads would queue for the cores (32 ranks on 2 cores:
    about 34 s); spares and the ranks of a restart or heal always get it."""

    def preloads(self, local_ranks: int) -> bool:
        if self.preload_ranks is not None:
            return self.preload_ranks
        return local_ranks > (os.cpu_count() or 1)

    rank_scheduling: str = "auto"
    """How Linux schedules each rank's threads (``%dist_init --scheduling``): ``"batch"``
    (``SCHED_BATCH``: a thread that wakes does not take the core from the one running
    there; Gloo's DDP steps ran 1.95x as fast on 2 cores: docs/guide.md, "Defaults for
    interactive use") or ``"normal"``. ``"auto"`` (the default): batch for ranks on CPU
    (Gloo), normal on GPUs. The notebook keeps the normal policy."""

    spares_after_s: float = 3.0
    """The warm pool starts filling once a cluster has run this long, not while it
    starts: a cluster stopped sooner (a script's, a test's) never waits for a spare."""

    heal: str = "off"
    """``"auto"`` (``%dist_init --heal auto``): when a rank dies in a cell, it is healed at
    once (``%dist_heal``), copying ``heal_copy`` from a survivor, and the cell says what was
    replayed and copied. ``"off"``: the cell says how the rank died and what to run."""

    heal_copy: tuple[str, ...] = ()
    """The variables an automatic heal copies to the new rank (``--heal-copy model,opt``)."""

    start_timeout_s: float = 120.0
    """How long to wait for every engine to start and register before giving up."""

    hang_after_s: float = 10.0
    """While a cell runs, when no rank has made progress for this long the notebook shows
    a diagnosis (``--hang-after`` per cell). Progress: a collective completing, the stack
    moving to another line, output, or an ``nd.report``."""

    release_after_error_s: float = 2.0
    """When a rank has raised and the others stop making progress for this long (or are
    inside a collective), they are released from their collectives so the cell ends
    in seconds rather than after the collective timeout."""

    abandon_after_death_s: float = 5.0
    """Once a rank has died and the others were interrupted (``release_after_error_s``
    after the death), how much longer the cell waits for them before it ends without."""

    interrupt_grace_s: float = 1.0
    """The stop button: how long the ranks get to stop on SIGINT before those still running
    (blocked in a collective, where SIGINT cannot land) are released; and, after the release,
    before a second SIGINT."""

    release_grace_s: float = 3.0
    """After a release, how long the released ranks get to leave their collectives."""

    output_grace_s: float = 15.0
    """When every rank has finished, how long to wait for the rest of their output (a big
    output on a busy machine can take seconds)."""

    output_grace_dead_s: float = 1.0
    """The same when a rank died: a dead rank's end of output never comes."""

    fold_from_ranks: int = 4
    """From this many ranks up, a line that several ranks print alike is shown once with
    their ranks (``[ranks 0-7] epoch 1 done``); 0 never folds. ``%%distributed
    --raw-output`` shows one cell's per-rank streams as they are."""

    fold_window_s: float = 0.3
    """How long a line waits for the other ranks' copy before it is shown on its own (one
    rank's lines are never reordered)."""

    dashboard: str = "auto"
    """``auto`` (live widgets in Jupyter, text elsewhere), ``widget``, ``text`` or ``off``;
    ``%%distributed --no-dashboard`` turns it off for one cell."""

    dashboard_full_table: bool = False
    """From 9 ranks the dashboard groups the ranks by what they do (the stuck and the slow
    first) with one square per rank, and the full table one click away in a notebook; in
    the text form (a terminal, nbconvert) True prints every rank's row instead. The same
    holds for the table of a hang's verdict (the ranks whose rows read the same share one)."""

    dashboard_quiet_s: float = 1.0
    """A cell that ends sooner than this, with no ``nd.report``, error, release or hang,
    leaves one line (ranks, backend, time, states) instead of the full table, and never
    opens a widget: a tutorial must not become a wall of tables. 0 keeps the full record
    under every cell."""

    check_collectives: bool = False
    """Compare every collective's arguments across the ranks before it runs (op, dtypes,
    shapes where they must agree, root, reduce op), as ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    does: a mismatch then raises on every rank, all alive with their variables, instead of
    Gloo aborting a rank, a hang or silently wrong numbers. Costs one small all_gather per
    collective (the guide gives the figure); ``%%distributed --check-collectives`` turns it
    on for one cell."""

    heartbeat_ms: int = 100
    """ipyparallel's controller heartbeat period. A new engine is counted as registered at
    the beat after its first answer, so each waits up to two periods: at ipyparallel's 3 s
    default most of a cluster's start-up, at 300 ms still 0.5 s of a 2-s start
    (measured). The heart runs in a C thread that a busy rank does not block."""

    heartbeat_dead_s: float = 3.0
    """An engine whose heart has not answered for this long is declared dead (as many
    missed beats as fit in it)."""

    def heartbeat_misses(self) -> int:
        """The controller's allowed missed beats: ``heartbeat_dead_s`` at ``heartbeat_ms``."""
        return max(1, math.ceil(1000 * self.heartbeat_dead_s / self.heartbeat_ms))

    publish_interval_s: float = 0.5
    """How often each rank's agent thread reports its state while a cell runs."""

    nccl_async_error_handling: str = "0"
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING``: 0, the watchdog only marks a failed or timed-out
    collective and leaves the process alone. The notebook owns recovery: the hang doctor
    shows a stuck collective, and releasing it aborts the NCCL communicators from the
    rank's agent thread, as torch's ``_abort_process_group`` asks (the watchdog must not
    abort them too). torch's default, 3, tears the process down: the engine and everything
    the user built in it. 2 would abort silently at the collective timeout."""

    nccl_env: dict[str, str] = field(
        default_factory=lambda: {
            # the heartbeat monitor kills a process whose watchdog it thinks is stuck, and
            # after a timeout it dumps and exits every rank of the group: never in a notebook
            "TORCH_NCCL_ENABLE_MONITORING": "0",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            # errors the watchdog sees are logged, not rethrown in a thread that ends the process
            "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
            # start times in the Flight Recorder: a kernel that runs tells "started" from "scheduled"
            "TORCH_NCCL_ENABLE_TIMING": "1",
        }
    )
    """More NCCL settings for interactive use, each a reason above; set per rank. A user-set
    value that differs is replaced and named when the cluster starts."""

    flight_recorder_entries: int = 2000
    """``TORCH_FR_BUFFER_SIZE`` for each rank where neither it nor its old name
    (``TORCH_NCCL_TRACE_BUFFER_SIZE``) is set: how many collectives torch's Flight Recorder
    keeps. The hang doctor reads it for the collectives torch issues itself (DDP's, DTensor's)
    and ``--profile`` for where each rank arrived at each collective. torch 2.11 and newer keep
    2000 by default, 2.8-2.10 none unless it is set, and NCCL before 2.8 reads the old name
    (set too there). 0 turns the recorder off; the doctor then reads the ranks' stacks, and
    a profile names no straggler."""

    omp_num_threads: str | None = "1"
    """``OMP_NUM_THREADS`` for each rank when the user has not set it, as torchrun does:
    several ranks on one machine otherwise oversubscribe the cores."""

    loopback_only: bool = True
    """Single-machine clusters talk over loopback only: the controller binds 127.0.0.1,
    ``MASTER_ADDR`` is 127.0.0.1 and Gloo uses the ``lo`` interface."""

    python: str = field(default_factory=lambda: sys.executable)
    """The Python interpreter the engines run (default: the kernel's own). It needs
    notebook_dist, ipyparallel and torch importable; this is checked when the cluster
    starts, and an engine that cannot start is reported with the end of its log."""

    slurm: dict[str, str] = field(default_factory=dict)
    """For ``--launcher slurm``: ipyparallel's Slurm launcher settings, ``queue`` (the
    partition), ``account``, ``qos``, ``timelimit``, and ``options`` (more ``#SBATCH``
    lines, e.g. ``"--gres=gpu:1 --cpus-per-task=4"``; ``%dist_init --sbatch``)."""

    ssh: dict = field(default_factory=dict)
    """For ``--launcher ssh``: ipyparallel's SSH launcher settings, e.g. ``ssh_args`` and
    ``scp_args`` (lists; ``%dist_init --ssh "-i KEY -o ..."`` sets both),
    ``remote_profile_dir`` (default: a fresh folder in each host's /tmp, removed at
    shutdown). The engines run ``python`` on each host."""

    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment variables for every rank (set before torch initialises CUDA)."""

    def rank_overrides(self) -> dict[str, str]:
        """Environment every rank gets; user-set values that differ are reported."""
        env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": self.nccl_async_error_handling, **self.nccl_env}
        if self.loopback_only and os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        env.update(self.extra_env)
        return env

    def launch_env(self) -> dict[str, str]:
        """Environment the engine processes start with (before any user code)."""
        env = {"PYTHONUNBUFFERED": "1", "NOTEBOOK_DIST_ENGINE": "1"}
        # torch.profiler's C++ side (kineto) prints a line at every start and stop of a
        # profile, at its highest level (USDT); 6 is above it (%%distributed --profile)
        if "KINETO_LOG_LEVEL" not in os.environ:
            env["KINETO_LOG_LEVEL"] = "6"
        if self.omp_num_threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = self.omp_num_threads
        return env


def scheduling(config: DistConfig, backend: str) -> str:
    """The policy a rank of ``backend`` runs under, ``"batch"`` or ``"normal"``
    (``DistConfig.rank_scheduling``)."""
    asked = config.rank_scheduling
    if asked not in SCHEDULING:
        said = ", ".join(repr(s) for s in SCHEDULING)
        raise ValueError(f"DistConfig.rank_scheduling {asked!r}: give {said}")
    if asked == "auto":
        return "batch" if backend == "gloo" else "normal"
    return asked
