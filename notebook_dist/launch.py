"""ipyparallel launchers that remember how each engine ended.

ipyparallel reports an engine's exit through its event loop, which does not run while a
cell blocks the kernel; these record the exit code in the waiting thread itself, so a
dead rank is reported with its exit code or signal at once.
"""

from __future__ import annotations

import signal
import sys
import threading

from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
)


# No nanny process per engine: ranks are signalled by pid (one process fewer per rank
# to start and to clean up).
def engine_cmd(python: str = sys.executable) -> list[str]:
    return [python, "-m", "notebook_dist.runtime.engine", "--IPEngine.enable_nanny=False"]


class RankEngineLauncher(LocalEngineLauncher):
    """One local engine; ``exit_code`` is set (negative for a signal) when it ends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_code: int | None = None
        self.exited = threading.Event()

    def _wait(self):
        process = self.process
        real_wait = process.wait

        def wait(timeout=None):
            code = real_wait(timeout)
            self.exit_code = code
            self.exited.set()
            return code

        process.wait = wait
        super()._wait()


class RankEngineSetLauncher(LocalEngineSetLauncher):
    launcher_class = RankEngineLauncher


class RankMPIEngineSetLauncher(MPIEngineSetLauncher):
    """Engines started by ``mpiexec``, without ipyparallel's ``--mpi`` flag: that would make
    each engine import mpi4py only to learn its MPI rank, which the environment already
    holds (OMPI_COMM_WORLD_RANK, PMI_RANK); torch.distributed does the communication."""

    @property
    def program(self):
        return list(self.engine_cmd)


class RankSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """Engines as the tasks of one Slurm job (``srun`` in an ``sbatch`` script).

    The batch script is written to the cluster's private profile folder, not the
    notebook's working directory, and ``options`` (``--sbatch``) become ``#SBATCH``
    lines (ipyparallel only offers them to custom templates)."""

    def __init__(self, work_dir=".", **kwargs):
        super().__init__(work_dir=kwargs.get("profile_dir") or work_dir, **kwargs)

    def _run_command(self, command, **kwargs):
        """As ipyparallel's, but what sbatch/scancel say on stderr reaches the error."""
        import subprocess

        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, **kwargs)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, command, output=done.stdout + done.stderr
            )
        return done.stdout.decode("utf8", "replace")

    def _insert_options_in_script(self):
        import shlex

        super()._insert_options_in_script()
        extra = [f"#SBATCH {opt}" for opt in shlex.split(self.options or "")]
        if extra:
            first, rest = self.batch_template.split("\n", 1)
            self.batch_template = "\n".join([first, *extra, rest])


def slurm_job_state(job_id: str) -> str | None:
    """The job's state as squeue reports it (PENDING, RUNNING, ...), None once it is gone."""
    import subprocess

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
    import os
    import subprocess

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


def describe_exit(code: int | None) -> str:
    if code is None:
        return "ended (exit status unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
