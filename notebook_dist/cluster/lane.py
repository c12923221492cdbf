"""The direct lane: the notebook's calls on the ranks go to each engine over a socket of
their own, not through the controller's queue (``runtime/lane.py`` is the rank's end). It
listens on loopback when every rank is on this machine, else where the controller listens
for its engines (``processes.open_lane``): ranks on other hosts reach it over the network.

A cell on 2 ranks through ipyparallel's queue takes two process hops each way: the
notebook's IO thread to the controller's queue, the queue to the engine, and back. The lane
is one ROUTER socket in the notebook, on the ipyparallel client's own IO loop, and one
DEALER per engine, addressed by the engine's uuid. What travels is ipyparallel's own
``apply_request``/``apply_reply``, built, signed, tracked and resolved by the client as a
request through the queue is: an :class:`ipyparallel.AsyncResult`, the ranks' output on
the usual IOPub route, an engine that dies with a request outstanding failing it with
``EngineError``. The engines, their registration, heartbeat, stop and launchers stay
ipyparallel's.

Beside it, the **express route** carries the cells, and the calls without a timeout
(``cluster/cells.py``: ``apply``, ``push``, ``pull``) (:meth:`Lane.express`): on Linux a pipe
to each rank and one pipe back from all of them (``cluster/pipes.py``), beside a ROUTER
socket of its own (``cluster/route.py``) for what does not fit, all read by the thread
waiting for the replies, so a cell's request and its replies never pass through another
thread of the notebook. A request is one pickled call by name, the same bytes for every
rank (signed on the socket); a reply is the rank's packed frames
and whether it wrote anything, so the notebook waits for a rank's 'idle' only after output
(``runtime/lane.py`` says what the rank does). Output on one stream, none of it sent yet,
comes in the reply itself; other output, the agents' snapshots and the 'idle' come on
ipyparallel's IOPub, into the client's metadata for the request, as for any request; :class:`~notebook_dist.cluster.express.ExpressResult` is what the
watch reads.

An engine joins the lane the first time it is addressed (a call through the queue, then its
hello on each route); one that cannot is served through the queue from then on.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import uuid

from ..runtime.lane import Seal
from . import engines
from .express import ExpressResult
from .route import ExpressRoute, listening

log = logging.getLogger("notebook_dist")


class Lane:
    """The notebook's end of the lane, for one cluster's client."""

    #: how long an engine has to say hello on the lane once asked to connect (seconds)
    HELLO_S = 5.0
    #: how long the engines have to answer the request to connect (seconds); the ones
    #: that do not are served through the queue
    JOIN_S = 30.0

    def __init__(self, client, ip: str, pipe_dir: str | None = None, host: str | None = None):
        """``ip``: where its sockets listen (``*``: every interface); ``host``: where the
        engines reach them (``ip`` when None)."""
        import zmq

        self.client = client
        # (the cells' route; ``pipe_dir``: a new folder for its pipes, in one only the user
        # can open)
        self.route = ExpressRoute(client, ip, Seal(client.session), pipe_dir, host)
        socket = client._context.socket(zmq.ROUTER)
        socket.linger = 0
        try:
            self.url = listening(socket, ip, host)
        except Exception:
            self.route.close()
            raise
        self._said = threading.Condition()
        self.ready: set[str] = set()  # engine uuids that said hello
        self.refused: set[int] = set()  # engine ids served through the queue
        self.stream = on_io_loop(client, lambda: self._stream(socket))

    def _stream(self, socket):
        from zmq.eventloop.zmqstream import ZMQStream

        stream = ZMQStream(socket, self.client._io_loop)
        stream.on_recv(self._received, copy=False)
        return stream

    def _received(self, frames) -> None:
        """On the IO thread: a rank's hello, or a reply, handled as the client handles
        replies from the controller's queue."""
        session = self.client.session
        idents, msg = session.feed_identities(frames, copy=False)
        try:
            msg = session.deserialize(msg, content=True, copy=False)
        except Exception:  # not signed with the cluster's key: dropped
            log.debug("an invalid message on the lane", exc_info=True)
            return
        kind = msg["header"]["msg_type"]
        if kind == "lane_hello":
            with self._said:
                self.ready.add(msg["content"]["engine"])
                self._said.notify_all()
        elif kind == "apply_reply":
            self.client._queue_handlers[kind](msg)

    # ---- the express route ---------------------------------------------------------

    def express(self, engine_ids: list[int], queue_view, func, *args):
        """``func(*args)`` on each engine by the express route, or None when one of them
        cannot take it. ``func`` is one of notebook_dist's own functions (sent by name),
        ``args`` plain data (a user's function travels packed in them:
        ``runtime.cell.call_packed``). Returns an :class:`~.express.ExpressResult`."""
        if any(e in self.refused for e in engine_ids):
            return None
        route = self.route
        route.check()
        known = self.client._engines  # (a trait: read once; ids -> uuids, as a plain dict)
        engines = [dict.get(known, e) for e in engine_ids]
        missing = [e for e, u in zip(engine_ids, engines) if u not in route.ready]
        if missing and not self._join(missing, queue_view):
            return None
        engines = [self._uuid(e) for e in engine_ids] if missing else engines
        base = uuid.uuid4().hex  # each rank's message id is base-<its uuid>: one request for all
        msg_ids = [f"{base}-{engine}" for engine in engines]
        session = self.client.session
        call = pickle.dumps((session.session, session.username, func, args), protocol=5)
        result = ExpressResult(route, msg_ids, engines)
        route.send(base, engines, msg_ids, base.encode() + call, result)
        return result

    # ---- the ipyparallel route -------------------------------------------------------

    def view(self, engine_ids: list[int], queue_view):
        """A DirectView on ``engine_ids`` whose requests take the lane, or None when one of
        them cannot (``queue_view(ids)``: a view through the queue, to ask them to join)."""
        from ipyparallel import DirectView

        if any(e in self.refused for e in engine_ids):
            return None
        missing = [e for e in engine_ids if self._uuid(e) not in self.ready]
        if missing and not self._join(missing, queue_view):
            return None
        view = DirectView(client=self.client, socket=self.stream, targets=list(engine_ids))
        view.block = False
        return view

    def _uuid(self, engine_id: int) -> str | None:
        return self.client._engines.get(engine_id)

    def _join(self, engine_ids: list[int], queue_view) -> bool:
        from ..runtime import lane as rt_lane

        route = self.route
        joining = [self._uuid(e) for e in engine_ids]
        try:
            folder = route.pipes_for(joining)
            engines.answered(
                queue_view(engine_ids),
                rt_lane.connect,
                self.url,
                route.join_url,
                folder,
                within=self.JOIN_S,
                what="its request to join the lane",
            )
        except Exception as exc:
            log.debug("engines %s could not join the lane: %s", engine_ids, exc)
            self.refused.update(engine_ids)
            return False
        finally:
            route.piped(joining)
        uuids = set(joining)
        deadline = time.monotonic() + self.HELLO_S
        with self._said:
            self._said.wait_for(lambda: uuids <= self.ready, self.HELLO_S)
        while not uuids <= route.ready and time.monotonic() < deadline:
            route.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        joined = [e for e in engine_ids if {self._uuid(e)} <= self.ready & route.ready]
        self.refused.update(e for e in engine_ids if e not in joined)
        return len(joined) == len(engine_ids)

    def close(self) -> None:
        """Before the client closes (its context would wait for an open socket)."""
        self.route.close()
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                on_io_loop(self.client, lambda: stream.close(linger=0), timeout=2.0)
            except Exception:  # its loop is gone: closed from here
                stream.socket.close(linger=0)


def on_io_loop(client, call, timeout: float = 10.0):
    """``call()`` run on the ipyparallel client's IO thread (the lane's socket lives there)."""
    done = threading.Event()
    out = []

    def run():
        try:
            out.append(call())
        finally:
            done.set()

    client._io_loop.add_callback(run)
    if not done.wait(timeout):
        raise TimeoutError("the ipyparallel client's IO loop did not answer")
    return out[0] if out else None
