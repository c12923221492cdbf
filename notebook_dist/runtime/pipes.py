"""The express route's pipes (``cluster/lane.py``): a cell's request and its reply between
the notebook and a rank on its machine through named pipes, not sockets.

A zmq message costs both sides a hop through zmq's IO thread, and the notebook's IO
thread a frame each way for every rank of a cell (about 27 µs a rank here); a write to a
pipe costs the writer one system call, and the notebook reads all the ranks' replies that
have come with one. Each rank reads its own pipe of requests; all of them write their
replies into one pipe that the notebook reads.

The notebook does not wake for each reply: two more pipes count a call's replies down.
It writes a token for each rank it asked by its pipe into the count's pipe, numbered down
to 0; each rank takes one once its reply is sent, and the rank that takes 0, or finds none
left, rings the bell (a byte into the bell's pipe), which is what the notebook waits on.
One wake-up a cell, where each few ranks that answered together woke it before (4.5 a
cell at 16 ranks, each about 40 µs of the notebook's CPU from idle). A rank of an
earlier call that answers late takes a token of this one, so whoever finds none answered
after every other; a bell rung twice costs the notebook one more look. Only a call sent
while no other waits is counted: one sent meanwhile has each reply wake the notebook.

The pipes are made by the notebook in a folder of its cluster's that only its user can
open (mode 0700), and each request pipe's name is removed once both ends hold it: so
what comes through them is from the user's own processes, which could read the cluster's
key as well, and nothing on them is sealed (the sockets' messages are: any local user can
connect to a port).

The requests' and the replies' pipes carry records: a length (4 bytes, little-endian),
then the bytes.

- A request's: ``b"Q"`` (``b"C"``: counted), the request's id (32 hex digits), the
  pickled call (what the express route's sealed frame holds after its seal,
  ``runtime/lane.py``).
- A reply's: the engine's identity (a byte for its length, then it), the number of frames
  (a byte), and each frame (its length, 4 bytes, then it); the first frame is ``b"R"``
  and the reply's body, as the socket's reply holds it after its seal.

A write of at most ``PIPE_BUF`` bytes to a pipe is whole or not at all, whoever else
writes to it: a reply longer than that, or one that does not fit in the pipe (the
notebook is not reading), goes by the socket. A request longer than that is written only
when the rank's pipe has room for all of it (the notebook alone writes there).
"""

from __future__ import annotations

import os
import select
import struct
from collections import deque
from collections.abc import Callable

#: what a write to a pipe sends whole, whoever else writes to it (POSIX: at least 512)
PIPE_BUF = getattr(select, "PIPE_BUF", 512)
#: how much a pipe holds, asked for where the system lets us (Linux's default is 64 KiB)
CAPACITY = 1 << 20
#: the most one read takes: a read into a buffer of a MiB costs the allocator fresh memory
#: each time (a 300-byte read took 16-19 µs so, in a rank and in the kernel, 1.2-1.4 µs
#: with this buffer); a read that fills it is followed by another
READ = 1 << 16
#: the name of the pipe all the ranks write their replies into
REPLIES = "replies"
#: the names of the pipes that count a call's replies down, and of its bell
COUNT, BELL = "count", "bell"
#: a token's size (a read of it is whole: the pipe holds whole tokens only)
TOKEN = 2

_LEN = struct.Struct("<I")
#: Linux's fcntl to set a pipe's size (fcntl.F_SETPIPE_SZ, named only from Python 3.10)
_SETPIPE_SZ, _GETPIPE_SZ = 1031, 1032


def available() -> bool:
    """Whether this system has what the pipes need (Linux: named pipes, their size)."""
    return hasattr(os, "mkfifo") and os.uname().sysname == "Linux"


def record(body: bytes) -> bytes:
    """``body`` as one record: its length, then it."""
    return _LEN.pack(len(body)) + body


def reply_record(ident: bytes, frames: list) -> bytes | None:
    """A reply's record: the engine's identity, then its frames; None when it is longer
    than a write to the pipe sends whole."""
    views = [memoryview(f) for f in frames]
    size = 4 + 2 + len(ident) + sum(4 + v.nbytes for v in views)
    if size > PIPE_BUF:
        return None
    parts = [_LEN.pack(size - 4), bytes((len(ident),)), ident, bytes((len(views),))]
    for view in views:
        parts.append(_LEN.pack(view.nbytes))
        parts.append(view.cast("B") if view.format != "B" else view)
    return b"".join(parts)


def reply_parts(body: memoryview) -> tuple[str, list[memoryview]]:
    """The engine's identity and the frames of a reply's record (its body)."""
    n = body[0]
    ident = str(body[1 : 1 + n], "ascii")
    at = 2 + n
    frames = []
    for _ in range(body[1 + n]):
        (size,) = _LEN.unpack_from(body, at)
        at += 4
        frames.append(body[at : at + size])
        at += size
    return ident, frames


def tokens(n: int) -> bytes:
    """``n`` tokens, numbered down to 0 (the last one taken)."""
    return b"".join(k.to_bytes(TOKEN, "little") for k in range(n - 1, -1, -1))


