"""Local engines forked from one process that imported torch once
(``runtime/forkserver.py``), behind ipyparallel's own local launcher.

:class:`ForkServer` starts that process, asks it for engines and learns how each ended.
:class:`~.engine_launchers.ForkedEngineSetLauncher` is ipyparallel's
``LocalEngineSetLauncher`` whose engines come from the cluster's fork server rather than
from ``Popen``: the engine set,
its ids, its stop and its log files stay ipyparallel's. The server belongs to the
cluster's processes (``processes.py``), which record it, watch it with the reaper and
close it when the cluster stops; the launchers find it by the cluster's profile folder.

A server can also be started ahead (:func:`start_ahead`, when the extension loads), so
that torch is imported while the user reads the notebook: the first cluster takes it
(:func:`take_ahead`) when its environment is the one the server was started with, and
otherwise ends it and starts its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import psutil

from ..errors import ClusterError
from .engines import tail

#: the fork server of each running cluster, by its profile folder
_SERVERS: dict[str, ForkServer] = {}


class ForkServer:
    """One fork server process and what it has said."""

    def __init__(
        self,
        python: str,
        env: dict[str, str],
        log_file: str,
        timeout: float = 120.0,
        idle_preload_s: float | None = None,
        own_folder: str | None = None,
    ):
        #: how long an engine's start may wait for the server (DistConfig.start_timeout_s)
        self.timeout = timeout
        self._preloaded = False
        #: set when the server loaded, by itself while it waited, what ranks load later
        self.idle_preloaded = threading.Event()
        self._idle_preload_s = idle_preload_s
        self._ready_at: float | None = None  # (time.monotonic() when it said it was ready)
        self._loading_by_itself = False  # (it may have begun that load when it was taken)
        self._log = open(log_file, "ab")
        idle = [] if idle_preload_s is None else ["--preload-when-idle", str(idle_preload_s)]
        if own_folder is not None:  # (its log's, removed when it ends: its kernel may be gone)
            idle += ["--remove-at-end", own_folder]
        self.popen = subprocess.Popen(
            [python, "-m", "notebook_dist.runtime.forkserver", *idle],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,  # a Ctrl-C in a terminal is not the server's
        )
        self.pid = self.popen.pid
        self.log_file = log_file
        #: what it was started with: a server started ahead serves only a cluster whose
        #: engines would have the same (take_ahead)
        self.python = python
        self.env = dict(env)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._said: dict[int, dict] = {}  # fork id -> its answer
        self._answered = threading.Condition(self._lock)
        self._exits: dict[int, int | None] = {}
        self._ended: dict[int, threading.Event] = {}
        self._next = 0
        self.gone = False
        #: the essential imports that failed in the server (it is then of no use)
        self.failed: list[str] = []
        self._reader = threading.Thread(target=self._read, name="notebook_dist-forks", daemon=True)
        self._reader.start()

    # ---- the server's answers ---------------------------------------------------------

    def _read(self) -> None:
        for line in self.popen.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self.failed = message.get("failed") or []
                    self._ready_at = time.monotonic()
                    self._ready.set()
                elif "forked" in message:
                    self._said[message["forked"]] = message
                    self._answered.notify_all()
                elif "preloaded" in message:
                    self._preloaded = True
                    self.idle_preloaded.set()
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                    self._event(message["exited"]).set()
        self.popen.stdout.close()  # (read to its end: the server has exited)
        with self._lock:  # closed, or killed: no more answers, no more exit codes
            self.gone = True
            self._ready.set()
            self._answered.notify_all()
            for event in self._ended.values():
                event.set()

    def _event(self, pid: int) -> threading.Event:
        return self._ended.setdefault(pid, threading.Event())

    def ended(self, pid: int) -> bool:
        """Whether the server has said that its child ``pid`` ended (or the server is gone)."""
        return self._event(pid).is_set()

    # ---- asking -----------------------------------------------------------------------

    def usable(self, timeout: float) -> bool:
        """Whether engines can be forked: the server imported what they need (False: it
        could not, and each engine is started as a fresh process, which says why)."""
        self.wait_ready(timeout)
        return not self.failed

    def forks_now(self, preload: bool) -> bool:
        """Whether an engine asked for now is forked at once: the server has imported what
        engines need and is loading nothing more (with ``preload``: it has loaded what ranks
        load later, by itself, as a server started ahead does while it waits)."""
        with self._lock:
            loaded = self._ready.is_set() and not self.gone and not self.failed
        if self.idle_preloaded.is_set():
            return loaded
        return loaded and not preload and not self._loading_by_itself

    def _may_load_by_itself(self) -> bool:
        """Whether the server, started ahead, may have begun to load what ranks load later
        by itself (it does once it has waited its ``--preload-when-idle`` since it was
        ready; what it is asked before that cancels it)."""
        if self._idle_preload_s is None or self._ready_at is None:
            return False
        # (a margin for the request's way to the server)
        return time.monotonic() - self._ready_at > self._idle_preload_s - TAKEN_MARGIN_S

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or (self.gone and not self.failed):
            why = "exited" if self.gone else f"did not import torch within {timeout:.0f} s"
            raise ClusterError(
                f"the process that starts the engines {why}. Its log ({self.log_file}) "
                f"ends:\n{tail(self.log_file)}"
            )

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, out: str, timeout: float) -> int:
        """A new engine running ``argv``; its pid."""
        self.wait_ready(timeout)
        with self._lock:
            self._next += 1
            ident = self._next
        self._send({"fork": ident, "argv": argv, "env": env, "cwd": cwd, "out": out})
        with self._answered:
            if not self._answered.wait_for(lambda: ident in self._said or self.gone, timeout):
                raise ClusterError(
                    f"the fork server did not start an engine within {timeout:.0f} s"
                )
            answer = self._said.pop(ident, None)
        if answer is None or "error" in answer:
            why = answer["error"] if answer else "it exited"
            raise ClusterError(f"the fork server could not start an engine: {why}")
        return answer["pid"]

    def taken(self) -> None:
        """A cluster took the server started ahead: it loads nothing more by itself (the
        cluster's ``preload_ranks`` decides), unless it already began to."""
        with self._lock:
            self._loading_by_itself = self._may_load_by_itself()
        self._send({"taken": True})

    def preload(self) -> None:
        """Import what ranks load later, for the engines forked from now on (once)."""
        if not self._preloaded:
            self._preloaded = True
            self._send({"preload": True})

    def _send(self, message: dict) -> None:
        try:
            with self._lock:
                self.popen.stdin.write((json.dumps(message) + "\n").encode())
                self.popen.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # gone: the fork's wait says so

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once it has ended (None: not known, the server is gone);
        raises ``psutil.TimeoutExpired`` while it runs."""
        event = self._event(pid)
        if not event.wait(timeout):
            raise psutil.TimeoutExpired(timeout, pid)
        if pid not in self._exits:  # the server went first: the engine may still run
            try:
                return psutil.Process(pid).wait(timeout)
            except psutil.NoSuchProcess:
                return None
        return self._exits[pid]

    def close(self, timeout: float = 5.0) -> None:
        """No more engines: the server ends (its engines are stopped by their launchers)."""
        _SERVERS.pop(getattr(self, "profile_dir", None), None)
        try:
            self.popen.stdin.close()
        except OSError:
            pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # ended by pid with the cluster's other processes (Processes.stop)
        self._reader.join(timeout)
        self._log.close()


def start(config, env: dict[str, str], profile_dir: str) -> ForkServer:
    """The fork server of the cluster in ``profile_dir`` (its log beside the engines'):
    the one started ahead when it fits, else a new one."""
    log_file = _log_file(profile_dir)
    server = take_ahead(config, env)
    if server is None:
        server = ForkServer(config.python, env, log_file, config.start_timeout_s)
    else:  # its log joins the cluster's (the same file system: the open file follows)
        server.taken()
        os.replace(server.log_file, log_file)
        shutil.rmtree(os.path.dirname(server.log_file), ignore_errors=True)
        server.log_file = log_file
        server.timeout = config.start_timeout_s
    server.profile_dir = profile_dir
    _SERVERS[profile_dir] = server
    return server


def _log_file(profile_dir: str) -> str:
    os.makedirs(os.path.join(profile_dir, "log"), exist_ok=True)
    return os.path.join(profile_dir, "log", "forkserver.log")


#: how much sooner than its ``--preload-when-idle`` a server taken is thought to have begun
#: loading by itself (:meth:`ForkServer.forks_now`)
TAKEN_MARGIN_S = 0.05

#: the fork server started ahead of any cluster, until a cluster takes it or it is ended
_AHEAD: ForkServer | None = None

#: how long a server started ahead waits, once torch is imported, before it loads what a
#: first optimizer or DDP module needs (``runtime.heal.preload``) by itself: the ranks of
#: the next cell's ``%dist_init`` then share it, whatever their number, and their start
#: does not wait for it. A cell run right after ``%load_ext`` (a notebook run as a whole)
#: asks for its engines within this time, and the server then loads nothing by itself.
IDLE_PRELOAD_S = 0.5


def start_ahead(config, env: dict[str, str]) -> ForkServer:
    """Start a fork server before any cluster asks for one, so that the first cluster's
    engines need not wait for torch's import (:func:`start`). It ends when a cluster takes
    it, with :func:`end_ahead`, or when this process ends (its input is then closed)."""
    global _AHEAD
    if _AHEAD is not None and not _AHEAD.gone:
        return _AHEAD
    end_ahead()  # one that exited: its folder goes
    import atexit

    from ..signals import Started

    atexit.register(end_ahead)  # (once is enough; a second call finds nothing to end)
    folder = tempfile.mkdtemp(prefix="notebook_dist-ahead-")
    _AHEAD = ForkServer(
        config.python,
        env,
        os.path.join(folder, "forkserver.log"),
        idle_preload_s=IDLE_PRELOAD_S,
        own_folder=folder,  # (a kernel killed before a cluster took it leaves it behind)
    )
    _AHEAD.record = Started.record(_AHEAD.pid, "fork server", parent=os.getpid())
    return _AHEAD


def take_ahead(config, env: dict[str, str]) -> ForkServer | None:
    """The server started ahead, for a cluster whose engines get ``env`` from
    ``config.python``; None when there is none, or it does not fit (it is then ended)."""
    global _AHEAD
    server, _AHEAD = _AHEAD, None
    if server is None:
        return None
    if server.gone or server.python != config.python or server.env != env:
        _end(server)
        return None
    return server


def end_ahead() -> None:
    """End the server started ahead, if any (no cluster will take it)."""
    global _AHEAD
    server, _AHEAD = _AHEAD, None
    if server is not None:
        _end(server)


def _end(server: ForkServer) -> None:
    """A server no cluster took (it has no engines), ended now, even while it imports."""
    from ..signals import end

    end([server.record], grace_s=2.0)
    server.close()
    shutil.rmtree(os.path.dirname(server.log_file), ignore_errors=True)


class ForkedProcess:
    """What ipyparallel's launcher asks of its engine's process, for a forked engine: its
    exit code comes from the server, and its signals go through ``notebook_dist.signals``
    with the record made when it was forked (the server's child, by pid and start time)."""

    def __init__(self, server: ForkServer, pid: int):
        from ..signals import Started

        self.server = server
        self.pid = pid
        self.record = Started.record(pid, "engine", parent=server.pid)

    def wait(self, timeout=None):
        return self.server.wait_exit(self.pid, timeout)

    def is_running(self) -> bool:
        from ..signals import is_running

        return (
            not self.server.ended(self.pid) and self.record is not None and is_running(self.record)
        )

    def send_signal(self, sig) -> None:
        from ..signals import send

        if self.record is not None:
            send(self.record, sig)
