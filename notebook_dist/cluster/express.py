"""What the notebook holds for one express call on the lane (``cluster/lane.py``): each
rank's reply, its output as ipyparallel gathers it, and whether that output is complete.

It answers the few questions the cell's watch asks of an ipyparallel ``AsyncResult``
(``_metadata``, ``_children``, ``wait``, ``wait_for_output``), without the threads,
futures and callbacks an ``AsyncResult`` makes for each message: the thread that waits
reads the replies itself.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from functools import partial

from ..output import ordered_record


class ExpressError(Exception):
    """A rank could not run an express call, or could not send back what it returned."""

    def __init__(self, ename: str, evalue: str, traceback: str = ""):
        super().__init__(f"{ename}: {evalue}")
        self.ename, self.evalue, self.traceback = ename, evalue, traceback or f"{ename}: {evalue}"


class Reply:
    """One rank's reply, as a finished future: ``done()``, ``result()``."""

    __slots__ = ("msg_id", "engine", "wrote", "_done", "_value", "_error", "_left")

    def __init__(self, msg_id: str, engine: str, left: list[int]):
        self.msg_id, self.engine = msg_id, engine
        self.wrote = True  # until the reply says otherwise: its output may still come
        self._done = False
        self._value = self._error = None
        self._left = left  # [how many of its call's replies are still to come]

    def done(self) -> bool:
        return self._done

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value

    def finish(self, value=None, error: BaseException | None = None, wrote: bool = True):
        self._value, self._error, self.wrote = value, error, wrote
        if not self._done:
            self._done = True
            self._left[0] -= 1


class OutputDone:
    """Set by ipyparallel's client when the rank's 'idle' arrives (its output is all in):
    the two methods its IOPub handler calls on an output future. The event to wait on is
    made only when someone waits (most ranks of most cells write nothing)."""

    __slots__ = ("_done", "_event")

    def __init__(self):
        self._done = False
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, _value) -> None:  # (on the client's IO thread)
        self._done = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float) -> bool:
        # the event is in place before done is read: a result set meanwhile either sees it
        # or is seen here
        event = self._event = self._event or threading.Event()
        return self._done or event.wait(timeout)


class Records(defaultdict):
    """The client's ``metadata``, which its IOPub handler fills on the client's IO thread,
    making an entry for any request it has not seen. An express call's entries are dropped
    when it is over (:meth:`forget`), on another thread. Output for it that comes later (a
    thread of the rank's writing while no cell runs: ipykernel parents it on the last
    request) does not make the entry again: it goes to where the call said its late output
    goes, or nowhere."""

    #: how many forgotten express calls are remembered as such
    KEEP = 512

    def __init__(self, factory, entries=()):
        super().__init__(factory, entries)
        #: an express call's request id (its ranks' msg_ids are ``base-engine``) -> (where
        #: its late output goes, ``late(i, stream, text)``, and its msg_ids), or None
        self._forgotten: OrderedDict[str, tuple | None] = OrderedDict()

    def __missing__(self, msg_id):
        base, dash, _ = msg_id.partition("-")
        if dash and base in self._forgotten:  # a record of a call that is over: not kept
            call = self._forgotten.get(base)
            if call is None or msg_id not in call[1]:
                return self.default_factory()
            late, msg_ids = call
            return _late_record(partial(late, msg_ids.index(msg_id)))
        return super().__missing__(msg_id)

    def of(self, msg_id: str):
        """The record of ``msg_id`` if it is kept; for a call forgotten, one that passes its
        output on to where the call's late output goes; else None (none is made)."""
        record = self.get(msg_id)
        if record is None and msg_id.partition("-")[0] in self._forgotten:
            record = self[msg_id]
        return record

    def forget(self, msg_ids: list[str], late: Callable[[int, str, str], None] | None = None):
        """Drop the records of one express call's ``msg_ids``; output for the i-th that
        comes later is given to ``late(i, stream, text)``."""
        if not msg_ids:
            return
        forgotten = self._forgotten
        # marked before the entries go: the IO thread sees one or the other
        forgotten[msg_ids[0].partition("-")[0]] = None if late is None else (late, msg_ids)
        pop = self.pop
        for m in msg_ids:
            pop(m, None)
        while len(forgotten) > self.KEEP:
            forgotten.popitem(last=False)

    @classmethod
    def install(cls, client) -> Records:
        """The client's metadata, made a :class:`Records` (what it holds is kept)."""
        metadata = client.metadata
        if not isinstance(metadata, cls):
            metadata = client.metadata = cls(metadata.default_factory, metadata)
        return metadata


_LATE: list[type] = []


def _late_record(late: Callable[[str, str], None]):
    """A record for one late message, not kept: its text on a stream goes to ``late``."""
    if not _LATE:
        from ipyparallel.client.client import Metadata

        class LateRecord(Metadata):
            def __setitem__(self, key, value):
                super().__setitem__(key, value)
                if key in ("stdout", "stderr") and value:  # (a new record: the message's text)
                    self.__dict__["_late"](key, value)

        _LATE.append(LateRecord)
    record = _LATE[0]()
    record.__dict__["_late"] = late
    return record


class ExpressResult:
    """The ranks' replies to one express call, in the order of the engines asked."""

    def __init__(self, route, msg_ids: list[str], engines: list[str]):
        self._route = route  # (cluster/route.py)
        self.msg_ids = msg_ids
        metadata, futures = route.client.metadata, route.client._output_futures  # (traits)
        self._left = [len(msg_ids)]  # (each reply counts itself in as it finishes)
        self._metadata, self._children, self._outputs = [], [], []
        for m, e in zip(msg_ids, engines):  # (before the request is sent)
            md = metadata[m] = ordered_record()
            self._metadata.append(md)
            self._children.append(Reply(m, e, self._left))
            out = futures[m] = OutputDone()
            self._outputs.append(out)

    def ready(self) -> bool:
        return self._left[0] <= 0

    def wait(self, timeout: float | None = -1) -> bool:
        """Wait until every reply is in, or ``timeout`` seconds (-1 or None: no limit)."""
        forever = timeout is None or timeout < 0
        deadline = time.monotonic() + (0 if forever else timeout)
        while not self.ready():
            left = 0.05 if forever else deadline - time.monotonic()
            if left <= 0:
                break
            self._route.pump(min(left, 0.05))
        return self.ready()

    def wait_for_output(self, timeout: float | None = -1) -> bool:
        """Wait until the output of every rank that wrote any is in, or ``timeout``."""
        deadline = time.monotonic() + (1e9 if timeout is None or timeout < 0 else timeout)
        complete = True
        for reply, out in zip(self._children, self._outputs):
            if reply.done() and not reply.wrote:
                continue
            complete = out.wait(max(0.0, deadline - time.monotonic())) and complete
        return complete

    def forget(self, late: Callable[[int, str, str], None] | None = None) -> None:
        """The call is over: what the client and the lane keep for it is dropped (a reply
        that comes later is ignored; output, ``late(i, stream, text)`` for the i-th rank
        asked)."""
        route = self._route
        pending, futures = route.pending, route.client._output_futures
        for reply in self._children:
            pending.pop(reply.msg_id, None)
            futures.pop(reply.msg_id, None)
        if not self.ready():  # (a rank that died during the call: the relay stops waiting for it)
            route.given_up([r.engine for r in self._children if not r.done()])
        route.records.forget(self.msg_ids, late)
