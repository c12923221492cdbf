"""A rank's exit status, kept on its own host for the notebook to read.

A rank on another host (``--launcher ssh``) is started by a process that does not wait for
it: ipyparallel's ssh call starts the engine in the background and ends. So nobody there
sees its exit status, and the notebook only finds it gone when the controller's heartbeat
misses it: a rank the kernel's OOM killer ended (SIGKILL, which leaves no stack) could
only be said to have "stopped answering". Here the engine's process forks once, before it
imports anything: the child is the engine; the parent, the process ipyparallel started
and knows by pid, is its witness. It waits for the child, passes on the signals sent to
it (ipyparallel's stop, ``STOP_ON_HOST``), writes the child's exit status at the end of
the rank's fault file (:data:`ENDED_NOTE`, read by ``cluster.recovery``), and ends with the
same status. The child ends with it if it is killed (Linux's parent-death signal).

It costs the host one small process per rank: a Python that imported only the few
modules the engine's entry point needs, its pages shared with the engine's (5 MiB of its
own, 6 MiB PSS, beside an idle engine's 200 MiB).
The engine tells the witness the path of its fault file (:func:`tell`) through a pipe.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys

#: the engine's command-line flag that asks for a witness (``cluster.engines.engine_cmd``)
FLAG = "--notebook-dist-witness"
#: the line the witness writes at the end of the rank's fault file when its engine ended:
#: its exit status (negative: the signal that ended it)
ENDED_NOTE = "notebook_dist: the rank's process ended with status "
#: :data:`ENDED_NOTE`'s line, its status read (``cluster.recovery``, ``cluster.processes``)
_ENDED = re.compile("^" + re.escape(ENDED_NOTE) + r"(-?\d+)$", re.MULTILINE)
#: what the witness passes on to the engine (its stop, an interrupt sent by pid)
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: the engine's end of the pipe to its witness (None: it has none)
_TO_WITNESS: int | None = None


def available() -> bool:
    """Whether this system has what a witness needs (Linux: ``waitid``, which macOS's
    Python has only from 3.13, and the parent-death signal)."""
    return sys.platform == "linux" and hasattr(os, "waitid")


def split() -> None:
    """Fork: return in the child, the engine; the parent witnesses it and never returns.
    Where no witness can be had, return at once: the engine is this process."""
    global _TO_WITNESS
    if not available():
        return
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _TO_WITNESS = write_end
        _end_with(parent)
        return
    os.close(write_end)
    code = 1
    try:
        code = _witness(pid, read_end)
    except BaseException:  # (never the engine's code after this: the engine is its child)
        with contextlib.suppress(BaseException):
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        os._exit(code if code >= 0 else 128 - code)


def tell(fault_file: str) -> None:
    """The engine's fault file, for its witness to write the exit status in (no-op where
    the engine has no witness)."""
    if _TO_WITNESS is not None:
        try:
            os.write(_TO_WITNESS, (fault_file + "\n").encode())
        except OSError:
            pass


def ended_status(fault_text: str) -> int | None:
    """The exit status a witness wrote in a rank's fault file (None: none written)."""
    found = _ENDED.search(fault_text)
    return int(found.group(1)) if found else None


def _witness(child: int, told: int) -> int:
    """Wait for ``child`` (the engine), passing on the signals in :data:`FORWARDED`;
    write its exit status in the fault file it named last on ``told``. Its exit code
    (negative: the signal that ended it)."""

    ended = False

    def forward(sig, _frame):
        if not ended:  # (its pid is its own until it is reaped below, even once it ended)
            os.kill(child, sig)

    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write, told):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler: the wake-up fd is written)
    signal.set_wakeup_fd(wake_write)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    said, watched = b"", [told, wake_read]
    while True:  # (asked first: it may have ended before the handler was set)
        info = os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            break
        ready, _, _ = select.select(watched, [], [])
        if told in ready:
            data, closed = _read(told)
            said += data  # (a path each time the rank is made again: a few hundred bytes)
            if closed:  # (by the engine and whatever it forked: no more to say)
                watched.remove(told)
        _read(wake_read)
    ended = True  # (no signal is passed on once it is reaped)
    os.waitpid(child, 0)
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    said += _read(told)[0]  # (what it wrote just before it ended)
    path = said.rstrip(b"\n").rpartition(b"\n")[2].decode(errors="replace")  # the last
    if path:
        try:
            with open(path, "a") as f:
                f.write(f"{ENDED_NOTE}{code}\n")
        except OSError:
            pass
    return code


def _read(fd: int) -> tuple[bytes, bool]:
    """What waits in ``fd`` (non-blocking), and whether its writers are all gone."""
    out = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return out, False
        if not data:
            return out, True
        out += data


def _end_with(parent: int) -> None:
    """The engine is killed if its witness is (Linux's parent-death signal), so that no
    engine outlives the process its launcher stops."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # (it ended before that was set)
        os._exit(1)
