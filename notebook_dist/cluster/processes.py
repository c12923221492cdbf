"""The processes of a cluster: the ipyparallel controller and one engine per rank, started
through a :class:`~notebook_dist.cluster.launchers.Launcher`, watched by the reaper (so a
killed kernel leaves nothing), and ended by pid, only what was started here.

Ranks are positions in :attr:`Processes.engine_ids`, never raw engine ids (ids change when
engines restart).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Any

from ..config import DistConfig
from ..errors import ClusterError, PreflightError
from ..phrases import HEARTBEAT_GONE, PROCESS_GONE, describe_exit, each_rank
from ..reaper import Reaper
from ..runtime import bootstrap as rt_bootstrap
from ..runtime import host as rt_host
from ..runtime.state import rank_file
from ..signals import ExitWatch, Started
from . import engines, reports
from .launchers import Launcher

log = logging.getLogger("notebook_dist")
# ipyparallel logs through this logger (an engine's whole start-up log when it exits
# badly, at WARNING): without a handler of its own, Python's last resort would print it
# under the user's cell. The doctor says what a dead rank means; logging.basicConfig (or a
# handler on "notebook_dist") shows these records to whoever wants them.
log.addHandler(logging.NullHandler())


#: the control folders made so far
_MADE: set[str] = set()


class Processes:
    """Start, watch and stop the controller and engines of one cluster."""

    def __init__(self, config: DistConfig, launcher: Launcher):
        self.config = config
        self.launcher = launcher
        self.here = rt_host.machine_id()
        self.ipp = None  # the ipyparallel Cluster
        self.client = None
        self.engine_ids: list[int] = []  # in rank order
        self.reaper: Reaper | None = None
        self.profile_dir: str | None = None
        self.ranks: list = []  # RankInfo, once the engines are ranks
        #: rank -> the launcher of its engine (its exit code; for ssh, the way to its host)
        self.rank_launchers: dict[int, Any] = {}
        self.by_pid: dict[int, Any] = {}
        #: every local process this cluster started, as recorded when it started: the only
        #: ones it ever signals (notebook_dist.signals)
        self.started: list[Started] = []
        #: rank -> its engine's process, for ranks on this machine
        self.rank_procs: dict[int, Started] = {}
        #: dead ranks' reports that their witness completed, by (rank, pid) (``reports``)
        self.ended: dict[tuple[int, int], dict] = {}
        from .spares import SparePool

        #: ranks' engines being ended after a restart took fresh ones (joined at stop)
        self.retiring: list = []

        #: idle engines ready to stand in for dead ranks (notebook_dist.heal)
        self.pool = SparePool(self, config.spare_engines if self.spares_possible() else 0)
        #: the process the local engines are forked from (cluster/forks.py), if any
        self.forks = None
        #: the notebook's calls' direct route to local engines (cluster/lane.py), if any
        self.lane = None
        self.controller: ExitWatch | None = None  # whether the controller still runs

    # ---- starting ---------------------------------------------------------------------

    def start(self, n: int, first_registered=None) -> list[dict] | None:
        """The controller, then ``n`` engines, until all registered. Returns the engines'
        probes in rank order when the launcher orders ranks by them, else None. Ranks that
        follow the engines' ids: ``first_registered(id)`` once rank 0's engine registered."""
        self.profile_dir = tempfile.mkdtemp(prefix="notebook_dist-")
        self.reaper = Reaper()
        self.reaper.remove_on_exit(self.profile_dir)
        launcher = self.launcher
        start_fork_server(self)  # importing torch while ipyparallel starts the controller
        if self.forks is not None and self.config.preloads(n):
            self.forks.preload()  # (queued behind torch's import; before any fork)
        self.ipp = cluster = ipp_cluster(self.config, launcher, self.profile_dir, n)
        cluster.start_controller_sync()
        controller = self.record(cluster.controller, "controller")
        if controller is not None:
            self.reaper.watch(controller, anchor=True)
            self.controller = ExitWatch(controller)
        # a fork server with nothing left to load (started ahead): the engines are forked
        # while the controller starts, and wait for its file. Else the client connects, and
        # imports what its first call needs, while the server still imports torch (engines
        # that register before it connects are in its list)
        early = self.forks is not None and self.forks.forks_now(self.config.preloads(n))
        started = engines.start_recorded(self, n) if early else None
        self.client = client = cluster.connect_client_sync()
        if self.config.direct_lane:
            engine_file = engines.connection_file(None, self.profile_dir, self.cluster_id, "engine")
            self.lane = open_lane(self, n, engine_file)
        prepare_first_call()
        engine_set, launchers, _ = started or engines.start_recorded(self, n)
        wait_registered(
            self,
            n,
            lambda: launcher.check_starting(engine_set, launchers, len(client.ids), n),
            None if launcher.ordered_by_probe else first_registered,
        )
        self.engine_ids = sorted(client.ids)[:n]
        #: pid -> launcher of every engine started here (the ranks', spares' added later)
        self.by_pid = {p.pid: el for el in launchers for p in self.started if p.pid == el.pid}
        if not launcher.ordered_by_probe:
            return None
        from ..plan import rank_order

        # MPI rank, SLURM_PROCID or the place in --hosts, whichever engine registered first
        probes = engines.answered(
            self.view(self.engine_ids),
            rt_host.probe,
            within=self.config.start_timeout_s,
            what="which rank its launcher made it",
        )
        probes = dict(zip(self.engine_ids, probes))
        self.engine_ids = rank_order(probes)
        return [probes[e] for e in self.engine_ids]

    def record(self, el, what: str) -> Started | None:
        """A launcher's process, if it is one this process started, or its fork server
        did (a launcher's ``pid`` is -1 until its process exists, and an ssh launcher's
        pid is on another host)."""
        if not engines.is_local(el):
            return None
        parent = getattr(el, "parent_pid", None) or os.getpid()
        proc = Started.record(getattr(el, "pid", None), what, parent=parent)
        if proc is not None:
            self.started.append(proc)
        return proc

    def ranks_joined(self, ranks: list) -> None:
        """The engines are ranks now: each rank's launcher and process. Ranks that are not
        this process's children (mpiexec's, a Slurm job's) are recorded as they reported
        themselves when they joined (pid and start time, from inside the rank), and watched
        by the reaper."""
        self.ranks = ranks
        ours = {p.pid: p for p in self.started}
        for r in ranks:
            self.rank_launchers[r.rank] = self.by_pid.get(r.pid)
            if not self.local(r.rank):
                continue
            proc = ours.get(r.pid)
            if proc is None and self.launcher.watch_rank_pids:
                proc = Started.reported(r.pid, r.start, f"rank {r.rank}")
                if proc is not None:
                    self.started.append(proc)
                    if self.reaper is not None:
                        self.reaper.watch(proc)
            if proc is not None:
                self.rank_procs[r.rank] = proc

    def spares_possible(self) -> bool:
        """Whether more engines can be started for this cluster from here (local only)."""
        return self.launcher.name == "local"

    @property
    def cluster_id(self) -> str:
        return self.ipp.cluster_id

    # ---- reaching the ranks -----------------------------------------------------------

    def view(self, engine_ids: list[int]):
        """A non-blocking view on these engines."""
        view = self.client.direct_view(list(engine_ids))
        view.block = False
        return view

    def rank_view(self, ranks: list[int]):
        """A non-blocking view on these ranks, its requests on the direct lane when every
        one of them can take it."""
        ids = [self.engine_ids[r] for r in ranks]
        view = self.lane.view(ids, self.view) if self.lane is not None else None
        return view if view is not None else self.view(ids)

    def local(self, rank: int) -> bool:
        """Whether the rank runs on this machine (its pid can be signalled here)."""
        return self.ranks[rank].machine in ("", self.here)

    def host_launcher(self, rank: int):
        """The launcher of a rank on another host (its control files are there), else None."""
        if not self.launcher.remote or self.local(rank):
            return None
        remote = [el for el in self.all_launchers() if not engines.is_local(el)]
        return remote[rank] if rank < len(remote) else None

    def control_file(self, rank: int, kind: str = "release", pid: int | None = None) -> str:
        """A rank's control file (``runtime.state.rank_file``)."""
        folder = os.path.join(self.profile_dir, "control")
        if folder not in _MADE:  # (asked for every rank before each cell)
            os.makedirs(folder, exist_ok=True)
            _MADE.add(folder)
        return rank_file(folder, kind, rank, pid)

    # ---- watching ---------------------------------------------------------------------

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has ended, with how it ended."""
        dead = {}
        registered: set[int] | None = None
        for r in self.ranks:
            el = self.rank_launchers.get(r.rank)
            if el is not None:
                if el.exited.is_set():
                    dead[r.rank] = describe_exit(el.exit_code)
            elif self.local(r.rank):  # started by mpiexec or someone else: no exit code
                if not still_running(r):
                    dead[r.rank] = unseen_exit(self, r, PROCESS_GONE)
            else:
                if registered is None:
                    registered = set(self.client.ids) if self.client is not None else set()
                if r.engine_id not in registered:
                    dead[r.rank] = unseen_exit(self, r, HEARTBEAT_GONE)
        return dead

    def controller_alive(self) -> bool:
        return self.controller is not None and self.controller.running()

    def check_alive(self, ranks: list[int]) -> None:
        """Refuse at once (nothing is sent) when the controller or a selected rank is gone."""
        if not self.controller_alive():
            raise ClusterError(
                "the ipyparallel controller of this cluster is gone (it crashed or was killed), and its "
                "engines were ended with it. Run %dist_restart for a fresh cluster (add --replay to rebuild your state)."
            )
        dead = {r: how for r, how in self.dead_ranks().items() if r in ranks}
        if dead:
            raise ClusterError(ended_message(dead, len(self.ranks), self.spares_possible()))

    # ---- stopping ---------------------------------------------------------------------

    def all_launchers(self) -> list:
        if self.ipp is None:
            return []
        out = []
        for es in self.ipp.engines.values():
            out.extend(getattr(es, "launchers", {}).values() or [es])  # mpiexec: the set itself
        return out

    def stop(self, also_remove: tuple[str | None, ...] = ()) -> list[Started]:
        """Stop every process started here, by pid; remove the cluster's folders. Returns
        the recorded processes that were still running and had to be ended here."""
        self.pool.close()  # no engine starts while the cluster stops
        for ending in self.retiring:
            ending.join()
        launchers = self.all_launchers()  # (stopping the cluster forgets them)
        exit_idle_ranks(self)
        if self.lane is not None:
            self.lane.close()
        if self.client is not None:
            within(self.client.close, CLIENT_CLOSE_S, "ipyparallel's client closing")
        if self.ipp is not None:
            # this is the cluster's stop: what it could not stop, we end below. ipyparallel's
            # own at exit would ask each engine's host over ssh again, as the kernel ends
            self.ipp.shutdown_atexit = False
            watches = engines.stop_watching(launchers)
            within(self.ipp.stop_cluster_sync, STOP_CLUSTER_S, "ipyparallel stopping the cluster")
            stop_loop_thread(self.ipp)
            engines.remove_remote_dirs(launchers, also=self.profile_dir)
            engines.watches_ended(watches, STOP_WATCHING_S)
        if self.forks is not None:
            self.forks.close()
        # whatever ipyparallel did not stop, we do: only what was recorded as started here
        from ..signals import end

        ended = end(self.started)
        if self.controller is not None:
            self.controller.close()
        if self.reaper is not None:
            self.reaper.release()
        for path in (self.profile_dir, *also_remove):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        return ended


#: how long a stop waits for ipyparallel's client to close (its IO thread to end), and for
#: ipyparallel to stop the controller and engines: neither wait of its own has an end, and
#: whatever it has not stopped by then is ended here by its record
CLIENT_CLOSE_S = 5.0
STOP_CLUSTER_S = 30.0
#: how long a stop waits for ipyparallel's watch on each engine on another host to end
#: (its ssh call under way: 15 s at most to a host that stopped answering)
STOP_WATCHING_S = 20.0


def within(call, wait_s: float, what: str) -> bool:
    """``call()`` on a thread of its own, waited for at most ``wait_s`` seconds: whether it
    returned. A stop goes on past a wait that would not end (a callback stuck on the
    client's IO thread, say) rather than hang the notebook; its failure is logged."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        except Exception as exc:
            log.debug("%s failed: %s", what, exc)
        finally:
            done.set()

    threading.Thread(target=run, name="notebook_dist-stop", daemon=True).start()
    if done.wait(wait_s):
        return True
    log.warning("notebook_dist: %s did not end within %.0f s; going on without it", what, wait_s)
    return False


def exit_idle_ranks(processes: Processes, wait_s: float = 2.0) -> None:
    """Idle ranks end themselves at once: a rank's interpreter can take seconds to exit
    on SIGTERM (joining torch's store and Gloo threads), which ipyparallel then waits
    out. Busy or unreachable ranks are left to the TERM/KILL that follows."""
    if processes.client is None or not processes.engine_ids:
        return
    launchers = [
        el for el in processes.rank_launchers.values() if el is not None and not el.exited.is_set()
    ]
    others = [
        proc for r, proc in processes.rank_procs.items() if processes.rank_launchers.get(r) is None
    ]
    if not launchers and not others:
        return
    from ..signals import is_running

    try:
        processes.view(processes.engine_ids).apply_async(rt_bootstrap.exit_now)
    except Exception:
        return
    deadline = time.monotonic() + wait_s
    for el in launchers:
        el.exited.wait(max(0.0, deadline - time.monotonic()))
    while any(is_running(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)


def ended_message(dead: dict[int, str], world_size: int, healable: bool = True) -> str:
    """What to say of ranks whose processes have ended, and what to do (``healable``: the
    cluster can start stand-ins, %dist_heal)."""
    what = each_rank(sorted(dead.items()))
    if len(dead) == world_size and world_size > 1:
        return (
            f"Every rank has ended: {what}. Their variables are gone. Run %dist_restart for fresh "
            "ranks (add --replay to re-run your setup cells), or %dist_shutdown."
        )
    if healable:
        return (
            f"{what}. Run %dist_heal for a fresh rank in its place while the others keep "
            "their variables (--copy NAMES gives it yours), or %dist_restart for a fresh set "
            "of ranks (or %dist_shutdown)."
        )
    return f"{what}. Run %dist_restart for a fresh set of ranks (or %dist_shutdown)."


def stop_note(world_size: int, dead: dict[int, str], controller_gone: bool = False) -> str:
    """What stopping a cluster stopped, as a phrase ("the controller and 2 ranks"); ranks
    that had already ended (``dead``) are named with how they ended."""
    alive = world_size - len(dead)
    parts = ["the controller"] if not controller_gone else []
    if alive:
        parts.append(f"{alive} rank{'s' if alive != 1 else ''}")
    said = " and ".join(parts) or "nothing left running"
    if dead:
        what = each_rank(sorted(dead.items()))
        if len(dead) == world_size:
            said += f"; every rank had already ended ({what})"
        else:
            said += f"; {what} before"
    return said


def ipp_cluster(config: DistConfig, launcher: Launcher, profile_dir: str, n: int):
    """ipyparallel's Cluster for ``n`` engines of ``launcher``, in ``profile_dir``."""
    import ipyparallel as ipp
    from traitlets.config import Config

    cfg = Config()
    section = getattr(cfg, launcher.ipp_class.__name__)
    for key, value in launcher.settings(profile_dir).items():
        setattr(section, key, value)
    section.engine_cmd = launcher.engine_cmd()
    section.environment = engine_environment(config, launcher)
    cfg.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", CONTROLLER_MODULE]
    cfg.LocalControllerLauncher.environment = controller_environment()
    return ipp.Cluster(
        n=n,
        profile_dir=profile_dir,
        controller_ip=launcher.controller_ip(),
        engine_launcher_class=launcher.ipp_class,
        controller_args=[
            f"--HeartMonitor.period={int(config.heartbeat_ms)}",
            f"--HeartMonitor.max_heartmonitor_misses={config.heartbeat_misses()}",
        ],
        delay=0.0,
        # no cluster file for `ipcluster list` (the profile is a temporary folder of its
        # own); writing one reads every installed package's entry points, 0.07 s a start
        cluster_file="",
        send_engines_connection_env=False,  # engines start with the controller and wait for its file
        log=log,
        load_profile=False,
        engine_timeout=int(config.start_timeout_s),
        config=cfg,
        parent=None,
    )


#: ipyparallel's controller, started sooner (see there)
CONTROLLER_MODULE = "notebook_dist.runtime.controller"


def controller_environment() -> dict[str, str]:
    """What the controller's environment adds to the kernel's: the folder notebook_dist is
    imported from, first on its path (it may be importable here only from the kernel's
    own folder, where the controller does not start)."""
    import notebook_dist

    where = os.path.dirname(os.path.dirname(os.path.abspath(notebook_dist.__file__)))
    return {"PYTHONPATH": os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p)}


#: the id ipyparallel's controller gives the first engine of a cluster (rank 0's, when ranks
#: follow the engines' ids)
FIRST_ENGINE_ID = 0


#: how often a start asks the controller which engines registered, for those whose
#: notification the client missed (:func:`sync_registered`: one round trip)
SYNC_EVERY_S = 0.1


def wait_registered(processes: Processes, n: int, check_starting, first=None) -> None:
    """Until ``n`` engines registered at the client (``check_starting()`` raises when the
    launcher knows they cannot), or the start's time is up; ``first(engine_id)`` is called
    once the first engine has registered (at the latest, with the last one)."""
    client, timeout_s = processes.client, processes.config.start_timeout_s
    deadline = time.monotonic() + timeout_s
    next_sync = time.monotonic()  # (engines forked early register while the client connects)
    while True:
        if first is not None and FIRST_ENGINE_ID in client.ids:
            first, call = None, first
            call(FIRST_ENGINE_ID)
        if len(client.ids) >= n:
            return
        check_starting()
        if time.monotonic() > next_sync:
            sync_registered(client)
            next_sync = time.monotonic() + SYNC_EVERY_S
        if time.monotonic() > deadline:
            raise ClusterError(
                f"only {len(client.ids)} of {n} engines registered within "
                f"{timeout_s:.0f} s; their logs are kept in {keep_logs(processes)}"
            )
        time.sleep(0.005)


def prepare_first_call() -> None:
    """What the client's first call imports (ipyparallel's serialization imports numpy to
    know its arrays, about 0.1 s here), imported while the engines start, rather than on
    the way to the ranks' group."""
    from ipyparallel.serialize import canning

    canning.can(None)
    canning.uncan(None)


def sync_registered(client) -> None:
    """Complete the client's list of engines from the controller's own. ipyparallel's client
    learns of each engine from a notification, and misses the one sent while it connects
    (its subscription is made after it asked for the engines registered so far): seen
    under load, one of 16 engines registered at the controller and never at the client."""
    try:
        reply = client._send(client._query_stream, "connection_request").result(timeout=5)
    except Exception:  # the controller's own failure is found by the caller's checks
        return
    engines = reply["content"].get("engines") or {}
    if set(map(int, engines)) - set(client.ids):
        client._io_loop.add_callback(client._update_engines, engines)  # its own thread's dicts


def keep_logs(processes: Processes) -> str:
    """A copy of the cluster's logs as they are now, for a start that failed: stopping it
    removes its folder, and ipyparallel removes each engine's log as the engine ends."""
    kept = tempfile.mkdtemp(prefix="notebook_dist-failed-start-")
    shutil.copytree(os.path.join(processes.profile_dir, "log"), kept, dirs_exist_ok=True)
    return kept


def start_fork_server(processes: Processes) -> None:
    """The fork server local engines come from (``forks.py``), recorded and watched as the
    cluster's own; for a launcher that does not fork, one started ahead is ended."""
    from . import forks

    if not processes.launcher.forks_engines:  # one started ahead serves no one now
        return forks.end_ahead()
    env = fork_environment(processes.config, processes.launcher)
    processes.forks = server = forks.start(processes.config, env, processes.profile_dir)
    proc = Started.record(server.pid, "fork server", parent=os.getpid())
    if proc is not None:
        processes.started.append(proc)
        processes.reaper.watch(proc)


def open_lane(processes: Processes, n: int, engine_file: str, wait_s: float = 5.0):
    """The cluster's direct lane (``cluster/lane.py``), and its relay if it is asked for.
    On a cluster on this machine alone it listens on loopback; otherwise where the
    controller listens for its engines (its ``engine_file``, waited for ``wait_s``), so
    that ranks on other hosts reach the notebook where they reach the controller, and
    their cells no longer pass through its queue. None when it cannot listen there (the
    queue carries every call, as without a lane)."""
    from .lane import Lane

    config = processes.config
    pipes = os.path.join(processes.profile_dir, "lane") if config.lane_pipes else None
    if config.loopback_only and not processes.launcher.remote:
        lane = Lane(processes.client, "127.0.0.1", pipes)
        start_relay(processes, lane, n)
        return lane
    try:
        ip, host = engines.engines_address(engine_file, wait_s)
        return Lane(processes.client, ip, pipes, host)
    except Exception as exc:  # (zmq: an address this machine cannot listen on)
        log.debug("no direct lane for this cluster: %s", exc)
        return None


def start_relay(processes: Processes, lane, n: int) -> None:
    """The ``lane``'s relay (``cluster/relay.py``) for ``n`` ranks, if ``relay_from`` asks for
    one, recorded and watched as the controller is; without it (it did not start) the ranks
    are reached directly."""
    from .relay import RelayLink

    if processes.config.relay_from is None or n < processes.config.relay_from:
        return
    try:
        link = RelayLink.start(
            processes.config.python,
            processes.client.session,
            lane.route.url,
            "127.0.0.1",
        )
    except RuntimeError as exc:
        log.warning("notebook_dist: %s; the ranks are reached directly", exc)
        return
    if link.record is not None:
        processes.started.append(link.record)
        processes.reaper.watch(link.record)
    lane.route.relay = link


def fork_ahead(config: DistConfig):
    """Start the fork server of local engines now, before any cluster (``forks.py``): the
    first cluster of the same environment then does not wait for torch's import. Nothing
    where this process's /proc is another PID namespace's: the start says why it refuses."""
    from ..signals import foreign_proc
    from .forks import start_ahead

    if foreign_proc():
        return None

    return start_ahead(config, fork_environment(config, Launcher(config)))


def fork_environment(config: DistConfig, launcher: Launcher) -> dict[str, str]:
    """The whole environment a fork server starts with: the kernel's and the engines'."""
    return {**os.environ, **engine_environment(config, launcher)}


def engine_environment(config: DistConfig, launcher: Launcher) -> dict[str, str]:
    """What the engines' environment adds to the kernel's. The ranks' whole environment is
    in place when the process starts, before torch is imported (by the fork server, or by
    the engine's own thread meanwhile: runtime/engine.py) and can read any of it."""
    return {**config.launch_env(), **config.rank_overrides(), **launcher.environment()}


def unseen_exit(processes: Processes, r, gone: str) -> str:
    """How a rank found ``gone`` ended, whose exit status is not seen here: as its witness
    wrote it (``runtime/witness.py``), read here for a rank on this machine, as the doctor
    read it for one on another host (not read again over ssh); ``gone`` when not known."""
    key = (r.rank, r.pid)
    if key not in processes.ended and processes.local(r.rank) and not processes.launcher.exits_seen:
        reports.rank_report(processes, r.rank, r.pid)
    status = processes.ended.get(key, {}).get("status")
    return gone if status is None else describe_exit(status)


def still_running(rank) -> bool:
    """Whether a rank's process on this machine still runs: the same pid and start time it
    reported when it joined, and not a zombie."""
    from ..signals import Started, is_running

    proc = Started.reported(rank.pid, rank.start)
    return proc is not None and is_running(proc)


def stop_loop_thread(obj) -> None:
    """ipyparallel runs ``*_sync`` calls made inside a running event loop (a Jupyter
    kernel) on a thread with its own loop, and never stops it: one thread and its
    descriptors per cluster. Stop it with the cluster."""
    thread = getattr(obj, "_async_thread", None)
    loop = getattr(obj, "_thread_loop", None)
    if thread is None or loop is None:
        return
    try:
        loop.add_callback(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close(all_fds=True)
    except Exception as exc:  # a change in ipyparallel's internals must not break shutdown
        log.debug("could not stop ipyparallel's loop thread: %s", exc)
    obj._async_thread = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int, host: str) -> None:
    """Refuse a rendezvous port that is out of range or already taken, before anything starts."""
    if not 1 <= port <= 65535:
        raise PreflightError(f"--port {port}: give a port number between 1 and 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            where = host or "every interface"
            raise PreflightError(
                f"--port {port} is already in use on {where} ({exc.strerror}): choose "
                "another port, or leave --port out to let the system pick a free one"
            ) from None


def check_python(python: str) -> None:
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise PreflightError(
            f"the engines' Python {python!r} does not exist or is not executable: "
            "set DistConfig.python to a Python with notebook_dist and torch installed"
        )
