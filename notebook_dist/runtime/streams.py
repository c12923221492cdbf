"""A rank's stdout and stderr, sent in the order the rank wrote them.

ipykernel buffers each stream on its own and sends each on its own timer, so a rank that
prints a line, logs a warning and prints again could reach the notebook as two prints
and then the warning. :func:`keep_in_order` sends what one stream holds before the other
takes a write: the two streams' messages leave in the order they were written, and the
notebook (``notebook_dist.output``) shows them in the order they arrive. :func:`drain`
waits, at a cell's end, for what was written to the file descriptors (C libraries,
subprocesses) to be part of this cell's output. :func:`forward_display_updates` lets a
display the rank updates in place (a DisplayHandle's ``update``, the Transformers
Trainer's HTML progress bar) reach the notebook.
"""

from __future__ import annotations

import linecache
import sys
import threading

#: how many writes the rank's stdout and stderr have taken (counted by keep_in_order)
_WRITES = [0]


def written() -> int:
    """A count that moves with every write to stdout or stderr."""
    return _WRITES[0]


def holds(stream) -> bool:
    """Whether ipykernel's ``stream`` holds output not yet sent (True for another kind of
    stream: it is flushed to be sure)."""
    buffers = getattr(stream, "_buffers", None)
    if buffers is None:
        return True
    return bool(buffers) or bool(getattr(stream, "_flush_pending", False))


def flush_written(before: int) -> None:
    """Send what was written since :func:`written` was ``before``, or is still held (a
    flush waits for ipykernel's IO thread: skipped when there is nothing to send)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and (_WRITES[0] != before or holds(stream)):
            stream.flush()


def keep_in_order() -> None:
    """Each write to stdout or stderr first sends what the other stream holds (only when
    the writes switch streams: a loop of prints costs nothing more). Idempotent."""
    out, err = sys.stdout, sys.stderr
    if not all(hasattr(s, "pub_thread") for s in (out, err)):
        return  # not ipykernel's streams (a plain process): already in order
    if getattr(out.write, "_notebook_dist_ordered", False):
        return
    last: list = [None]
    lock = threading.Lock()

    def ordered(stream, other):
        write = stream.write

        def ordered_write(string):
            with lock:
                switched, last[0] = last[0] is not stream, stream
                _WRITES[0] += 1
            if switched:
                other.flush()  # what the other stream holds goes first
            return write(string)

        ordered_write._notebook_dist_ordered = True
        return ordered_write

    out.write, err.write = ordered(out, err), ordered(err, out)


def logging_follows_streams() -> None:
    """torch's log handlers, made when torch was imported (by the fork server, or by an
    engine in the background while it started) and so before the engine took over stdout
    and stderr, write to the streams the rank writes to now, as under torchrun: otherwise
    torch's warnings would go to the engine's log file, not to the notebook. (The engine's
    own log stays in its file.)"""
    import logging

    now = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name != "torch" and not name.startswith("torch."):
            continue
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler:  # not a file's
                stream = now.get(id(handler.stream))
                if stream is not None and stream is not handler.stream:
                    handler.setStream(stream)


#: the metadata key that marks a display message as an update of an earlier display
UPDATE = "notebook_dist/update"


def forward_display_updates() -> None:
    """ipyparallel's client keeps a rank's ``display_data`` and drops its
    ``update_display_data``; an update leaves the rank as a ``display_data`` marked
    :data:`UPDATE`, and the notebook applies it to the display it updates. Idempotent."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    pub = getattr(get_ipython(), "display_pub", None)
    if pub is None or getattr(pub.publish, UPDATE, False):
        return
    publish = pub.publish

    def publish_updates_as_displays(data, metadata=None, *, transient=None, update=False, **kw):
        if update:
            metadata = {**(metadata or {}), UPDATE: True}
        return publish(data, metadata, transient=transient, **kw)

    setattr(publish_updates_as_displays, UPDATE, True)
    pub.publish = publish_updates_as_displays


def drain(timeout: float = 5.0) -> None:
    """What the cell wrote to its file descriptors, read and sent, then both streams
    flushed."""
    for stream in (sys.stdout, sys.stderr):
        _drain_fd(stream, timeout)
        if holds(stream):
            stream.flush()


def _drain_fd(stream, timeout: float) -> None:
    """Wait until what the cell wrote to the stream's file descriptor (os.write, C
    libraries, subprocesses) has been read by ipykernel's pipe thread, so it is part of
    this cell's output and not the next one's. A rank's own stream
    (:class:`~notebook_dist.runtime.outstream.RankOutStream`) knows; ipykernel's, in an
    engine the user started, is watched from outside, which can miss bytes read and not
    yet written."""
    settle = getattr(stream, "settle", None)
    if settle is not None:
        settle(timeout)
        return
    import fcntl
    import termios
    import time

    fid, thread = getattr(stream, "_fid", None), getattr(stream, "watch_fd_thread", None)
    if fid is None or thread is None or not thread.is_alive():
        return
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fid, termios.FIONREAD, buf)
        except OSError:
            return
        frame = sys._current_frames().get(thread.ident)
        # empty pipe, and the thread back in os.read: everything read has been written
        if int.from_bytes(buf, sys.byteorder) == 0 and _reading(frame):
            return
        time.sleep(0.001)


def _reading(frame) -> bool:
    """True when the pipe thread waits in ``os.read``; False while it handles what it
    read (its own frame is then below the top: ``self.write`` of the bytes)."""
    top = frame
    while frame is not None and frame.f_code.co_name != "_watch_pipe_fd":
        frame = frame.f_back
    if frame is None:
        return True  # not the thread we know: nothing to wait for
    if frame is not top:
        return False  # writing what it read: the bytes are not in the stream yet
    where = (frame.f_code.co_filename, frame.f_lineno)
    reading = _READ_AT.get(where)
    if reading is None:  # (the same line on every cell: read once)
        reading = _READ_AT[where] = "os.read(" in linecache.getline(*where)
    return reading


#: whether the pipe thread's line at (file, line) is its ``os.read``
_READ_AT: dict[tuple[str, int], bool] = {}
