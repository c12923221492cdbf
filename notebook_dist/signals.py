"""The one door through which notebook_dist signals a process.

A signal reaches a process only if this package started it, and only while it is still
that process. A process is recorded once (:meth:`Started.record`) when it is started or
when it registers with this cluster's own controller: its pid and its start time (field
22 of ``/proc/PID/stat``, which tells a process from a later one that reuses the pid).
Only :meth:`Started.record` (and :meth:`Started.reported`, through it) makes a record
that can be signalled: ``Started(pid, start)`` written by hand, or a record changed with
``dataclasses.replace``, is refused. :func:`send` and :func:`end` then refuse, every time:

- any pid of 1 or less (``-1`` is every process the caller may signal, ``0`` its own
  process group, ``1`` init), and anything that is not an int: ipyparallel's launchers
  carry ``pid = -1`` until a process exists, and a set whose engines have all exited has
  no launchers left to ask;
- this process and its parent (the notebook kernel and the Jupyter server), and any pid
  :func:`protect` was given (the reaper protects the kernel that started it);
- a pid whose process now has another start time (it ended, and the pid was reused),
  or whose start time was never read.

A process group is signalled (``killpg``) only when its leader was recorded as the
leader of a session of its own (ipyparallel starts the controller and each engine so):
then the group holds only what that leader spawned. A leader that is gone leaves its
group's id reserved while any member lives (Linux keeps a pid in use while it names a
group), so the members still in that group, started after the leader, are its own.

No other module calls ``os.kill``, ``os.killpg`` or ``pidfd_send_signal``, in any
spelling; the few other places that can end a process (a ``subprocess.run`` timeout
killing its own child, ipyparallel's own stop) are named, each with why, in
``tests/test_signals.py``, which reads the source to hold this.
"""

from __future__ import annotations

import contextlib
import os
import signal as _signal
import subprocess
import time
from dataclasses import dataclass, field

#: pids never signalled, whatever the record says (the reaper adds its kernel)
_PROTECTED: set[int] = set()


def protect(pid: int) -> None:
    """Never signal ``pid`` from this process (the reaper: the kernel that started it)."""
    if isinstance(pid, int) and pid > 1:
        _PROTECTED.add(pid)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data.rsplit(")", 1)[-1].split()


def start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks after boot), or "" when there is no such process."""
    if not _is_pid(pid):
        return ""
    fields = _stat(pid)
    return fields[19] if fields else ""


def foreign_proc() -> str | None:
    """Why processes cannot be told apart here, or None: ``/proc`` must be this process's
    own PID namespace's, or every pid read in it names another process (a namespace made
    with ``unshare --pid --fork`` and no ``--mount-proc``)."""
    try:
        seen = int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return None  # no /proc at all: start times are never read, so nothing is signalled
    if seen == os.getpid():
        return None
    return (
        f"/proc here belongs to another PID namespace (it calls this process {seen}, which "
        f"is {os.getpid()} in its own), so notebook_dist cannot tell the processes it starts "
        "from others and will not start any. Mount a /proc for this namespace (unshare "
        "--pid --fork --mount-proc; container runtimes do it), then start again."
    )


def _is_pid(pid) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 1


@dataclass(frozen=True)
class Started:
    """A process this package started (or that registered with its controller)."""

    pid: int
    start: str
    #: the leader of a session (and so a process group) of its own
    leads_group: bool = False
    #: what it is, for messages: "controller", "engine", "rank 1", "mpiexec", "reaper"
    what: str = "process"
    #: set by :meth:`record` alone (not an argument, not copied by ``replace``)
    recorded: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def record(cls, pid, what: str = "process", parent: int | None = None) -> Started | None:
        """The process ``pid`` as it is now, or None when ``pid`` is a placeholder, names
        no live process, or (with ``parent``) is not that process's child."""
        if not _is_pid(pid) or pid in _refused_now():
            return None
        fields = _stat(pid)
        if not fields or fields[0] in ("Z", "X"):
            return None
        if parent is not None and int(fields[1]) != parent:
            return None
        leads = int(fields[2]) == pid and int(fields[3]) == pid  # pgrp and session
        proc = cls(pid, fields[19], leads, what)
        object.__setattr__(proc, "recorded", True)  # (frozen: the one place it is set)
        return proc

    @classmethod
    def reported(cls, pid, start: str, what: str = "process") -> Started | None:
        """A process that said its own pid and start time (a rank, from inside itself), if
        the process at that pid here has that start time."""
        if not start or start_time(pid) != start:
            return None
        return cls.record(pid, what)


