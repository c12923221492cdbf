"""The direct lane: the notebook's calls on local ranks go to each engine over a socket of
their own, not through the controller's queue (``runtime/lane.py`` is the rank's end).

A cell on 2 ranks through ipyparallel's queue takes two process hops each way: the
notebook's IO thread to the controller's queue, the queue to the engine, and back. The lane
is one ROUTER socket in the notebook, on the ipyparallel client's own IO loop, and one
DEALER per engine, addressed by the engine's uuid. What travels is ipyparallel's own
``apply_request``/``apply_reply``, built, signed, tracked and resolved by the client as a
request through the queue is: an :class:`ipyparallel.AsyncResult`, the ranks' output on
the usual IOPub route, an engine that dies with a request outstanding failing it with
``EngineError``. The engines, their registration, heartbeat, stop and launchers stay
ipyparallel's.

Beside it, the **express route** carries the cells (:meth:`Lane.express`): a ROUTER socket
of its own that the thread waiting for the replies reads itself, so a cell's request and
its replies never pass through another thread of the notebook. A request is one pickled
call by name, signed, the same bytes for every rank; a reply is the rank's packed frames
and whether it wrote anything, so the notebook waits for a rank's 'idle' only after output
(``runtime/lane.py`` says what the rank does). The output itself, the agents' snapshots and
the 'idle' still come on ipyparallel's IOPub, into the client's metadata for the request,
as for any request; :class:`~notebook_dist.cluster.express.ExpressResult` is what the
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

from ..runtime.lane import HELLO, REPLY, REPLY_HEAD, REQUEST, SNDMORE, Seal, received
from .express import ExpressError, ExpressResult, Records
from .relay import entries as relay_entries

log = logging.getLogger("notebook_dist")

#: a reply head's bytes (``runtime/lane.py``): ok, wrote, and frames as they are
_OK, _ONE, _FRAMES = ord("o"), ord("1"), ord("f")


class Lane:
    """The notebook's end of the lane, for one cluster's client."""

    #: how long an engine has to say hello on the lane once asked to connect (seconds)
    HELLO_S = 5.0

    def __init__(self, client, ip: str):
        import zmq

        self.client = client
        socket = client._context.socket(zmq.ROUTER)
        socket.linger = 0
        self.url = f"tcp://{ip}:{socket.bind_to_random_port(f'tcp://{ip}')}"
        self._said = threading.Condition()
        self.ready: set[str] = set()  # engine uuids that said hello
        self.refused: set[int] = set()  # engine ids served through the queue
        self.stream = on_io_loop(client, lambda: self._stream(socket))
        # the express route: used only under its lock, by the thread that sends or waits
        self._xlock = threading.RLock()
        xs = client._context.socket(zmq.ROUTER)
        xs.linger = 0
        xs.router_mandatory = 1  # a request to an engine not connected fails at once
        self.express_url = f"tcp://{ip}:{xs.bind_to_random_port(f'tcp://{ip}')}"
        self._express = xs
        self.express_ready: set[str] = set()  # engine uuids that said hello on it
        self.pending: dict[str, object] = {}  # msg_id -> its express Reply
        self.relay = None  # a RelayLink (cluster/relay.py) the engines join through, if any
        self.via_relay: set[str] = set()  # engine uuids joined through it
        self.records = Records.install(client)
        self._seal = Seal(client.session)

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
        ``args`` plain data. Returns an :class:`~.express.ExpressResult`."""
        if any(e in self.refused for e in engine_ids):
            return None
        with self._xlock:
            self._relay_check()
        known = self.client._engines  # (a trait: read once; ids -> uuids, as a plain dict)
        engines = [dict.get(known, e) for e in engine_ids]
        missing = [e for e, u in zip(engine_ids, engines) if u not in self.express_ready]
        if missing and not self._join(missing, queue_view):
            return None
        engines = [self._uuid(e) for e in engine_ids] if missing else engines
        base = uuid.uuid4().hex  # each rank's message id is base-<its uuid>: one request for all
        msg_ids = [f"{base}-{engine}" for engine in engines]
        session = self.client.session
        call = pickle.dumps((session.session, session.username, func, args), protocol=5)
        request = self._seal.sealed(REQUEST, base.encode() + call)
        result = ExpressResult(self, msg_ids, engines)
        with self._xlock:
            self.pending.update(zip(msg_ids, result._children))
            send, via = self._express.send, self.via_relay
            if via.issuperset(engines):  # (every rank through the relay: no look at each)
                relayed, direct = engines, []
            else:
                relayed = [e for e in engines if e in via]
                direct = [(e, m) for e, m in zip(engines, msg_ids) if e not in via]
            for engine, msg_id in direct:
                try:
                    send(engine.encode(), SNDMORE)
                    send(request)
                except Exception as exc:  # zmq: the engine is not connected (it died)
                    self._unreached(msg_id, engine, f"not reachable: {exc}")
            if relayed:  # one message for all of them
                try:
                    self._express.send_multipart(self.relay.request(base, relayed, request))
                except Exception as exc:  # the relay ended: its ranks rejoin directly
                    for engine in relayed:
                        self._unreached(f"{base}-{engine}", engine, f"relay gone: {exc}")
        return result

    def _unreached(self, msg_id: str, engine: str, why: str, wrote: bool = True) -> None:
        """A call that cannot reach ``engine``, failed; ``wrote``: its output may still come
        (False: the rank runs on, and its 'idle' is not waited for)."""
        reply = self.pending.pop(msg_id, None)
        self.express_ready.discard(engine)
        self.via_relay.discard(engine)
        if reply is not None:
            reply.finish(error=ExpressError("EngineError", why), wrote=wrote)

    def _relay_check(self) -> None:
        """A relay that ended: the calls waiting on it fail with a sentence, and its ranks
        join this socket again at their next call."""
        relay = self.relay
        how = relay.gone() if relay is not None else None
        if how is None:
            return
        self.relay = None
        why = (
            f"the relay between the notebook and the ranks {how} before this rank's reply "
            "came; the rank carries on with its variables, but what this call returns is "
            "lost. The next call reaches the ranks directly."
        )
        relayed, self.via_relay = self.via_relay, set()
        self.express_ready -= relayed
        for msg_id, reply in list(self.pending.items()):
            if reply.engine in relayed:
                self._unreached(msg_id, reply.engine, why, wrote=False)

    def pump(self, timeout: float) -> None:
        """Read the express route: wait up to ``timeout`` seconds for something, then take
        all that has come (replies to any waiter, hellos)."""
        import zmq

        if not (
            self._xlock.acquire(timeout=timeout) if timeout > 0 else self._xlock.acquire(False)
        ):
            return
        try:
            sock = self._express
            if sock is None or not sock.poll(int(timeout * 1000)):
                self._relay_check()  # (a relay's end is looked for while nothing comes)
                return
            while True:
                try:
                    frames = received(sock)
                except zmq.Again:
                    return
                self._take(frames)
        finally:
            self._xlock.release()

    def _take(self, frames: list) -> None:
        """One message on the express route: a rank's hello, or a reply, checked against
        the cluster's key (anything else is dropped)."""
        if len(frames) < 2:
            return
        sender = frames[0].bytes
        if self.relay is not None and sender == self.relay.ident:
            for engine, kind, body, extra in relay_entries(self._seal, frames[1:]):
                if kind is None:  # not reachable from the relay for request ``body``
                    self._unreached(f"{body}-{engine}", engine, "not reachable (relay)")
                else:
                    self._one(engine, kind, body, extra, True)
            return
        extra = [f.buffer for f in frames[2:]]
        opened = self._seal.opened(frames[1].buffer, extra)
        if opened is None or opened[0] not in (REPLY, HELLO):
            log.debug("an invalid message on the express route")
            return
        self._one(sender.decode(), *opened, extra, False)

    def _one(self, engine: str, kind: bytes, body, extra, relayed: bool) -> None:
        """One rank's hello or reply, its seal checked (here, or by the relay)."""
        if kind == HELLO:
            said = bytes(body).decode()
            self.express_ready.add(said)
            (self.via_relay.add if relayed else self.via_relay.discard)(said)
            return
        if kind != REPLY:
            return
        # the body: the request's id, then a byte each (ok, wrote, how), then the value
        reply = self.pending.pop(f"{str(body[:32], 'ascii')}-{engine}", None)
        if reply is None:  # a call already given up on
            return
        rest = body[REPLY_HEAD:]
        value = [rest, *extra] if body[34] == _FRAMES else pickle.loads(rest)
        if body[32] == _OK:
            reply.finish(value, None, body[33] == _ONE)
        else:
            reply.finish(None, ExpressError(**value), body[33] == _ONE)

    def outstanding(self, engine: str) -> bool:
        """Whether an express call to this engine (uuid) waits for its reply."""
        return any(r.engine == engine for r in list(self.pending.values()))

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

        try:
            express_url = self.relay.back_url if self.relay is not None else self.express_url
            queue_view(engine_ids).apply_sync(rt_lane.connect, self.url, express_url)
        except Exception as exc:
            log.debug("engines %s could not join the lane: %s", engine_ids, exc)
            self.refused.update(engine_ids)
            return False
        uuids = {self._uuid(e) for e in engine_ids}
        deadline = time.monotonic() + self.HELLO_S
        with self._said:
            self._said.wait_for(lambda: uuids <= self.ready, self.HELLO_S)
        while not uuids <= self.express_ready and time.monotonic() < deadline:
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        joined = [e for e in engine_ids if {self._uuid(e)} <= self.ready & self.express_ready]
        self.refused.update(e for e in engine_ids if e not in joined)
        return len(joined) == len(engine_ids)

    def close(self) -> None:
        """Before the client closes (its context would wait for an open socket)."""
        with self._xlock:
            express, self._express = self._express, None
            if express is not None:
                express.close(linger=0)
            relay, self.relay = self.relay, None
            if relay is not None:
                relay.close()
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
