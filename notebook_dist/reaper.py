"""A guardian process that ends a cluster's processes when the notebook kernel dies.

ipyparallel starts the controller and engines in sessions of their own, so they outlive
a kernel that is SIGKILLed. The kernel starts this reaper (also in its own session) with
a pipe on its stdin and writes the pids it starts to it. The pipe closes when the
kernel exits for any reason; on EOF without a ``release`` line, the reaper ends every
pid it was given (TERM, then KILL), removes the given paths, and exits.

It also watches the controller (``anchor``): if the controller dies, the engines can do
nothing more, so the reaper ends them too.

Protocol, one command a line: ``pid PID STARTTIME`` | ``anchor PID STARTTIME`` |
``path DIR`` | ``release``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys

from . import signals


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is not for us
    # the kernel that started us, and its parent (the Jupyter server): never signalled,
    # even after the kernel is gone and we are someone else's child
    kernel = os.getppid()
    signals.protect(kernel)
    fields = signals._stat(kernel)
    if fields:
        signals.protect(int(fields[1]))
    procs: dict[int, signals.Started] = {}
    paths: list[str] = []
    anchor: signals.Started | None = None  # the controller: without it the engines are useless
    released = False
    buffer = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            if anchor is not None and not signals.is_running(anchor):
                break  # the controller died: end the engines rather than leave them waiting
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break  # EOF: the kernel is gone
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            cmd, _, arg = raw.decode().strip().partition(" ")
            if cmd in ("pid", "anchor"):
                pid, _, start = arg.partition(" ")
                # the same checks as the kernel's: a real pid, alive with that start time
                proc = signals.Started.reported(int(pid), start) if pid.isdigit() else None
                if proc is None:
                    continue
                procs[proc.pid] = proc
                if cmd == "anchor":
                    anchor = proc
            elif cmd == "forget" and arg.isdigit():
                procs.pop(int(arg), None)
            elif cmd == "path":
                paths.append(arg)
            elif cmd == "release":
                released = True
        if released:
            break
    if not released:
        signals.end(list(procs.values()))
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


class Reaper:
    """Kernel-side handle on a reaper process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "notebook_dist.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the kernel's process group must not end it
            close_fds=True,
        )
        self.started = signals.Started.record(self.proc.pid, "reaper", parent=os.getpid())

    def _send(self, line: str) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def watch(self, proc: signals.Started, anchor: bool = False) -> None:
        """End ``proc`` if the kernel dies; an ``anchor`` (the controller) dying ends them all."""
        self._send(f"{'anchor' if anchor else 'pid'} {proc.pid} {proc.start}")

    def forget(self, pid: int) -> None:
        self._send(f"forget {pid}")

    def remove_on_exit(self, path: str) -> None:
        self._send(f"path {path}")

    def release(self) -> None:
        """The cluster was stopped cleanly: the reaper exits without ending anything."""
        self._send("release")
        if not signals.close_input(self.proc, 5.0):
            signals.send(self.started, signal.SIGKILL)
            self.proc.wait()


if __name__ == "__main__":
    main()
