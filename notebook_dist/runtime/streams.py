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

import contextlib
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


#: at most this much of a call's output goes in its reply; more goes as ipykernel sends it
IN_REPLY_MOST = 1 << 16


def rotations() -> tuple[int, int]:
    """How often stdout's and stderr's buffers were taken to be sent (-1: not a rank's)."""
    return tuple(getattr(s, "rotated", -1) for s in (sys.stdout, sys.stderr))


def taken(before: tuple[int, int]) -> tuple[str, str] | None:
    """A call's output taken out of the streams, to go in its reply rather than as
    messages of its own, which reach the notebook a hop and two threads later: (stream's
    name, text), ("", "") for none; None when it goes as ipykernel sends it: some of it
    was sent already (``before``: :func:`rotations` as the call began), both streams hold
    some (their order is the messages'), or a stream cannot give it
    (:meth:`~notebook_dist.runtime.outstream.RankOutStream.take`)."""
    if -1 in before or rotations() != before:
        return None
    holding = [s for s in (sys.stdout, sys.stderr) if s.holding()]
    if not holding:
        return "", ""
    if len(holding) > 1:
        return None
    text = holding[0].take(IN_REPLY_MOST)
    return None if text is None else (holding[0].name, text)


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
            # (a count that loses a step to another thread still moves: what it is for)
            _WRITES[0] += 1
            if last[0] is not stream:  # the lock only when the writes switch streams
                with lock:
                    switched, last[0] = last[0] is not stream, stream
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
    """What the cell wrote to its file descriptors (os.write, C libraries, subprocesses)
    in the streams, so it is this cell's output and not the next one's (a rank's streams,
    :class:`~notebook_dist.runtime.outstream.RankOutStream`, know when it is), then both
    streams flushed; in a call on the express route, what they hold is left for its reply
    to take or to flush (:func:`for_the_reply`)."""
    for stream in (sys.stdout, sys.stderr):
        settle = getattr(stream, "settle", None)
        if settle is not None:
            settle(timeout)
        if holds(stream) and not _FOR_THE_REPLY[0]:
            stream.flush()


#: whether a call on the express route runs (its reply takes its output, or flushes it)
_FOR_THE_REPLY = [False]


@contextlib.contextmanager
def for_the_reply():
    """While a call on the express route runs: :func:`drain` leaves the output for its
    reply (``runtime/lane.py`` takes it with :func:`taken`, or flushes it)."""
    _FOR_THE_REPLY[0] = True
    try:
        yield
    finally:
        _FOR_THE_REPLY[0] = False


def adopt_streams() -> None:
    """stdout and stderr as a rank's streams, also in an engine the user started
    (:func:`~notebook_dist.runtime.outstream.adopt`). Idempotent."""
    try:
        from .outstream import adopt
    except ImportError:  # no ipykernel: a plain process, whose writes are in order
        return
    for stream in (sys.stdout, sys.stderr):
        adopt(stream)