def count_down(count_fd: int, bell_fd: int) -> None:
    """Take a token (a rank's reply is in); the last one, or none left, rings the bell.
    None left: a rank of an earlier call took this call's token, so whoever finds none
    answered after every other; a bell rung twice costs the notebook one more look."""
    try:
        token = os.read(count_fd, TOKEN)
    except BlockingIOError:
        token = b""
    except OSError:  # (closed: the rank is leaving the route)
        return
    if not any(token):
        try:
            os.write(bell_fd, b"!")
        except OSError:  # (full: it rang already; gone: the notebook ended)
            pass


class RecordStream:
    """What has been read from a pipe, as whole records (a record can come in pieces)."""

    __slots__ = ("_rest",)

    def __init__(self):
        self._rest = b""

    def feed(self, data: bytes) -> list[memoryview]:
        """The records that ``data`` completes, in order; a piece of the next is kept."""
        if self._rest:
            data, self._rest = self._rest + data, b""
        view, at, end, out = memoryview(data), 0, len(data), []
        while end - at >= 4:
            (size,) = _LEN.unpack_from(view, at)
            if end - at - 4 < size:
                break
            out.append(view[at + 4 : at + 4 + size])
            at += 4 + size
        if at < end:
            self._rest = bytes(view[at:])
        return out


def open_pipe(path: str, mode: int) -> int:
    """A named pipe's end (``mode``: ``os.O_RDONLY``, ``os.O_WRONLY`` or ``os.O_RDWR``),
    never blocking. Writing needs a reader already there (else OSError, ENXIO); the
    notebook holds the replies' pipe both ways, so that it never reads an end of file."""
    fd = os.open(path, mode | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        import fcntl

        fcntl.fcntl(fd, _SETPIPE_SZ, CAPACITY)
    except OSError:  # (the system's limit is lower: its default size stays)
        pass
    return fd


def capacity(fd: int) -> int:
    """How much the pipe holds."""
    import fcntl

    try:
        return fcntl.fcntl(fd, _GETPIPE_SZ)
    except OSError:
        return 1 << 16


def unread(fd: int) -> int:
    """How many bytes wait in the pipe, unread (OSError once it is closed)."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return buf[0]


def write_whole(fd: int, data: bytes, room: int) -> bool:
    """Write ``data`` to a pipe only one process writes to, when it has room for all of
    it (``room``: its capacity); False, having written nothing, when it has not."""
    if len(data) > PIPE_BUF and room - unread(fd) < len(data):
        return False
    try:
        sent = os.write(fd, data)
    except BlockingIOError:  # (at most PIPE_BUF bytes: none of them written)
        return False
    while sent < len(data):  # (room for it all was there: the rest goes at once)
        sent += os.write(fd, memoryview(data)[sent:])
    return True


class PipeReader:
    """A rank's end of its request pipe in the engine's event loop: one request each
    time round the loop, as the engine's sockets are read, in the order they were sent.
    The notebook's end closing (it ended, or gave the pipe up) closes it."""

    def __init__(
        self, fds: tuple[int, int, int, int], io_loop, handle: Callable[[memoryview], None]
    ):
        # (its requests' pipe, the replies', the count's and the bell's)
        self.fd, self.reply_fd, self.count_fd, self.bell_fd = fds
        self.io_loop, self.handle = io_loop, handle
        self._records, self._waiting = RecordStream(), deque()
        io_loop.add_handler(self.fd, self._ready, io_loop.READ)

    def _ready(self, *_) -> None:
        if self.fd is None:
            return
        try:
            data = os.read(self.fd, READ)  # (more than that: the loop calls again)
        except BlockingIOError:
            data = None
        except OSError:
            data = b""
        if data == b"":  # no writer left: the notebook is gone
            self.close()
            return
        if data:
            had = bool(self._waiting)
            self._waiting.extend(self._records.feed(data))
            if had:  # (already being served, one a turn)
                return
        self._serve()

    def _serve(self) -> None:
        if not self._waiting:
            return
        body = self._waiting.popleft()
        try:
            self.handle(body)
        except Exception:  # (the handler answers every request itself)
            import logging

            logging.getLogger("notebook_dist").exception("an express request failed")
        finally:  # (whatever left the handler: those read and waiting are served)
            if self._waiting and self.fd is not None:
                self.io_loop.add_callback(self._serve)  # the next, after the loop's other work

    def reply(self, record: bytes) -> bool:
        """Write a reply's record (:func:`reply_record`); False when the pipe is full or
        gone (the reply then goes by the socket)."""
        try:
            os.write(self.reply_fd, record)
        except OSError:  # (BlockingIOError, BrokenPipeError, or closed)
            return False
        return True

    def count_down(self) -> None:
        """A counted request's reply was sent: :func:`count_down`."""
        if self.fd is not None:
            count_down(self.count_fd, self.bell_fd)

    def close(self, linger: int = 0) -> None:
        fd, self.fd = self.fd, None
        self._waiting.clear()
        if fd is not None:
            self.io_loop.remove_handler(fd)
            for other in (fd, self.reply_fd, self.count_fd, self.bell_fd):
                os.close(other)
