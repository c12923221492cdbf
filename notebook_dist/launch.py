"""ipyparallel launchers that remember how each engine ended.

ipyparallel reports an engine's exit through its event loop, which does not run while a
cell blocks the kernel; these record the exit code in the waiting thread itself, so a
dead rank is reported with its exit code or signal at once.
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

from .errors import PreflightError


# No nanny process per engine: ranks are signalled by pid (one process fewer per rank
# to start and to clean up).
def engine_cmd(python: str = sys.executable, remote: bool = False) -> list[str]:
    cmd = [python, "-m", "notebook_dist.runtime.engine", "--IPEngine.enable_nanny=False"]
    if remote:
        # on another host no reaper of ours can end the engine: it ends itself when the
        # controller's heartbeat is gone for 15 checks (12 s at our 300 ms period; 40 s
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


def parse_hosts(spec: str) -> dict[str, int | None]:
    """``"node1,node2:2,me@node3"`` -> engines per ssh destination (None: not given), as
    Open MPI's ``--host`` writes slots. A port goes in ssh's own settings
    (``--ssh "-o Port=2222"`` or ~/.ssh/config), which scp reads as well."""
    hosts: dict[str, int | None] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, count = item.rpartition(":")
        if not sep:
            name = item
        if not name or any(c.isspace() for c in name) or name.startswith("-"):
            raise PreflightError(
                f"--hosts: {item!r} is not an ssh destination like node1 or me@node1"
            )
        if sep and (not count.isdigit() or int(count) < 1):
            raise PreflightError(
                f"--hosts: {item!r}: after ':' give how many ranks that host runs, e.g. node1:2"
            )
        if name in hosts:
            raise PreflightError(
                f"--hosts lists {name} twice: give it once, with a count (node1:2)"
            )
        hosts[name] = int(count) if sep else None
    return hosts


def spread_over_hosts(hosts: dict[str, int | None], n: int | None) -> dict[str, int]:
    """Engines per host: the counts given, else ``n`` spread evenly (first hosts get the
    extra ones), else one per host."""
    if not hosts:
        raise PreflightError(
            "--launcher ssh needs --hosts, the machines to start ranks on, e.g. "
            "--hosts node1,node2 (one rank each) or --hosts node1:2,node2:2"
        )
    if n is not None and n < 1:
        raise PreflightError(f"-n {n}: a cluster needs at least one rank")
    given = {h: c for h, c in hosts.items() if c is not None}
    if given and len(given) != len(hosts):
        raise PreflightError("--hosts: give a count for every host or for none (node1:2,node2:2)")
    if given:
        total = sum(given.values())
        if n is not None and n != total:
            raise PreflightError(f"-n {n} asked, but --hosts adds up to {total} ranks")
        return dict(given)
    if n is None:
        return {h: 1 for h in hosts}
    if n < len(hosts):
        raise PreflightError(f"-n {n} is fewer ranks than the {len(hosts)} hosts given")
    per, extra = divmod(n, len(hosts))
    return {h: per + (i < extra) for i, h in enumerate(hosts)}


def ssh_settings(hosts: dict[str, int], config, profile_dir: str) -> dict:
    """RankSSHEngineSetLauncher settings: the hosts, the engines' Python, and a profile
    folder of their own on each host (in /tmp: on a shared filesystem it must not be
    the notebook's own, which scp would overwrite with itself); ``config.ssh`` last."""
    settings = {
        "engines": dict(hosts),
        "remote_python": config.python,
        "remote_profile_dir": f"/tmp/{os.path.basename(profile_dir)}-remote",
        "delay": 0.0,
    }
    settings.update(config.ssh)
    return settings


def ssh_destination_address(destination: str, ssh_args: list[str]) -> str:
    """The address ssh connects to for ``destination`` (``user@host``; aliases in
    ~/.ssh/config are followed with ``ssh -G``)."""
    import socket
    import subprocess

    host = destination.rpartition("@")[2]
    try:
        shown = subprocess.run(
            ["ssh", *ssh_args, "-G", destination],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        ).stdout
        host = next(
            (ln.split(None, 1)[1] for ln in shown.splitlines() if ln.startswith("hostname ")), host
        )
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return socket.getaddrinfo(host, 22, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise PreflightError(f"--hosts: cannot find the address of {host}: {exc}") from None


def address_towards(destination: str, config) -> str:
    """This machine's address on the route to ``destination``: the one address the
    controller listens on, so the hosts reach it and nothing else does."""
    import socket

    target = ssh_destination_address(destination, list(config.ssh.get("ssh_args", [])))
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 22))  # (no packet is sent: this only picks the route)
        return s.getsockname()[0]


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
