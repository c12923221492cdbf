"""The engine launchers of notebook_dist: ipyparallel's own, each with what a rank needs
(its exit code, one engine per rank with no nanny, ``mpiexec`` without mpi4py, Slurm's
script in the cluster's folder, ssh hosts side by side, engines forked by the cluster's
fork server). Imported only when a cluster starts: importing notebook_dist does not
import ipyparallel's launchers, so a fork server can start first (``forks.start_ahead``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import threading
import time

from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
    SSHEngineLauncher,
    SSHEngineSetLauncher,
)

from .forks import _SERVERS, ForkedProcess


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


class RankSSHEngineLauncher(SSHEngineLauncher):
    """One engine over ssh, whose watch (a thread of ipyparallel's asking the host over
    ssh, again and again, whether the engine still runs) outlasts a host that stops
    answering: ssh's own failure there (exit status 255: no connection, or one gone silent
    within ``hosts.SSH_BOUNDS``) is read as not known yet, and the watch asks again after
    :data:`SSH_RETRY_S`. ipyparallel's thread ended instead, its traceback printed in
    whatever cell was running. Whether the rank lives is the heartbeat's to tell
    (``Processes.dead_ranks``); the cluster's stop ends the watch.

    A host found not answering is marked ``dark`` (a set the engine set's launchers
    share), until ssh reaches it again: the stop passes it over (its signal, its wait, its
    output, its folders) rather than wait out ssh's bound on each, three for each engine.
    An engine there that lives on ends itself once the controller's heartbeat is gone
    (``engines.REMOTE_HEARTBEAT_MISSES``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dark: set[str] = set()  # (the engine set gives the one its launchers share)
        #: each ssh call under way, by the host it asks (the engine set's, shared): the
        #: stop ends those to a host found not answering (``held_output``)
        self.held: dict[subprocess.Popen, str] = {}
        #: the launcher of the first engine on this host, once it started: its ssh found
        #: the host's shell and Python and made the profile's folder there
        self.first_on_host: RankSSHEngineLauncher | None = None

    @property
    def ssh_sender(self):
        """ipyparallel's, its ssh calls run by :func:`held_output`."""
        fresh = self._ssh_sender is None
        sender = super().ssh_sender
        if fresh:
            sender._check_output = functools.partial(
                held_output, sender.log, self.held, self.location
            )
        return sender

    def start(self, hostname=None, user=None, port=None):
        """ipyparallel's start asks the host its shell, runs its Python, makes the
        profile's folder, then starts the engine: four ssh round trips an engine. After the
        host's first engine only the start is left to do, with the first one's ssh."""
        first = self.first_on_host
        if first is None or first._ssh_sender is None or port is not None:
            return super().start(hostname=hostname, user=user, port=port)
        self.hostname, self.user = hostname or self.hostname, user or self.user
        self._ssh_sender = first._ssh_sender  # (its calls only read what it found)
        self.send_files()
        self.pid = self.ssh_sender.cmd_start(
            self.program + self.program_args,
            env=self.get_env(),
            output_file=self.remote_output_file,
        )
        self.notify_start({"host": self.location, "pid": self.pid})
        self._start_waiting()
        self.fetch_files()

    def wait_one(self, timeout):
        began = time.monotonic()
        watching = threading.current_thread() is getattr(self, "_wait_thread", None)
        if not watching and self.location in self.dark:
            raise TimeoutError(f"{self.location} does not answer over ssh")
        try:
            return self._over_ssh(super().wait_one, timeout)
        except subprocess.CalledProcessError as exc:
            if watching and self._stop_waiting.is_set():  # (its ssh ended by the stop)
                raise TimeoutError(f"{self.location}: the watch was stopped") from None
            if exc.returncode != 255 or not watching:
                raise  # (a stop's own wait is told)
            self._stop_waiting.wait(SSH_RETRY_S - (time.monotonic() - began))
            raise TimeoutError(f"{self.location} did not answer over ssh") from None

    def signal(self, sig):
        if self.location in self.dark:
            self.log.info("not signalling engine %s: %s does not answer", self.pid, self.location)
            return
        self._over_ssh(super().signal, sig)

    async def join(self, timeout=None):
        if self.location in self.dark:
            self._stop_waiting.set()  # (ended by the stop's ``engines.watches_ended``)
            return
        await super().join(timeout)

    def get_output(self, remove=False):
        if self._output is None and self.location in self.dark:
            self._output = ""
        return super().get_output(remove)

    def _over_ssh(self, call, *args):
        """``call(*args)``, which runs ssh: ssh's own failure marks the host dark, and an
        answer (a result, or the engine still running) marks it not."""
        try:
            out = call(*args)
        except subprocess.CalledProcessError as exc:
            if exc.returncode == 255:
                self.dark.add(self.location)
            raise
        except TimeoutError:
            self.dark.discard(self.location)  # (it answered: still running)
            raise
        self.dark.discard(self.location)
        return out


#: how often the watch on an engine over ssh asks a host that does not answer again
SSH_RETRY_S = 5.0


def held_output(log, held: dict, location: str, cmd: list[str], input=None, **kwargs) -> str:
    """``subprocess.check_output(cmd)`` as ipyparallel's ssh calls run it, its process in
    ``held`` (by ``location``, the host it asks) while it runs, for the engine set's stop to
    end: the watch's call to a host that went dark stays open until ssh's own bound (15
    s), and the stop waits for the watches to end."""
    log.debug("check_output %s", cmd)
    text = kwargs.pop("text", True)
    text = kwargs.pop("universal_newlines", text)
    stdin = subprocess.PIPE if input is not None else None
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, text=text, **kwargs)
    held[proc] = location
    try:
        out, _ = proc.communicate(input)
    except BaseException:
        proc.kill()  # (its own child: ssh, which would otherwise run to its bound)
        proc.wait()
        raise
    finally:
        held.pop(proc, None)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, output=out)
    return out


