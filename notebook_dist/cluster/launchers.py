"""How the engines of a cluster start: what differs between launchers, behind one interface.

:class:`Launcher` says which ipyparallel engine-set launcher to use and with which
settings, where the controller listens, how a failed start reads, what to watch while the
engines register, and whether the ranks follow the engines' own order. The process
lifecycle (``processes.py``) calls these and has no branch on a launcher's name. A new
launcher is one subclass here, and one entry in :data:`LAUNCHERS`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

from ..config import DistConfig
from ..errors import ClusterError, PreflightError
from ..phrases import describe_exit
from . import engines, hosts


class Launcher:
    """Local engines: children of this process, on this machine."""

    name = "local"
    #: engines on other hosts: no pid of theirs is local, and their files are reached by ssh
    remote = False
    #: the engines are not this process's children: the reaper watches the ranks' pids
    watch_rank_pids = False
    #: ranks follow the engines' own order (MPI rank, Slurm task, --hosts), from a probe
    ordered_by_probe = False
    #: the engines' exit status is seen here (they are this process's children, or the
    #: fork server's); where not, each engine has a witness (``runtime/witness.py``)
    exits_seen = True

    def __init__(self, config: DistConfig, n: int | None = None, ssh_hosts: dict | None = None):
        self.config = config

    @property
    def forks_engines(self) -> bool:
        """Whether the engines are forked from the cluster's fork server (``forks.py``)."""
        return self.config.fork_engines

    @property
    def ipp_class(self) -> type:
        if self.forks_engines:
            from .engine_launchers import ForkedEngineSetLauncher

            return ForkedEngineSetLauncher
        from .engine_launchers import RankEngineSetLauncher

        return RankEngineSetLauncher

    def settings(self, profile_dir: str) -> dict[str, Any]:
        """Traits of the ipyparallel launcher (besides the engine command and environment)."""
        return {"delay": 0.0}

    def environment(self) -> dict[str, str]:
        """More environment for the engine processes."""
        return {}

    def engine_cmd(self) -> list[str]:
        # (forked engines can start while the controller does: they wait for it as long as
        # the kernel waits for them)
        wait_s = self.config.start_timeout_s if self.forks_engines else None
        return engines.engine_cmd(
            self.config.python, remote=self.remote, wait_s=wait_s, witness=not self.exits_seen
        )

    def controller_ip(self) -> str:
        return "127.0.0.1" if self.config.loopback_only else ""

    def start_failed(self, exc: BaseException, ipp_cluster) -> ClusterError | None:
        """What a failed ``start_engines`` means to the user (None: raise it as it is)."""
        return None

    def started_processes(self, engine_set, launchers: list) -> list:
        """The ipyparallel launchers whose process this kernel started (each is recorded,
        by pid and start time, for the reaper and for stopping)."""
        return [el for el in launchers if engines.is_local(el)]

    def check_starting(self, engine_set, launchers: list, registered: int, n: int) -> None:
        """While the engines register: raise :class:`ClusterError` once they cannot all come."""
        dead = [el for el in launchers if engines.has_ended(el)]
        if dead:
            code, on_host, log_file, log_tail = engines.end_report(dead[0])
            raise ClusterError(
                f"an engine{on_host} {describe_exit(code)} while starting"
                f"{import_hint(log_tail, self.config)}. Its log ({log_file}) ends:\n{log_tail}"
            )

    def replan(self, ordered_probes: list[dict], here: str, request: dict):
        """A new plan once the engines' own probes are known (None: the first plan holds)."""
        return None


