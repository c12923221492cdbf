"""The notebook's end of the express route's pipes (``runtime/pipes.py`` says what they
carry and why): a pipe of requests to each rank on this machine that opened its end, and
one pipe that every rank writes its replies into.

Everything here runs under the express route's lock (``cluster/route.py``).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import struct

from ..runtime import pipes as rt_pipes

log = logging.getLogger("notebook_dist")


class RankPipes:
    """The pipes in ``folder`` (made here, only its user's): :meth:`offer` one to each
    engine about to join, :meth:`take` those the ranks opened, :meth:`send` a request,
    :meth:`replies` all that have come."""

    def __init__(self, folder: str):
        os.makedirs(folder, mode=0o700)
        self.folder = folder
        # the replies' pipe, and the count's and the bell's (``runtime/pipes.py``, COUNT)
        fds: list[int] = []
        try:
            for name in (rt_pipes.REPLIES, rt_pipes.COUNT, rt_pipes.BELL):
                path = os.path.join(folder, name)
                os.mkfifo(path, 0o600)
                fds.append(rt_pipes.open_pipe(path, os.O_RDWR))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        self.fd, self.count_fd, self.bell = fds
        self.to: dict[str, tuple[int, int]] = {}  # engine uuid -> (its pipe, its capacity)
        self._records = rt_pipes.RecordStream()
        self._tokens: dict[int, bytes] = {}

    @classmethod
    def make(cls, folder: str | None) -> RankPipes | None:
        """The pipes, or None where this system has none (the sockets serve alone)."""
        if not folder or not rt_pipes.available():
            return None
        try:
            return cls(folder)
        except OSError as exc:
            log.debug("no pipes for the express route: %s", exc)
            shutil.rmtree(folder, ignore_errors=True)
            return None

    def offer(self, engines: list[str]) -> bool:
        """A request pipe for each engine, to open as it joins the route (and the pipes
        of ranks that ended since the last join let go); False when they cannot be made
        (the engines then join the socket alone)."""
        self.prune()
        try:
            for engine in engines:
                path = os.path.join(self.folder, engine)
                if os.path.exists(path):
                    os.remove(path)
                os.mkfifo(path, 0o600)
        except OSError as exc:
            log.debug("no pipes for engines %s: %s", engines, exc)
            return False
        return True

    def take(self, engines: list[str]) -> None:
        """Hold the pipes the engines opened (after their join); each pipe's name goes."""
        for engine in engines:
            path = os.path.join(self.folder, engine)
            try:
                fd = rt_pipes.open_pipe(path, os.O_WRONLY)
            except OSError:  # (ENXIO: its rank did not open it, and reads its socket only)
                fd = None
            try:
                os.remove(path)
            except OSError:
                pass
            self.drop(engine)
            if fd is not None:
                self.to[engine] = (fd, rt_pipes.capacity(fd))

    def send(self, engine: str, record: bytes) -> tuple[str, str] | None:
        """Write a request's record into ``engine``'s pipe: None once written, else
        ``(how, why)``: ``"long"`` (longer than the pipe holds: for the socket to carry),
        ``"full"`` (this request fails, the pipe stays) or ``"gone"`` (its rank ended)."""
        fd, room = self.to[engine]
        if len(record) > room:
            return "long", ""
        try:
            if rt_pipes.write_whole(fd, record, room):
                return None
        except OSError as exc:  # (BrokenPipeError: its rank ended)
            self.drop(engine)
            return "gone", f"not reachable: its pipe is closed ({exc.strerror})"
        return "full", (
            "not sent: the rank has not read the requests sent to it before, which fill "
            f"its pipe ({room // 1024} KiB); it is still running an earlier call"
        )

    def count(self, n: int) -> bool:
        """Tokens for a call's ``n`` piped ranks to count their replies down with (what
        an earlier call left first taken); False when they do not fit in one write."""
        tokens = self._tokens.get(n)
        if tokens is None:
            tokens = self._tokens[n] = rt_pipes.tokens(n)
        if len(tokens) > rt_pipes.PIPE_BUF:
            return False
        _drain(self.count_fd)
        os.write(self.count_fd, tokens)
        return True

    def uncount(self) -> None:
        """A token taken for a rank the call did not reach by its pipe."""
        rt_pipes.count_down(self.count_fd, self.bell)

    def rang(self) -> None:
        """The bell's bytes taken (it rang)."""
        _drain(self.bell)

    def replies(self) -> list[tuple[str, list]]:
        """Every reply that has come: (engine uuid, its frames), in the order written."""
        out = []
        while True:
            try:
                data = os.read(self.fd, rt_pipes.READ)
            except BlockingIOError:
                return out
            for body in self._records.feed(data):
                try:
                    engine, frames = rt_pipes.reply_parts(body)
                except (IndexError, ValueError, struct.error):
                    frames = None
                if frames:
                    out.append((engine, frames))
                else:
                    log.debug("a record on the replies' pipe that is not a reply: dropped")
            if len(data) < rt_pipes.READ:
                return out

    def prune(self) -> None:
        """Let go of the pipes whose rank ended (a pipe with no reader says so)."""
        if not self.to:
            return
        poller = select.poll()
        for fd, _ in self.to.values():
            poller.register(fd, 0)  # (an error or a hang-up is said whatever is asked)
        ended = {fd for fd, _ in poller.poll(0)}
        for engine in [e for e, (fd, _) in self.to.items() if fd in ended]:
            self.drop(engine)

    def drop(self, engine: str) -> None:
        """No more requests to ``engine`` through its pipe (it ended, or joins again)."""
        fd = self.to.pop(engine, (None, 0))[0]
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for engine in list(self.to):
            self.drop(engine)
        fds = (self.fd, self.count_fd, self.bell)
        self.fd = self.count_fd = self.bell = None  # (a second close closes nothing)
        for fd in fds:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(self.folder, ignore_errors=True)


def _drain(fd: int) -> None:
    """Whatever waits in a pipe of the notebook's own, taken."""
    try:
        while len(os.read(fd, rt_pipes.READ)) == rt_pipes.READ:
            pass
    except BlockingIOError:
        pass