class RankSSHEngineSetLauncher(SSHEngineSetLauncher):
    """Engines started over ssh, ``engines`` of them per host (``%dist_init --launcher ssh
    --hosts``); ipyparallel copies the engine connection file to each host first.

    Hosts are started side by side (ipyparallel starts one engine after another, each
    four ssh round trips), and on each host the engines after the first side by side,
    each one round trip (``RankSSHEngineLauncher.start``)."""

    launcher_class = RankSSHEngineLauncher

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dark: set[str] = set()  # hosts found not answering over ssh
        self.held: dict[subprocess.Popen, str] = {}  # the ssh calls under way, by host

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
                el.dark, el.held = self.dark, self.held
                if i:
                    el.to_send = []  # the first engine on a host sends the connection file
                el.on_stop(self._notice_engine_stopped)
                _ = el.loop  # bound here: a worker thread has no event loop of its own
                group.append(el)
            groups.append((user or None, host, group))

        def start_host(user, host, group):
            group[0].start(user=user, hostname=host)
            for el in group[1:]:
                el.first_on_host = group[0]
            with ThreadPoolExecutor(max(1, len(group) - 1)) as pool:
                started = [pool.submit(el.start, user=user, hostname=host) for el in group[1:]]
                for future in started:
                    future.result()  # the first failure is raised

        with ThreadPoolExecutor(max(1, len(groups))) as pool:
            for future in [pool.submit(start_host, *g) for g in groups]:
                future.result()  # the first failure is raised
        self.n = len(self.launchers)
        self.notify_start(list(self.launchers))
        return list(self.launchers)

    async def stop(self):
        """Each host's engines stopped with one ssh call, the hosts side by side: TERM,
        wait, KILL those left (:data:`STOP_ON_HOST`). ipyparallel's stop makes four ssh
        round trips an engine, one engine after another (its signal, its wait, its output
        fetched, then removed): 16 engines on 2 hosts took past the stop's 30 s here. The
        engines' output is not fetched: the cluster's stop removes their folders. A host
        whose call failed but answers gets ipyparallel's stop of each engine; one found not
        answering is passed over (``RankSSHEngineLauncher.dark``)."""
        import asyncio

        hosts: dict[str, list] = {}
        for el in list(self.launchers.values()):
            el._output = el._output if el._output is not None else ""
            # (a pid ipyparallel recorded from the host: never a placeholder, 0 or 1)
            if el.state == "running" and el.pid > 1 and el.location not in self.dark:
                hosts.setdefault(el.location, []).append(el)

        def stop_host(els: list) -> None:
            code = STOP_ON_HOST.format(
                pids=[el.pid for el in els], term_s=self.stop_seconds_until_kill, kill_s=2
            )
            els[0]._over_ssh(els[0].ssh_sender.check_output_python_code, code)

        tried = [asyncio.to_thread(stop_host, els) for els in hosts.values()]
        failed = await asyncio.gather(*tried, return_exceptions=True)
        for els, error in zip(hosts.values(), failed):
            if isinstance(error, BaseException) and els[0].location not in self.dark:
                self.log.debug("stopping the engines on %s failed: %r", els[0].location, error)
                await asyncio.gather(*(el.stop() for el in els), return_exceptions=True)
        for el in list(self.launchers.values()):
            if getattr(el, "_stop_waiting", None) is not None:
                el._stop_waiting.set()  # (its watch sees the engine end, or is told to)
        # a watch's ssh to a host that does not answer stays open until ssh's own bound
        # (15 s), and the cluster's stop waits for the watches
        ended = [proc for proc, location in list(self.held.items()) if location in self.dark]
        for proc in ended:
            proc.kill()
        if ended:
            self.log.debug("ended %d ssh calls to hosts not answering", len(ended))


#: what stops a host's engines, run there by its Python over ssh: each one's process
#: looked up by pid (psutil, which ipyparallel needs on the hosts, checks it is the same
#: process when it signals), TERM, ``term_s`` for them to end, then KILL
STOP_ON_HOST = """
import psutil
procs = []
for pid in {pids!r}:
    try:
        procs.append(psutil.Process(pid))
    except psutil.NoSuchProcess:
        pass
for p in procs:
    try:
        p.terminate()
    except psutil.NoSuchProcess:
        pass
gone, left = psutil.wait_procs(procs, timeout={term_s!r})
for p in left:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
psutil.wait_procs(left, timeout={kill_s!r})
print("__killed=%d__" % len(left))
"""


class ForkedEngineLauncher(RankEngineLauncher):
    """One engine, forked by the cluster's fork server."""

    def start(self):
        server = _SERVERS.get(self.profile_dir)
        if server is None or server.gone or not server.usable(server.timeout):
            return super().start()  # a fresh process, as ipyparallel starts one
        if self.state != "before":
            raise RuntimeError(f"the engine was already started and is {self.state}")
        env = os.environ.copy()
        env.update(self.get_env())
        self.pid = server.fork(
            list(self.args), env, self.work_dir, self.output_file, server.timeout
        )
        #: the engine's parent, for the record of what this cluster started
        self.parent_pid = server.pid
        self.process = ForkedProcess(server, self.pid)
        self.notify_start(self.pid)
        self._start_waiting()


class ForkedEngineSetLauncher(RankEngineSetLauncher):
    launcher_class = ForkedEngineLauncher