class MPILauncher(Launcher):
    """Engines started by ``mpiexec``, ranks in MPI rank order."""

    name = "mpi"
    forks_engines = False  # started by their own tool, on their own hosts
    exits_seen = False
    watch_rank_pids = True
    ordered_by_probe = True

    def __init__(self, config, n=None, ssh_hosts=None):
        super().__init__(config)
        self.mpiexec = shutil.which("mpiexec")
        if self.mpiexec is None:
            raise PreflightError(
                "--launcher mpi needs mpiexec on the PATH (Debian/Ubuntu: apt-get install "
                "openmpi-bin, or load your MPI module)"
            )
        self._asked: tuple[list[str], dict[str, str]] | None = None

    def _mpi(self) -> tuple[list[str], dict[str, str]]:
        if self._asked is None:  # asked at start, not when a request is only planned
            self._asked = mpi_settings(self.mpiexec)
        return self._asked

    @property
    def ipp_class(self):
        from .engine_launchers import RankMPIEngineSetLauncher

        return RankMPIEngineSetLauncher

    def settings(self, profile_dir):
        return {"mpi_cmd": [self.mpiexec], "mpi_args": self._mpi()[0]}

    def environment(self):
        return dict(self._mpi()[1])

    def started_processes(self, engine_set, launchers):
        return [engine_set]  # mpiexec: one process starts them all

    def check_starting(self, engine_set, launchers, registered, n):
        super().check_starting(engine_set, launchers, registered, n)
        if engine_set.poll() is not None:
            log_tail = engines.tail(engine_set.output_file)
            raise ClusterError(
                f"{self.mpiexec} exited with code {engine_set.poll()} while starting the "
                f"engines{import_hint(log_tail, self.config)}. Its log ({engine_set.output_file}) "
                f"ends:\n{log_tail}"
            )


class SlurmLauncher(Launcher):
    """Engines as the tasks of one ``sbatch`` job, ranks in ``SLURM_PROCID`` order."""

    name = "slurm"
    forks_engines = False  # started by their own tool, on their own hosts
    exits_seen = False
    watch_rank_pids = True
    ordered_by_probe = True

    def __init__(self, config, n=None, ssh_hosts=None):
        super().__init__(config)
        if shutil.which("sbatch") is None:
            raise PreflightError(
                "--launcher slurm needs sbatch on the PATH: run the notebook on a Slurm login "
                "node (or load the Slurm module)"
            )
        self._checked = 0.0  # when the job's state was last asked for

    @property
    def ipp_class(self):
        from .engine_launchers import RankSlurmEngineSetLauncher

        return RankSlurmEngineSetLauncher

    def settings(self, profile_dir):
        return dict(self.config.slurm)

    def start_failed(self, exc, ipp_cluster):
        if not isinstance(exc, subprocess.CalledProcessError):  # sbatch refused the job
            return None
        for key, es in list(ipp_cluster.engines.items()):
            if getattr(es, "job_id", None) == "":  # no job: nothing for scancel to stop
                del ipp_cluster.engines[key]
        said = (exc.output or b"").decode(errors="replace").strip()
        return ClusterError(
            f"{' '.join(map(str, exc.cmd))} failed (exit {exc.returncode})"
            + (f": {said}" if said else "")
        )

    def started_processes(self, engine_set, launchers):
        return []  # the job's tasks are not our children

    def check_starting(self, engine_set, launchers, registered, n):
        """A job that ended (or was refused) is said at once (asked at most once a second)."""
        super().check_starting(engine_set, launchers, registered, n)
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        state = slurm_job_state(engine_set.job_id)
        if state in (None, "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            log_tail = (
                engines.tail(engine_set.output_file) if engine_set.output_file else "(no log)"
            )
            raise ClusterError(
                f"Slurm job {engine_set.job_id} {'ended' if state is None else state.lower()} "
                f"with {registered} of {n} engines registered{import_hint(log_tail, self.config)}. "
                f"Its script is {engine_set.batch_file}; its output ends:\n{log_tail}"
            )


