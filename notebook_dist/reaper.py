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

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time


def process_start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat: tells a process from a later one with the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode()
    except OSError:
        return ""
    return data.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, start: str) -> bool:
    if start and process_start_time(pid) != start:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)  # the engine and anything it spawned
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (field 5 of /proc/PID/stat)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().decode().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def end_processes(pids: dict[int, str], grace_s: float = 3.0) -> None:
    """TERM, then KILL, each pid and its process group.

    Every process we watch was started in a session of its own (its pid is its group id),
    so the group also holds what it spawned: the controller's scheduler processes, an
    engine's workers. Those outlive a leader that was SIGKILLed, so the group is ended
    even when its leader is already gone.
    """

    def remaining() -> list[int]:
        alive = [p for p, start in pids.items() if _alive(p, start)]
        return alive + [m for p in pids for m in group_members(p) if m not in alive]

    for pid, start in pids.items():
        if _alive(pid, start):
            _signal(pid, signal.SIGTERM)
        elif group_members(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while remaining() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in remaining():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is not for us
    pids: dict[int, str] = {}
    paths: list[str] = []
    anchor: tuple[int, str] | None = None  # the controller: without it the engines are useless
    released = False
    buffer = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            if anchor is not None and not _alive(*anchor):
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
                pids[int(pid)] = start
                if cmd == "anchor":
                    anchor = (int(pid), start)
            elif cmd == "forget":
                pids.pop(int(arg), None)
            elif cmd == "path":
                paths.append(arg)
            elif cmd == "release":
                released = True
        if released:
            break
    if not released:
        end_processes(pids)
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

    def _send(self, line: str) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def watch(self, pid: int, anchor: bool = False) -> None:
        """End ``pid`` if the kernel dies; an ``anchor`` (the controller) dying ends them all."""
        self._send(f"{'anchor' if anchor else 'pid'} {pid} {process_start_time(pid)}")

    def forget(self, pid: int) -> None:
        self._send(f"forget {pid}")

    def remove_on_exit(self, path: str) -> None:
        self._send(f"path {path}")

    def release(self) -> None:
        """The cluster was stopped cleanly: the reaper exits without ending anything."""
        self._send("release")
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
