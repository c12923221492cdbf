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

An engine joins the lane the first time it is addressed (a call through the queue, then its
hello on the lane); one that cannot is served through the queue from then on.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("notebook_dist")


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
        self.stream = self._on_io_loop(lambda: self._stream(socket))

    def _on_io_loop(self, call, timeout: float = 10.0):
        """``call()`` run on the client's IO thread (the lane's socket lives there)."""
        done = threading.Event()
        out = []

        def run():
            try:
                out.append(call())
            finally:
                done.set()

        self.client._io_loop.add_callback(run)
        if not done.wait(timeout):
            raise TimeoutError("the ipyparallel client's IO loop did not answer")
        return out[0] if out else None

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
            queue_view(engine_ids).apply_sync(rt_lane.connect, self.url)
        except Exception as exc:
            log.debug("engines %s could not join the lane: %s", engine_ids, exc)
            self.refused.update(engine_ids)
            return False
        uuids = {self._uuid(e) for e in engine_ids}
        with self._said:
            joined = self._said.wait_for(lambda: uuids <= self.ready, self.HELLO_S)
        if not joined:
            self.refused.update(e for e in engine_ids if self._uuid(e) not in self.ready)
        return joined

    def close(self) -> None:
        """Before the client closes (its context would wait for an open socket)."""
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                self._on_io_loop(lambda: stream.close(linger=0), timeout=2.0)
            except Exception:  # its loop is gone: closed from here
                stream.socket.close(linger=0)