class SSHLauncher(Launcher):
    """Engines started over ssh on ``--hosts``, ranks in ``--hosts`` order; the plan waits
    for the hosts' own probes (their GPUs, their addresses)."""

    name = "ssh"
    forks_engines = False  # started by their own tool, on their own hosts
    exits_seen = False
    remote = True
    ordered_by_probe = True

    def __init__(self, config, n=None, ssh_hosts=None):
        super().__init__(config)
        self.hosts = hosts.spread_over_hosts(ssh_hosts or {}, n)
        if config.loopback_only:
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

    @property
    def ipp_class(self):
        from .engine_launchers import RankSSHEngineSetLauncher

        return RankSSHEngineSetLauncher

    def settings(self, profile_dir):
        return hosts.ssh_settings(self.hosts, self.config, profile_dir)

    def controller_ip(self):  # only the address the hosts reach this machine at
        return hosts.address_towards(next(iter(self.hosts)), self.config)

    def start_failed(self, exc, ipp_cluster):
        missing = {}  # the hosts whose engines did not start, in --hosts order
        for es in ipp_cluster.engines.values():  # stop only the engines that did start
            for key, el in list(es.launchers.items()):
                if el.pid <= 0:
                    missing[el.location] = None
                    del es.launchers[key]
        where = f" on {', '.join(missing)}" if missing else ""
        return ClusterError(  # ssh could not log in, or the host has no such Python
            f"could not start the engines{where} over ssh: {exc}. Check that `ssh HOST` works "
            f"without a password (add options with --ssh) and that {self.config.python} "
            "on each host has notebook_dist and torch (DistConfig.python)"
        )

    def replan(self, ordered_probes, here, request):
        from ..plan import plan_on_engines

        return plan_on_engines(
            ordered_probes, here, False, len(ordered_probes), request["backend"], request["gpus"]
        )


LAUNCHERS: dict[str, type[Launcher]] = {
    "local": Launcher,
    "mpi": MPILauncher,
    "slurm": SlurmLauncher,
    "ssh": SSHLauncher,
}
# ipyparallel launchers notebook_dist does not start itself: ipcluster starts them, and the
# notebook attaches (%dist_init --profile P --cluster-id C)
THROUGH_IPCLUSTER = ("sshproxy", "pbs", "sge", "lsf", "htcondor")


def make(
    name: str, config: DistConfig, n: int | None = None, ssh_hosts: dict | None = None
) -> Launcher:
    """The launcher called ``name``, its preflight checks done (:class:`PreflightError`)."""
    key = (name or "local").lower()
    if key in THROUGH_IPCLUSTER:
        raise PreflightError(
            f"--launcher {key}: start the engines with ipyparallel's own launcher, e.g. "
            f"ipcluster start --engines {key} --profile P --cluster-id C -n N --daemonize, "
            "then attach: %dist_init --profile P --cluster-id C (add --network when they span hosts)"
        )
    if key not in LAUNCHERS:
        raise PreflightError(
            f"unknown launcher {name!r}: use local, mpi, slurm or ssh (or attach to an ipcluster "
            "started with any ipyparallel launcher, with --profile/--cluster-id)"
        )
    return LAUNCHERS[key](config, n, ssh_hosts)


def import_hint(text: str, config: DistConfig) -> str:
    if "ImportError" not in text and "ModuleNotFoundError" not in text:
        return ""
    return (
        f" (an import failed in the engines' Python, {config.python}: install what "
        "is missing there, or set DistConfig.python to a Python that has it)"
    )


def slurm_job_state(job_id: str) -> str | None:
    """The job's state as squeue reports it (PENDING, RUNNING, ...), None once it is gone."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN"
    return out or None


def mpi_settings(mpiexec: str) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment ``mpiexec`` needs to start engines on this machine."""
    try:
        version = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    args: list[str] = []
    env: dict[str, str] = {}
    if "Open MPI" in version or "OpenRTE" in version:
        args.append("--oversubscribe")  # more ranks than cores is fine for a notebook
        if os.geteuid() == 0:  # Open MPI refuses root unless told twice
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return args, env