def _refused_now() -> set[int]:
    return {os.getpid(), os.getppid(), *_PROTECTED}


def _is_record(proc) -> bool:
    """Whether ``proc`` was made by :meth:`Started.record` (nothing else is signalled)."""
    return isinstance(proc, Started) and proc.recorded is True


def refusal(proc: Started) -> str | None:
    """Why ``proc`` must not be signalled now, or None when it may."""
    if not _is_record(proc):
        return f"{proc!r} was not made by Started.record: a record built by hand is never signalled"
    if not _is_pid(proc.pid):
        return f"pid {proc.pid!r} is not a single process"
    if proc.pid in _refused_now():
        return f"pid {proc.pid} is this process, its parent or protected"
    if not proc.start:
        return f"pid {proc.pid} has no recorded start time"
    if start_time(proc.pid) != proc.start:
        return f"pid {proc.pid} is no longer the {proc.what} that was started"
    return None


def is_running(proc: Started) -> bool:
    """Whether the recorded process still runs (a zombie does not)."""
    if refusal(proc) is not None:
        return False
    fields = _stat(proc.pid)
    return bool(fields) and fields[0] not in ("Z", "X")


class ExitWatch:
    """Whether one recorded process still runs, asked in one system call: its pidfd turns
    readable as it ends (a zombie has ended). :func:`is_running` reads ``/proc/PID/stat``
    twice, which for a process of many threads, the controller, cost 277 µs from a cold
    cache against 34 µs warm (measured here): before every cell, most of them run from an
    idle kernel. Without pidfds (Linux before 5.3, other systems), :func:`is_running`."""

    def __init__(self, proc: Started):
        import select

        self.proc = proc
        self._fd = self._poll = None
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            return
        if start_time(proc.pid) != proc.start:  # (another's pid now: is_running says so)
            os.close(fd)
            return
        self._fd, self._poll = fd, select.poll()
        self._poll.register(fd, select.POLLIN)

    def running(self) -> bool:
        poll = self._poll
        return is_running(self.proc) if poll is None else not poll.poll(0)

    def close(self) -> None:
        fd, self._fd, self._poll = self._fd, None, None
        if fd is not None:
            os.close(fd)


def send(proc: Started, sig: int) -> bool:
    """Signal one recorded process; False (nothing sent) when :func:`refusal` says no."""
    if refusal(proc) is not None:
        return False
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(proc.pid)
    try:
        # with a pidfd, the process checked is the one signalled (no pid reuse between)
        if refusal(proc) is not None:
            return False
        if fd is not None:
            _signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def group_members(proc: Started) -> list[int]:
    """Live members of the group ``proc`` leads (itself excluded); [] unless it leads one."""
    if not _is_record(proc) or not proc.leads_group or not _is_pid(proc.pid) or not proc.start:
        return []
    here = start_time(proc.pid)
    if here and here != proc.start:
        return []  # the pid is someone else's now: so is anything in a group of that id
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == proc.pid:
            continue
        fields = _stat(int(name))
        if (
            fields
            and fields[0] not in ("Z", "X")
            and int(fields[2]) == proc.pid
            and int(fields[19]) >= int(proc.start)
            and int(name) not in _refused_now()
        ):
            out.append(int(name))
    return out


def send_group(proc: Started, sig: int) -> bool:
    """Signal the group ``proc`` leads (the leader and what it spawned), or the leader
    alone when it leads none; False when nothing was sent."""
    if not _is_record(proc) or not proc.leads_group:
        return send(proc, sig)
    members = group_members(proc)
    leader_ok = refusal(proc) is None
    if not leader_ok and not members:
        return False
    if not leader_ok and start_time(proc.pid):
        return False  # the pid was reused: never its group
    try:
        os.killpg(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end(procs: list[Started], grace_s: float = 3.0) -> list[Started]:
    """TERM, then KILL after ``grace_s``, each recorded process and the group it leads.
    Returns those that were still running when asked to end."""
    procs = [p for p in procs if isinstance(p, Started)]

    def remaining() -> bool:
        return any(is_running(p) or group_members(p) for p in procs)

    ended = [p for p in procs if is_running(p) or group_members(p)]
    for proc in ended:
        send_group(proc, _signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while remaining() and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in procs:
        if is_running(proc) or group_members(proc):
            send_group(proc, _signal.SIGKILL)
    return ended


def close_input(proc, wait_s: float) -> bool:
    """The gentle end of a helper this process started with a pipe to its standard input
    (the reaper, the relay): the pipe closed, which it reads as its end, then up to
    ``wait_s`` seconds for it to exit. No signal is sent. Returns whether it exited."""
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True
