"""A rank's stdout and stderr as the engine makes them: ipykernel's ``OutStream``, whose
thread that reads the stream's file descriptor can be waited for exactly.

ipykernel moves file descriptors 1 and 2 onto pipes, and a thread reads each pipe and
writes what it read to the stream, so what C libraries, subprocesses and ``os.write``
print reaches the notebook. At a cell's end the rank waits for that thread, or the output
would show in the next cell or not at all. ipykernel's thread gives no sign of having
read bytes it has not yet written: between its ``os.read`` returning and its write, the
pipe is empty and the thread looks idle. Here the thread reads and writes under a lock
(:attr:`RankOutStream.handling`), so :meth:`RankOutStream.settle` knows: with the lock held
and the pipe empty, everything written before is in the stream.

The thread also decodes UTF-8 across reads: a character split between two reads is shown
whole, not as two replacement characters.

A rank's engine makes its streams of this class (:data:`FLAG`); an engine the user started
(an attached cluster) made ipykernel's, which :func:`adopt` turns into this one as the
engine becomes a rank.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
import threading
import time

from ipykernel.iostream import PIPE_BUFFER_SIZE, OutStream

from .pipes import unread as _unread

#: how a rank's engine is told to make its streams (added ahead of its command line)
FLAG = f"--IPEngine.out_stream_factory={__name__}.RankOutStream"

#: this process's id, kept as it forks (``os.getpid`` is a system call, 0.5 µs here, and
#: ipykernel asks it on every write to tell a forked child of the rank from the rank)
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


class RankOutStream(OutStream):
    """ipykernel's ``OutStream``; the thread reading the file descriptor holds
    :attr:`handling` from each read to the end of its write, and :meth:`write` costs a
    third of ipykernel's."""

    #: (the last parent header written for, its buffer's key): the same dict, the same key
    _keyed: tuple = (None, None)

    def write(self, string):
        """ipykernel's write (7.x: a buffer for each parent header), with the buffer's key
        made once for each parent, not on every write: ipykernel makes a frozenset of the
        parent header for each write, two for each ``print``, which made a rank's print
        cost 6.7 µs of its CPU against 0.6 µs into a file; nor asks the system for the
        process's id each time. Anything else (another ipykernel, an echo, a closed
        stream, a forked child of the rank) is ipykernel's own write."""
        owner = getattr(self, "_master_pid", None) or getattr(self, "_main_pid", None)
        if (
            type(string) is not str
            or self.echo is not None
            or self.pub_thread is None
            or not hasattr(self, "_buffers")
            or _PID[0] != owner  # (a forked child of the rank writes as ipykernel does)
        ):
            return super().write(string)
        parent = self.parent_header
        keyed = self._keyed  # (one read: threads with parents of their own each keep theirs)
        if keyed[0] is not parent:
            keyed = self._keyed = (parent, frozenset(parent.items()))
        with self._buffer_lock:  # (the IO thread swaps the buffers under it)
            self._buffers[keyed[1]].write(string)
        if not self._flush_pending:
            self._schedule_flush()
        return len(string)

    #: how often the IO thread took buffers with text in them (each is a message sent)
    rotated = 0

    def _rotate_buffers(self):
        with self._buffer_lock:  # (reentrant: ipykernel's takes it again)
            old = super()._rotate_buffers()
            if any(buffer.tell() for buffer in old.values()):
                self.rotated += 1
        return old

    def holding(self) -> bool:
        """Whether text waits to be sent, for any parent (True when it cannot be told: an
        ipykernel without a buffer for each parent)."""
        if not hasattr(self, "_buffers"):
            return True
        with self._buffer_lock:
            return any(buffer.tell() for buffer in self._buffers.values())

    def take(self, most: int) -> str | None:
        """The text this stream holds, all of it for the request it writes for now (its
        parent header, as :meth:`write` keys it), taken out: it is not sent. None, and
        nothing taken, when some is another parent's, when it is longer than ``most``, or
        when something transforms what is sent (an ``ipywidgets.Output`` capturing the
        stream registers a hook), an echo, or an ipykernel without a buffer per parent."""
        if not hasattr(self, "_buffers") or getattr(self, "_hooks", None) or self.echo is not None:
            return None
        parent, keyed = self.parent_header, self._keyed
        key = keyed[1] if keyed[0] is parent else frozenset(parent.items())
        with self._buffer_lock:
            buffers = self._buffers
            held = [k for k, buffer in buffers.items() if buffer.tell()]
            if held != [key] or buffers[key].tell() > most:
                return None
            return buffers.pop(key).getvalue()

    def _setup_stream_redirects(self, name):
        self._prepare_watch()
        super()._setup_stream_redirects(name)

    def _prepare_watch(self) -> None:
        self.handling = threading.Lock()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _watch_pipe_fd(self):
        fid = self._fid
        if fid is None:
            return
        poller = select.poll()
        poller.register(fid, select.POLLIN)
        try:
            while True:
                poller.poll()  # (not under the lock: a cell's end finds the pipe idle)
                with self.handling:
                    data = os.read(fid, PIPE_BUFFER_SIZE)
                    if not data or not self._should_watch:
                        return  # closed: ipykernel's close() wakes it with one byte
                    self._pass_on(data, final=False)
        except Exception:
            self._exc = sys.exc_info()

    def _pass_on(self, data: bytes, final: bool) -> None:
        text = self._decoder.decode(data, final)
        if text:
            self.write(text)
        if data:
            os.write(self._original_stdstream_copy, data)  # the engine's log, as ipykernel

    def settle(self, timeout: float) -> bool:
        """Wait until what was written to the file descriptor before this call is in the
        stream (a character left incomplete is written as a replacement); False when the
        pipe was still not empty after ``timeout`` seconds."""
        thread = getattr(self, "watch_fd_thread", None)
        if thread is None or not thread.is_alive():
            return True
        deadline = time.monotonic() + timeout
        while True:
            with self.handling:
                try:
                    empty = _unread(self._fid) == 0
                except OSError:  # closed meanwhile
                    return True
                if empty:
                    self._pass_on(b"", final=True)
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


#: what a stream must have for its pipe thread to be replaced (ipykernel 6.29 to 7)
_PIPE_PARTS = ("_fid", "_original_stdstream_fd", "_original_stdstream_copy", "_should_watch")


def adopt(stream) -> None:
    """ipykernel's own ``OutStream`` (an engine the user started) as a
    :class:`RankOutStream`: its pipe thread is ended and this class's started in its place,
    so a cell's end can wait for it exactly. Bytes another thread writes to the file
    descriptor in the moment of the swap could be lost: it is done as the engine becomes a
    rank, before any cell."""
    if type(stream) is not OutStream:
        return  # already ours, or not ipykernel's: nothing to wait for
    thread = getattr(stream, "watch_fd_thread", None)
    if thread is None or not all(hasattr(stream, a) for a in _PIPE_PARTS):
        stream.__class__ = RankOutStream  # no pipe watched (its settle has nothing to do)
        return
    deadline = time.monotonic() + 5.0
    while _unread(stream._fid) and time.monotonic() < deadline:
        time.sleep(0.001)  # what is in the pipe, read by the old thread first
    stream._should_watch = False
    os.write(stream._original_stdstream_fd, b"\0")  # wakes it; it ends without passing it on
    thread.join(5.0)
    if thread.is_alive():  # (not the thread we know): left as it was
        stream._should_watch = True
        return
    stream.__class__ = RankOutStream
    stream._prepare_watch()
    stream._should_watch = True
    stream.watch_fd_thread = threading.Thread(target=stream._watch_pipe_fd, daemon=True)
    stream.watch_fd_thread.start()
