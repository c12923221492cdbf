"""DistCluster: an ipyparallel cluster whose engines are torch.distributed ranks.

The Python API every magic calls; it works without IPython:

>>> from notebook_dist import DistCluster
>>> with DistCluster(n=2) as c:
...     c.run("import torch.distributed as dist\\ndist.get_rank()").values
RankValues({0: 0, 1: 1})

Ranks are positions in the cluster's ordered engine list, never raw engine ids
(ids change when engines restart).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, TextIO

from . import launch
from .config import DistConfig
from .errors import ClusterError, PreflightError, TransferError
from .execute import CellResult, PreparedCell, collect, prepare_cell
from .plan import ClusterPlan, plan_cluster, plan_on_engines, rank_order
from .ranks import parse_ranks
from .reaper import Reaper
from .runtime import bootstrap as rt_bootstrap
from .runtime import cell as rt_cell
from .runtime import recover as rt_recover
from .values import RankValues, pack_named, shm_dir_for, unpack
from .watch import CellWatch

log = logging.getLogger("notebook_dist")
# ipyparallel logs through this logger (an engine's whole start-up log when it exits
# badly, at WARNING): without a handler of its own, Python's last resort would print it
# under the user's cell. The doctor says what a dead rank means; logging.basicConfig (or a
# handler on "notebook_dist") shows these records to whoever wants them.
log.addHandler(logging.NullHandler())


@dataclass
class RankInfo:
    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    backend: str
    machine: str = ""  # machine_id(): which ranks share a host with the notebook


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistCluster:
    """A set of ranks, one ipyparallel engine each, with the default process group ready.

    ``DistCluster(n=None, backend="auto", gpus=None, timeout=None)`` decides the layout
    at once (raising :class:`PreflightError` for a request that cannot work) and starts
    nothing until :meth:`start`.
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
        """``ssh_hosts`` (``--launcher ssh``): engines per host, e.g. ``{"node1": 2}``.
        ``placement``: for engines that already run, their probes in rank order and this
        machine's id (see :func:`notebook_dist.plan.plan_on_engines`)."""
        self.config = config or DistConfig()
        self.launcher = _check_launcher(launcher)
        self._here = rt_bootstrap.machine_id()
        self.ssh_hosts: dict[str, int] = {}
        if self.launcher == "ssh":
            self.ssh_hosts = launch.spread_over_hosts(ssh_hosts or {}, n)
            if self.config.loopback_only:
                raise PreflightError(
                    "--launcher ssh starts ranks on other hosts, so they must meet over the "
                    "network: add --network (the controller then listens on this machine's "
                    "address towards the hosts, rank 0's rendezvous store and Gloo on rank 0's; "
                    "ipyparallel's messages stay HMAC-signed, the ranks' traffic is not encrypted)"
                )
            if shutil.which("ssh") is None:
                raise PreflightError(
                    "--launcher ssh needs ssh on the PATH (apt-get install openssh-client)"
                )
        self._mpiexec = shutil.which("mpiexec") if self.launcher == "mpi" else None
        if self.launcher == "mpi" and self._mpiexec is None:
            raise PreflightError(
                "--launcher mpi needs mpiexec on the PATH (Debian/Ubuntu: apt-get install "
                "openmpi-bin, or load your MPI module)"
            )
        if self.launcher == "slurm" and shutil.which("sbatch") is None:
            raise PreflightError(
                "--launcher slurm needs sbatch on the PATH: run the notebook on a Slurm login "
                "node (or load the Slurm module)"
            )
        if timeout is not None:
            if not math.isfinite(timeout) or timeout <= 0:
                raise PreflightError(f"--timeout {timeout}: give a positive number of seconds")
            self.config.timeout_s = float(timeout)
        self.request = {
            "n": n,
            "backend": (backend or "auto").lower(),
            "gpus": gpus,
            "timeout": self.config.timeout_s,
            "port": port,
            "launcher": self.launcher,
            "slurm": dict(self.config.slurm),
            "ssh": (dict(self.ssh_hosts), repr(self.config.ssh)),
        }
        if placement is not None:
            self.plan: ClusterPlan = plan_on_engines(
                *placement, self.config.loopback_only, n, backend, gpus
            )
        elif self.ssh_hosts:  # provisional: the hosts' GPUs are known once their engines run
            hosts = [h for h, count in self.ssh_hosts.items() for _ in range(count)]
            self.plan = plan_cluster(len(hosts), "gloo", None, gpu_ids=[], hosts=hosts)
        else:
            self.plan = plan_cluster(n, backend, gpus)
        self.port = port  # the rendezvous port (MASTER_PORT); None: the OS picks one
        if port is not None and not self.ssh_hosts:
            _check_port(port, self._bind_host())
        if not self.ssh_hosts:  # (a remote Python is checked by ipyparallel over ssh)
            _check_python(self.config.python)
        self.ranks: list[RankInfo] = []
        self.notes: list[str] = list(self.plan.notes)
        self.startup_s: float | None = None
        self._cluster = None
        self._client = None
        self._engine_ids: list[int] = []
        self._launchers: dict[int, Any] = {}  # rank -> RankEngineLauncher
        self._reaper: Reaper | None = None
        self._profile_dir: str | None = None
        self._state = "new"
        self.last_watch: CellWatch | None = None
        self._slurm_checked = 0.0  # when the Slurm job's state was last asked for
        self.shm_dir: str | None = None  # tmpfs folder for large tensors (local clusters)
        #: cells that ran cleanly on every rank since start, for %dist_restart --replay
        self.history: list[PreparedCell] = []

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def cluster_id(self) -> str:
        return self._cluster.cluster_id

    @property
    def running(self) -> bool:
        return self._state == "running"

    def start(self) -> DistCluster:
        """Start the controller and engines, then make every engine a rank."""
        if self._state != "new":
            raise ClusterError(
                f"this cluster is {self._state}; make a new DistCluster to start again"
            )
        self._state = "starting"
        t0 = time.perf_counter()
        try:
            self._start_processes()
            self._bootstrap_ranks()
        except BaseException:
            self.shutdown()
            raise
        self.startup_s = time.perf_counter() - t0
        self._state = "running"
        if self.launcher in ("mpi", "slurm") and self._reaper is not None:  # not our children
            for r in self.ranks:
                self._reaper.watch(r.pid)
        if self.config.loopback_only:  # every rank is on this machine: tensors go through tmpfs
            self.shm_dir = shm_dir_for(self.cluster_id)
            if self.shm_dir and self._reaper is not None:
                self._reaper.remove_on_exit(self.shm_dir)
        return self

    def _start_processes(self) -> None:
        import ipyparallel as ipp
        from traitlets.config import Config

        n = self.world_size
        self._profile_dir = tempfile.mkdtemp(prefix="notebook_dist-")
        self._reaper = Reaper()
        self._reaper.remove_on_exit(self._profile_dir)
        cfg = Config()
        env = self.config.launch_env()
        if self.launcher == "mpi":
            launcher_class = launch.RankMPIEngineSetLauncher
            mpi_args, mpi_env = launch.mpi_settings(self._mpiexec)
            cfg.RankMPIEngineSetLauncher.mpi_cmd = [self._mpiexec]
            cfg.RankMPIEngineSetLauncher.mpi_args = mpi_args
            env.update(mpi_env)
        elif self.launcher == "slurm":
            launcher_class = launch.RankSlurmEngineSetLauncher
            for key, value in self.config.slurm.items():
                setattr(cfg.RankSlurmEngineSetLauncher, key, value)
        elif self.launcher == "ssh":
            launcher_class = launch.RankSSHEngineSetLauncher
            settings = launch.ssh_settings(self.ssh_hosts, self.config, self._profile_dir)
            for key, value in settings.items():
                setattr(cfg.RankSSHEngineSetLauncher, key, value)
        else:
            launcher_class = launch.RankEngineSetLauncher
            cfg.RankEngineSetLauncher.delay = 0.0
        getattr(cfg, launcher_class.__name__).engine_cmd = launch.engine_cmd(
            self.config.python, remote=self.launcher == "ssh"
        )
        getattr(cfg, launcher_class.__name__).environment = env
        if self.launcher == "ssh":  # only the address the hosts reach this machine at
            controller_ip = launch.address_towards(next(iter(self.ssh_hosts)), self.config)
        else:
            controller_ip = "127.0.0.1" if self.config.loopback_only else ""
        self._cluster = cluster = ipp.Cluster(
            n=n,
            profile_dir=self._profile_dir,
            controller_ip=controller_ip,
            engine_launcher_class=launcher_class,
            controller_args=[f"--HeartMonitor.period={int(self.config.heartbeat_ms)}"],
            delay=0.0,
            send_engines_connection_env=False,  # engines start with the controller and wait for its file
            log=log,
            load_profile=False,
            engine_timeout=int(self.config.start_timeout_s),
            config=cfg,
            parent=None,
        )
        cluster.start_controller_sync()
        self._reaper.watch(cluster.controller.pid, anchor=True)
        try:
            engine_set_id = cluster.start_engines_sync(n)
        except subprocess.CalledProcessError as exc:  # sbatch refused the job
            for key, es in list(cluster.engines.items()):
                if getattr(es, "job_id", None) == "":  # no job: nothing for scancel to stop
                    del cluster.engines[key]
            said = (exc.output or b"").decode(errors="replace").strip()
            raise ClusterError(
                f"{' '.join(map(str, exc.cmd))} failed (exit {exc.returncode})"
                + (f": {said}" if said else "")
            ) from None
        except Exception as exc:
            if self.launcher != "ssh":
                raise
            for es in cluster.engines.values():  # stop only the engines that did start
                for key, el in list(es.launchers.items()):
                    if el.pid <= 0:
                        del es.launchers[key]
            raise ClusterError(  # ssh could not log in, or the host has no such Python
                f"could not start the engines over ssh: {exc}. Check that `ssh HOST` works "
                f"without a password (add options with --ssh) and that {self.config.python} "
                "on each host has notebook_dist and torch (DistConfig.python)"
            ) from None
        engine_set = cluster.engines[engine_set_id]
        launchers = list(getattr(engine_set, "launchers", {}).values())
        local = [el for el in launchers if launch.is_local(el)]
        for el in local:
            self._reaper.watch(el.pid)
        if not launchers and self.launcher == "mpi":  # mpiexec: one process starts them all
            self._reaper.watch(engine_set.pid)
        self._client = client = cluster.connect_client_sync()
        deadline = time.monotonic() + self.config.start_timeout_s
        while len(client.ids) < n:
            dead = [el for el in launchers if launch.has_ended(el)]
            if dead:
                code, on_host, log_file, log_tail = launch.end_report(dead[0])
                raise ClusterError(
                    f"an engine{on_host} {launch.describe_exit(code)} while starting"
                    f"{self._import_hint(log_tail)}. Its log ({log_file}) ends:\n{log_tail}"
                )
            if self.launcher == "slurm":
                self._check_slurm_job(engine_set, len(client.ids), n)
            elif not launchers and engine_set.poll() is not None:
                log_tail = launch.tail(engine_set.output_file)
                raise ClusterError(
                    f"{self._mpiexec} exited with code {engine_set.poll()} while starting the "
                    f"engines{self._import_hint(log_tail)}. Its log ({engine_set.output_file}) "
                    f"ends:\n{log_tail}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(client.ids)} of {n} engines registered within "
                    f"{self.config.start_timeout_s:.0f} s; engine logs are in {self._profile_dir}/log"
                )
            time.sleep(0.02)
        self._engine_ids = sorted(client.ids)[:n]
        self._by_pid = {el.pid: el for el in local}
        if self.launcher in ("mpi", "slurm", "ssh"):  # MPI rank / SLURM_PROCID / host order
            probes = dict(
                zip(self._engine_ids, client[self._engine_ids].apply_sync(rt_bootstrap.probe))
            )
            self._engine_ids = rank_order(probes)
            if self.launcher == "ssh":  # now the hosts' GPUs and addresses are known
                ordered = [probes[e] for e in self._engine_ids]
                request = self.request
                self.plan = plan_on_engines(
                    ordered, self._here, False, n, request["backend"], request["gpus"]
                )
                self.notes = list(self.plan.notes)

    def _check_slurm_job(self, engine_set, registered: int, n: int) -> None:
        """While engines register: a job that ended (or was refused) is said at once."""
        now = time.monotonic()
        if now - self._slurm_checked < 1.0:
            return
        self._slurm_checked = now
        state = launch.slurm_job_state(engine_set.job_id)
        if state in (None, "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            log_tail = launch.tail(engine_set.output_file) if engine_set.output_file else "(no log)"
            raise ClusterError(
                f"Slurm job {engine_set.job_id} {'ended' if state is None else state.lower()} "
                f"with {registered} of {n} engines registered{self._import_hint(log_tail)}. "
                f"Its script is {engine_set.batch_file}; its output ends:\n{log_tail}"
            )

    def _import_hint(self, text: str) -> str:
        if "ImportError" not in text and "ModuleNotFoundError" not in text:
            return ""
        return (
            f" (an import failed in the engines' Python, {self.config.python}: install what "
            "is missing there, or set DistConfig.python to a Python that has it)"
        )

    def _bind_host(self) -> str:
        return "127.0.0.1" if self.config.loopback_only else ""

    def _rendezvous_port(self) -> int:
        """A free port on rank 0's host: picked there when rank 0 is on another machine."""
        addr = self.plan.ranks[0].env["MASTER_ADDR"]
        if addr.startswith("127."):
            return free_port()
        return self._client[self._engine_ids[0]].apply_sync(free_port, addr)

    def _bootstrap_ranks(self) -> None:
        client = self._client
        port = self.port or self._rendezvous_port()
        ars = []
        for rp, eid in zip(self.plan.ranks, self._engine_ids):
            env = dict(rp.env, MASTER_PORT=str(port))
            ars.append(
                client[eid].apply_async(
                    rt_bootstrap.bootstrap,
                    env,
                    rp.device,
                    self.plan.backend,
                    self.config.timeout_s,
                    self.config.rank_overrides(),
                    self._control_file(rp.rank),
                    self.config.publish_interval_s,
                )
            )
        infos = []
        for rank, ar in enumerate(ars):
            try:
                infos.append(ar.get(timeout=self.config.start_timeout_s))
            except Exception as exc:
                message = _remote_message(exc)
                raise ClusterError(
                    f"rank {rank} could not join the process group: {message}"
                    + self._import_hint(message)
                ) from None
        self.bootstrap_info = infos  # per rank: import_s, init_s (benchmarks read these)
        overridden: dict[str, str] = {}
        for rank, (info, eid) in enumerate(zip(infos, self._engine_ids)):
            self.ranks.append(
                RankInfo(
                    rank,
                    eid,
                    info["host"],
                    info["pid"],
                    info["device"],
                    info["backend"],
                    info["machine"],
                )
            )
            self._launchers[rank] = self._by_pid.get(info["pid"])
            overridden.update(info["overridden"])
        for key, old in sorted(overridden.items()):
            new = self.config.rank_overrides()[key]
            self.notes.append(
                f"{key} was {old!r} in your environment; ranks use {new!r} (see notebook_dist.config)"
            )

    def _control_file(self, rank: int) -> str:
        os.makedirs(os.path.join(self._profile_dir, "control"), exist_ok=True)
        return os.path.join(self._profile_dir, "control", f"release-rank-{rank}")

    def discard(self) -> None:
        """Let go of a cluster that was planned but will not start (nothing to do here)."""

    def shutdown(self) -> None:
        """Stop every process this cluster started; safe to call more than once."""
        if self._state == "stopped":
            return
        self._state = "stopping"
        # local processes only (a Slurm job has no pid; an ssh launcher's pid is remote)
        launchers = self._all_launchers()  # (stopping the cluster forgets them)
        pids = [getattr(el, "pid", None) for el in launchers if launch.is_local(el)]
        pids += [r.pid for r in self.ranks if self._local(r.rank)]
        if self._cluster is not None and self._cluster.controller is not None:
            pids.append(self._cluster.controller.pid)
        self._exit_idle_ranks()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        if self._cluster is not None:
            try:
                self._cluster.stop_cluster_sync()
            except Exception as exc:
                log.debug("stop_cluster failed: %s", exc)
            _stop_loop_thread(self._cluster)
            launch.remove_remote_dirs(launchers, also=self._profile_dir)
            self._cluster.shutdown_atexit = False  # what it could not stop, we end below
        # whatever ipyparallel did not stop, we do (by pid, only what we started)
        from .reaper import end_processes, process_start_time

        end_processes({pid: process_start_time(pid) for pid in pids if pid})
        if self._reaper is not None:
            self._reaper.release()
        for path in (self._profile_dir, self.shm_dir):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        self._state = "stopped"

    def _exit_idle_ranks(self, wait_s: float = 2.0) -> None:
        """Idle ranks end themselves at once: a rank's interpreter can take seconds to exit
        on SIGTERM (joining torch's store and Gloo threads), which ipyparallel then waits
        out. Busy or unreachable ranks are left to the TERM/KILL that follows."""
        if self._client is None or not self._engine_ids or self._state not in ("stopping",):
            return
        launchers = [
            el for el in self._launchers.values() if el is not None and not el.exited.is_set()
        ]
        others = [
            r.pid for r in self.ranks if self._launchers.get(r.rank) is None and self._local(r.rank)
        ]
        if not launchers and not others:
            return
        try:
            view = self._client.direct_view(self._engine_ids)
            view.apply_async(rt_bootstrap.exit_now)
        except Exception:
            return
        deadline = time.monotonic() + wait_s
        for el in launchers:
            el.exited.wait(max(0.0, deadline - time.monotonic()))
        while any(_pid_running(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _all_launchers(self) -> list:
        if self._cluster is None:
            return []
        out = []
        for es in self._cluster.engines.values():
            out.extend(getattr(es, "launchers", {}).values() or [es])  # mpiexec: the set itself
        return out

    def __enter__(self) -> DistCluster:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        # a garbage-collected cluster must not leave processes behind
        if getattr(self, "_state", "stopped") in ("running", "starting"):
            try:
                self.shutdown()
            except Exception:
                pass

    # ---- ranks ---------------------------------------------------------------------

    def _require_running(self) -> None:
        if self._state != "running":
            raise ClusterError(
                f"the cluster is {self._state}: start one with %dist_init (or DistCluster.start())"
            )

    def _local(self, rank: int) -> bool:
        """Whether the rank runs on this machine (its pid can be signalled here)."""
        return self.ranks[rank].machine in ("", self._here)

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has ended, with how it ended."""
        dead = {}
        registered: set[int] | None = None
        for r in self.ranks:
            el = self._launchers.get(r.rank)
            if el is not None:
                if el.exited.is_set():
                    dead[r.rank] = launch.describe_exit(el.exit_code)
            elif self._local(r.rank):  # started by mpiexec or someone else: no exit code
                if not _pid_running(r.pid):
                    dead[r.rank] = "ended (its engine process is gone)"
            else:
                if registered is None:
                    registered = set(self._client.ids) if self._client is not None else set()
                if r.engine_id not in registered:
                    dead[r.rank] = "stopped answering the controller's heartbeat"
        return dead

    def fault_report(self, rank: int) -> dict[str, Any]:
        """Where a rank that died of a fatal signal was: its cell line and collective, if known."""
        from .runtime.tracker import COLLECTIVES

        path = self._control_file(rank).replace("release-rank-", "fault-rank-")
        try:
            text = launch.read_on_host(self._ssh_launcher(rank), path)  # on the rank's host
        except Exception:
            return {}
        section = text.split("Current thread", 1)[-1] if "Current thread" in text else text
        out: dict[str, Any] = {}
        for line in section.splitlines():
            line = line.strip()
            if not line.startswith('File "'):
                if out and not line:
                    break
                continue
            filename, _, rest = line[6:].partition('", line ')
            num, _, func = rest.partition(" in ")
            if "op" not in out and func in COLLECTIVES:
                out["op"] = func
            if filename.startswith("Cell In[") and "line" not in out:
                out["file"], out["line"] = filename, int(num)
        return out

    def controller_alive(self) -> bool:
        from .reaper import _alive, process_start_time

        controller = self._cluster.controller if self._cluster is not None else None
        if controller is None:
            return False
        pid = controller.pid
        return _alive(pid, "") and process_start_time(pid) != ""

    def _check_alive(self, ranks: list[int]) -> None:
        if not self.controller_alive():
            raise ClusterError(
                "the ipyparallel controller of this cluster is gone (it crashed or was killed), and its "
                "engines were ended with it. Run %dist_restart for a fresh cluster (add --replay to rebuild your state)."
            )
        dead = {r: how for r, how in self.dead_ranks().items() if r in ranks}
        if dead:
            what = "; ".join(f"rank {r} {how}" for r, how in dead.items())
            raise ClusterError(
                f"{what}. Run %dist_restart for a fresh set of ranks (or %dist_shutdown)."
            )

    def _view(self, ranks: list[int]):
        view = self._client.direct_view([self._engine_ids[r] for r in ranks])
        view.block = False
        return view

    def select(self, spec: Any = None) -> list[int]:
        return parse_ranks(spec, self.world_size)

    # ---- running cells -------------------------------------------------------------

    def run(
        self,
        cell: str | PreparedCell,
        ranks: Any = None,
        gather: list[str] | tuple[str, ...] = (),
        *,
        filename: str = "<cell>",
        header: str | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        hang_after: float | None = None,
        on_update=None,
        on_hang: str = "show",
        profile: bool = False,
    ) -> CellResult:
        """Run a cell on the selected ranks at once, streaming their output live.

        Returns a :class:`CellResult`; call ``raise_for_errors()`` to raise
        :class:`RankError` if any rank raised. A syntax error raises before any rank runs.
        While it runs, a hang longer than ``hang_after`` seconds prints a diagnosis, and a
        rank that raises or dies while others wait in a collective gets them released.
        ``profile``: run it under torch.profiler on every rank; ``result.profile`` is then
        a :class:`notebook_dist.profile.Profile` (where the time went, across ranks).
        """
        self._require_running()
        selected = self.select(ranks)
        prepared = cell if isinstance(cell, PreparedCell) else prepare_cell(cell, filename, header)
        self._check_alive(selected)
        gather = list(gather)
        offsets: dict[int, int] = {}
        request: tuple = ()
        if profile:  # the ranks' clocks against the kernel's, to put them on one timeline
            offsets = self.clock_offsets(selected)
            request = ("aligned" if len(selected) == self.world_size else "alone",)
        t0 = time.perf_counter()
        token = uuid.uuid4().hex
        ar = self._view(selected).apply_async(
            rt_cell.run_cell_request,
            (
                prepared.code,
                prepared.filename,
                prepared.source,
                prepared.first_line,
                gather,
                prepared.want_value,
                token,
                self.shm_dir,
                *request,
            ),
        )
        watch = self.last_watch = CellWatch(
            self,
            ar,
            selected,
            prepared,
            out,
            err,
            self.config.hang_after_s if hang_after is None else hang_after,
            on_update,
        )
        watch.token = token
        if on_hang not in ("show", "stop"):
            raise ValueError("on_hang must be 'show' or 'stop'")
        watch.hang_action = on_hang
        watch.run_to_end()
        if any(v.status == "dead" for v in watch.views.values()):
            raise ClusterError((watch.final or watch.diagnose()).verdict)
        results = [watch.views[r].result for r in selected]
        result = collect(selected, results, gather)
        for r in watch.released:
            # a released rank's error is a consequence, not a cause: the cause is shown
            if r in result.errors and len(result.errors) > 1:
                del result.errors[r]
        result.released = sorted(watch.released)
        result.elapsed_s = time.perf_counter() - t0
        if profile:
            from .profile import analyze

            profiles = {
                r: res["profile"] for r, res in zip(selected, results) if res and res.get("profile")
            }
            if profiles:
                result.profile = analyze(profiles, offsets, prepared.filename)
        if not result.errors and not watch.released and len(selected) == self.world_size:
            self.history.append(prepared)
        return result

    def restarted(self) -> DistCluster:
        """Stop this cluster and return a fresh one with the same request (and history)."""
        fresh = DistCluster(
            n=self.request["n"],
            backend=self.request["backend"],
            gpus=self.request["gpus"],
            timeout=self.request["timeout"],
            port=self.request["port"],
            launcher=self.launcher,
            config=self.config,
            ssh_hosts=self.ssh_hosts or None,
        )
        history = list(self.history)
        self.shutdown()
        fresh.start()
        fresh.history = history
        return fresh

    def replay(
        self, cells: list[PreparedCell], out: TextIO | None = None, err: TextIO | None = None
    ) -> int:
        """Re-run recorded cells in order; stops at (and raises) the first failure."""
        done = 0
        self.history = []
        for prepared in cells:
            result = self.run(prepared, out=out, err=err)
            result.raise_for_errors()
            done += 1
        return done

    def release_collectives(self, ranks: list[int], token: str) -> None:
        """Ask the ranks' agents to close their Gloo connections (see runtime.recover),
        for the cell ``token`` only."""
        writes = [(self._ssh_launcher(r), self._control_file(r)) for r in ranks]
        for el, path in writes:
            if el is None:
                launch.write_on_host(None, path, token)
        remote = [(el, path) for el, path in writes if el is not None]
        if remote:  # ranks on other hosts: written there over ssh, the hosts side by side
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(remote)) as pool:
                for el, path in remote:
                    pool.submit(launch.write_on_host, el, path, token)

    def _ssh_launcher(self, rank: int):
        """The ssh launcher of a rank --launcher ssh started on another host, else None:
        its control files are on that host (ranks are in the launchers' order)."""
        if self.launcher != "ssh" or self._local(rank):
            return None
        launchers = [el for el in self._all_launchers() if not launch.is_local(el)]
        return launchers[rank] if rank < len(launchers) else None

    def rebuild_process_group(self) -> float:
        """A fresh default process group on every rank (after a release); returns seconds.

        Raises :class:`ClusterError` naming the ranks whose CUDA context cannot be used any
        more (only fresh engines can have their GPU again)."""
        t0 = time.perf_counter()
        port = self._rendezvous_port()
        done = self.apply(rt_recover.reinit, port, timeout=60)
        broken = {r: info["cuda_unusable"] for r, info in done.items() if info.get("cuda_unusable")}
        if broken:
            said = "; ".join(f"rank {r}: {why}" for r, why in sorted(broken.items()))
            raise ClusterError(
                f"the GPU cannot be used any more on {'rank' if len(broken) == 1 else 'ranks'} "
                f"{', '.join(map(str, sorted(broken)))} ({said}). %dist_restart starts fresh "
                "engines: every rank's variables are lost (add --replay to re-run your setup cells)"
            )
        return time.perf_counter() - t0

    def clock_offsets(self, ranks: list[int], samples: int = 3) -> dict[int, int]:
        """Each rank's clock minus the kernel's, in ns: from the round trip with the least
        delay (the error is at most half of it; on one machine, about nothing)."""
        from .runtime.profiler import clock

        view = self._view(ranks)
        best: dict[int, tuple[int, int]] = {}
        for _ in range(samples):
            t0 = time.time_ns()
            stamps = view.apply_sync(clock)
            t1 = time.time_ns()
            for r, stamp in zip(ranks, stamps):
                rtt = t1 - t0
                if r not in best or rtt < best[r][0]:
                    best[r] = (rtt, stamp - (t0 + t1) // 2)
        return {r: offset for r, (_, offset) in best.items()}

    def interrupt(self, ranks: Any = None) -> None:
        """Send SIGINT to the selected ranks (like the notebook's stop button)."""
        for r in self.select(ranks):
            if self._local(r):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.ranks[r].pid, signal.SIGINT)
            else:  # through the controller, which asks the engine's host
                self._client.send_signal(
                    signal.SIGINT, targets=[self.ranks[r].engine_id], block=False
                )

    def apply(
        self, func, *args, ranks: Any = None, timeout: float | None = None, **kwargs
    ) -> RankValues:
        """Call ``func(*args, **kwargs)`` on the selected ranks; RankValues of the returns."""
        self._require_running()
        selected = self.select(ranks)
        self._check_alive(selected)
        ar = self._view(selected).apply_async(func, *args, **kwargs)
        try:
            results = ar.get(timeout=timeout)
        except Exception as exc:
            raise ClusterError(
                f"could not run {getattr(func, '__name__', func)} on the ranks: {_remote_message(exc)}"
            ) from None
        return RankValues(dict(zip(selected, results)))

    # ---- moving values -------------------------------------------------------------

    def push(self, values: dict[str, Any], ranks: Any = None) -> None:
        """Bind ``values`` (name -> object) in every selected rank's namespace."""
        self._require_running()
        for name in values:
            if not name.isidentifier():
                raise TransferError(f"{name!r} is not a valid Python name")
        for name, value in values.items():
            pack_named(name, value, "the notebook")  # precise error before sending anything
        files: list[str] = []  # read by every rank: removed here once all have
        frames = pack_named(", ".join(values), dict(values), "the notebook", self.shm_dir, files)
        try:
            self.apply(rt_cell.push_values, *frames, ranks=ranks)
        finally:
            for path in files:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def pull(self, names: list[str] | str, ranks: Any = None) -> dict[str, RankValues]:
        """Fetch variables from the selected ranks: name -> RankValues."""
        if isinstance(names, str):
            names = [names]
        results = self.apply(rt_cell.pull_values, list(names), self.shm_dir, ranks=ranks)
        out: dict[str, dict[int, Any]] = {n: {} for n in names}
        missing: dict[str, list[int]] = {}
        problems = []
        for rank, frames in results.items():
            res = unpack(frames)
            for name in res["missing"]:
                missing.setdefault(name, []).append(rank)
            for name, why in res["unpicklable"].items():
                problems.append(f"{name!r} on rank {rank}: {why}")
            for name, value in res["values"].items():
                out[name][rank] = value
        for name, where in missing.items():
            noun = "rank" if len(where) == 1 else "ranks"
            problems.insert(0, f"{name!r} is not defined on {noun} {', '.join(map(str, where))}")
        if problems:
            raise TransferError("; ".join(problems))
        return {name: RankValues(v, name=name) for name, v in out.items()}

    # ---- inspection (notebook_dist.inspect) ----------------------------------------

    def compare(self, expr: str, ranks: Any = None, atol: float = 0.0, rtol: float = 0.0):
        """What differs across ranks in EXPR (a tensor, module, optimizer or container)."""
        from .inspect import compare

        return compare(self, expr, ranks, atol, rtol)

    def inspect(self, expr: str, ranks: Any = None) -> RankValues:
        """EXPR evaluated on each rank, without running a cell."""
        from .inspect import inspect

        return inspect(self, expr, ranks)

    def debug(self, rank: int | None = None, expr: str | None = None, frame: int = 0):
        """Post-mortem: the frame where ``rank`` raised in the last cell, its locals, EXPR there."""
        from .inspect import debug

        return debug(self, rank, expr, frame)

    # ---- status --------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        """One dict per rank: rank, engine_id, host, pid, device, backend, state, process_group."""
        rows = []
        dead = self.dead_ranks() if self._state == "running" else {}
        queue = {}
        if self._state == "running":
            try:
                queue = self._client.queue_status()
            except Exception:
                queue = {}
        idle = [
            r.rank
            for r in self.ranks
            if r.rank not in dead and queue.get(r.engine_id, {}).get("queue", 0) == 0
        ]
        health: dict[int, Any] = {}
        if idle:
            try:
                health = dict(self.apply(rt_bootstrap.health, ranks=idle, timeout=5))
            except Exception:
                health = {}
        for r in self.ranks:
            if self._state != "running":
                state = self._state
            elif r.rank in dead:
                state = f"dead ({dead[r.rank]})"
            elif r.rank in idle:
                state = "idle"
            else:
                state = "busy"
            h = health.get(r.rank)
            pg = (
                "unknown (busy)"
                if h is None
                else ("ok" if h.get("initialized") else "not initialised")
            )
            gpu = (h or {}).get("gpu")
            rows.append(
                dict(
                    rank=r.rank,
                    engine_id=r.engine_id,
                    host=r.host,
                    pid=r.pid,
                    device=r.device,
                    backend=r.backend,
                    state=state,
                    process_group=pg,
                    gpu=_gpu_text(gpu) if gpu else ("" if not r.device.startswith("cuda") else "-"),
                )
            )
        return rows

    def table(
        self,
        rows: list[dict[str, Any]] | None = None,
        columns: tuple[str, ...] = ("rank", "host", "pid", "device", "backend"),
    ) -> str:
        """The rank table as fixed-width text."""
        from .table import format_table

        rows = [{c: getattr(r, c) for c in columns} for r in self.ranks] if rows is None else rows
        return "\n".join(format_table(columns, rows))

    def __repr__(self) -> str:
        return f"<DistCluster {self._state}: {self.world_size} ranks, {self.backend}>"


def _gpu_text(gpu: dict) -> str:
    """'cuda:0 NVIDIA H200, 1.2 GiB / 2.0 GiB (peak 1.5 GiB)': allocated / reserved."""
    from .ui.text import fmt_bytes

    return (
        f"{gpu['device']} {gpu['name']}, {fmt_bytes(gpu['allocated'])} / "
        f"{fmt_bytes(gpu['reserved'])} (peak {fmt_bytes(gpu['peak'])})"
    )


def _pid_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_loop_thread(obj) -> None:
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


LAUNCHERS = ("local", "mpi", "slurm", "ssh")


def _check_launcher(launcher: str) -> str:
    name = (launcher or "local").lower()
    if name in ("sshproxy", "pbs", "sge", "lsf", "htcondor"):
        raise PreflightError(
            f"--launcher {name}: start the engines with ipyparallel's own launcher, e.g. "
            f"ipcluster start --engines {name} --profile P --cluster-id C -n N --daemonize, "
            "then attach: %dist_init --profile P --cluster-id C (add --network when they span hosts)"
        )
    if name not in LAUNCHERS:
        raise PreflightError(
            f"unknown launcher {launcher!r}: use local, mpi, slurm or ssh (or attach to an ipcluster "
            "started with any ipyparallel launcher, with --profile/--cluster-id)"
        )
    return name


def _check_port(port: int, host: str) -> None:
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


def _check_python(python: str) -> None:
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise PreflightError(
            f"the engines' Python {python!r} does not exist or is not executable: "
            "set DistConfig.python to a Python with notebook_dist and torch installed"
        )


def _remote_message(exc: BaseException) -> str:
    """The useful line of an ipyparallel RemoteError/CompositeError."""
    try:
        from ipyparallel import error as ipp_error

        if isinstance(exc, ipp_error.CompositeError):
            return "; ".join(f"{e[0]}: {e[1]}" for e in exc.elist)
        if isinstance(exc, ipp_error.RemoteError):
            return f"{exc.ename}: {exc.evalue}"
    except Exception:
        pass
    return f"{type(exc).__name__}: {exc}"
