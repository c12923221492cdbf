"""The engine processes: ipyparallel's launchers, taught to remember how each engine
ended, and what can be asked of an engine's host (its log, a control file, a folder to
remove), here or over ssh.

ipyparallel reports an engine's exit through its event loop, which does not run while a
cell blocks the kernel; these launchers record the exit code in the waiting thread itself,
so a dead rank is reported with its exit code or signal at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
    SSHEngineSetLauncher,
    SSHLauncher,
)


# No nanny process per engine: ranks are signalled by pid (one process fewer per rank
# to start and to clean up).
def engine_cmd(python: str = sys.executable, remote: bool = False) -> list[str]:
    cmd = [python, "-m", "notebook_dist.runtime.engine", "--IPEngine.enable_nanny=False"]
    if remote:
        # on another host no reaper of ours can end the engine: it ends itself when the
        # controller's heartbeat is gone for 15 checks (9 s at our 100 ms period; 40 s
        # by ipyparallel's default). A busy cell does not count: the pings queue up.
        cmd.append(f"--IPEngine.max_heartbeat_misses={REMOTE_HEARTBEAT_MISSES}")
    return cmd


REMOTE_HEARTBEAT_MISSES = 15


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


class RankSSHEngineSetLauncher(SSHEngineSetLauncher):
    """Engines started over ssh, ``engines`` of them per host (``%dist_init --launcher ssh
    --hosts``); ipyparallel copies the engine connection file to each host first.

    Hosts are started side by side (ipyparallel starts one engine after another, each
    a few ssh round trips): start-up then grows with the engines per host, not with the
    size of the cluster."""

    def start(self, n=None):
        from concurrent.futures import ThreadPoolExecutor

        inherited = (
            set(self.traits(config=True)) & set(self.launcher_class.class_traits(config=True))
        ) - {"location", "user", "hostname", "to_send", "to_fetch"} | {"profile_dir", "cluster_id"}
        shared = {t: getattr(self, t) for t in inherited}
        groups = []
        for h, (dest, count) in enumerate(self.engines.items()):
            user, _, host = dest.rpartition("@")
            group = []
            for i in range(int(count)):
                key = f"{dest}/{i}"
                el = self.launchers[key] = self.launcher_class(
                    parent=self,
                    identifier=key,
                    **dict(
                        shared,
                        # a folder per host: on a shared filesystem two hosts must not
                        # write one profile at once
                        remote_profile_dir=f"{self.remote_profile_dir}-{h}",
                        # rank order follows --hosts, whichever engine registers first
                        environment=dict(
                            self.environment, NOTEBOOK_DIST_LAUNCH_RANK=str(len(self.launchers))
                        ),
                    ),
                )
                if i:
                    el.to_send = []  # the first engine on a host sends the connection file
                el.on_stop(self._notice_engine_stopped)
                _ = el.loop  # bound here: a worker thread has no event loop of its own
                group.append(el)
            groups.append((user or None, host, group))

        def start_host(user, host, group):
            for el in group:
                el.start(user=user, hostname=host)

        with ThreadPoolExecutor(max(1, len(groups))) as pool:
            for future in [pool.submit(start_host, *g) for g in groups]:
                future.result()  # the first failure is raised
        self.n = len(self.launchers)
        self.notify_start(list(self.launchers))
        return list(self.launchers)


def is_local(el) -> bool:
    """Whether a launcher's ``pid`` is a process on this machine (not one ssh started)."""
    return not isinstance(el, SSHLauncher)


def has_ended(el) -> bool:
    exited = getattr(el, "exited", None)
    if exited is not None:
        return exited.is_set()
    return isinstance(el, SSHLauncher) and el.state == "after"


def end_report(el) -> tuple[int | None, str, str, str]:
    """How a launcher's engine ended: exit code, " on HOST" (ssh), its log, the log's end."""
    if isinstance(el, SSHLauncher):
        code = (getattr(el, "stop_data", None) or {}).get("exit_code")
        try:
            text = el.get_output() or "(no log)"
        except Exception as exc:
            text = f"(could not fetch its log: {exc})"
        return code, f" on {el.location}", el.remote_output_file, last_lines(text)
    return el.exit_code, "", el.output_file, tail(el.output_file)


def last_lines(text: str, num_lines: int = 20) -> str:
    return "".join(text.splitlines(keepends=True)[-num_lines:])


def tail(path: str, num_lines: int = 20) -> str:
    """The end of a log file, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return last_lines(f.read(), num_lines)
    except OSError:
        return "(no log)"


def write_on_host(el, path: str, text: str) -> None:
    """Write ``text`` to ``path`` with a fresh mtime (the agents watch it): on this machine
    when ``el`` is None, else on the ssh launcher's host, through ssh."""
    if el is None:
        with open(path, "w") as f:
            f.write(text)
        now = time.time_ns()
        os.utime(path, ns=(now, now))
        return
    el.ssh_sender.check_output_python_code(
        f"import os, time\np = {path!r}\nwith open(p, 'w') as f:\n    f.write({text!r})\n"
        "t = time.time_ns()\nos.utime(p, ns=(t, t))\n"
    )


def read_on_host(el, path: str) -> str:
    """The text of ``path``: on this machine when ``el`` is None, else on the ssh
    launcher's host, through ssh."""
    if el is None:
        with open(path, errors="replace") as f:
            return f.read()
    return el.ssh_sender.check_output_python_code(
        f"import sys\nwith open({path!r}, errors='replace') as f:\n    sys.stdout.write(f.read())\n"
    )


def remove_remote_dirs(launchers, also: str | None = None) -> None:
    """Remove the folders ssh launchers made on each host: its profile folder and ``also``
    (the cluster's own folder, which the ranks make there for their control files)."""
    done = set()
    for el in launchers:
        if not isinstance(el, SSHLauncher) or el._ssh_sender is None:
            continue
        for path in (el.remote_profile_dir, also):
            if path and (el.location, path) not in done:
                done.add((el.location, path))
                with contextlib.suppress(Exception):  # gone already (a shared filesystem)
                    el.ssh_sender.cmd_rmdir(path)


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
