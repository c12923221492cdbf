"""The express route's socket in the notebook (``cluster/lane.py`` says what the route
carries): one ROUTER socket, and the pipes to the ranks that opened theirs
(``cluster/pipes.py``), read by whichever thread waits for a reply, never by the
client's IO thread. It sends a call to the ranks (each directly, by its pipe or the
socket, or all of them in one message through the relay, ``cluster/relay.py``), takes
their hellos and replies, and tells the relay what the notebook stopped waiting for.

Everything here runs under the route's lock, by the thread that sends or waits.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading

from ..runtime.lane import (
    COUNTED,
    HELLO,
    IN_STDERR,
    IN_STDOUT,
    REPLY,
    REPLY_HEAD,
    REQUEST,
    SNDMORE,
    received,
)
from ..runtime.pipes import record
from ..values import discard
from .express import ExpressError, Records
from .pipes import RankPipes
from .relay import entries as relay_entries

log = logging.getLogger("notebook_dist")

#: a reply head's bytes (``runtime/lane.py``): ok, wrote, and frames as they are; the rank's
#: stdout or stderr in the reply
_OK, _ONE, _FRAMES = ord("o"), ord("1"), ord("f")
_IN_REPLY = {ord(IN_STDOUT): "stdout", ord(IN_STDERR): "stderr"}


def _whole_ms(seconds: float) -> int:
    """A wait in whole milliseconds, rounded up: a wait's last fraction of one, rounded
    down to 0, spun the waiting loop about 36 times for each 50 ms a cell waited."""
    return math.ceil(seconds * 1000) if seconds > 0 else 0


def _output_in_reply(records, msg_id: str, body):
    """What follows a reply's head (``body``'s), past the rank's output if it came in the
    reply (its length, then UTF-8): that is put in the call's record, as ipyparallel's IO
    thread puts a message's."""
    rest = body[REPLY_HEAD:]
    stream = _IN_REPLY.get(body[33])
    if stream is None:
        return rest
    size = int.from_bytes(rest[:4], "little")
    record = records.of(msg_id)
    if record is not None:
        record[stream] = (record.get(stream) or "") + str(rest[4 : 4 + size], "utf-8", "replace")
    return rest[4 + size :]


def listening(socket, ip: str, host: str | None = None) -> str:
    """``socket`` bound to a free port on ``ip`` (``*``: every interface); the address the
    engines connect to, at ``host`` (``ip`` when None). A socket that cannot bind is closed:
    an open one would keep its zmq context from ending."""
    try:
        port = socket.bind_to_random_port(f"tcp://{ip}")
    except Exception:
        socket.close(linger=0)
        raise
    return f"tcp://{host or ip}:{port}"


class ExpressRoute:
    """The notebook's end of the express route, for one cluster's client."""

    def __init__(self, client, ip: str, seal, pipe_dir: str | None = None, host=None):
        import zmq

        self.client = client
        self._lock = threading.RLock()
        socket = client._context.socket(zmq.ROUTER)
        socket.linger = 0
        socket.router_mandatory = 1  # a request to an engine not connected fails at once
        self.url = listening(socket, ip, host)
        self._socket = socket
        self.ready: set[str] = set()  # engine uuids that said hello on it
        self.pending: dict[str, object] = {}  # msg_id -> its express Reply
        self.relay = None  # a RelayLink (cluster/relay.py) the engines join through, if any
        self.via_relay: set[str] = set()  # engine uuids joined through it
        self.records = Records.install(client)
        self.seal = seal
        self.pipes = RankPipes.make(pipe_dir)  # (None: the socket alone)
        # what a wait wakes for: the socket and the pipes' bell (a counted call's piped
        # replies are all in); while a call waits that is not counted, each piped reply too
        self._bell_poller, self._each_poller = zmq.Poller(), zmq.Poller()
        self._each_reply = False  # (a call not counted waits)
        for poller in (self._bell_poller, self._each_poller):
            poller.register(socket, zmq.POLLIN)
            if self.pipes is not None:
                poller.register(self.pipes.bell, zmq.POLLIN)
        if self.pipes is not None:
            self._each_poller.register(self.pipes.fd, zmq.POLLIN)

    @property
    def join_url(self) -> str:
        """Where an engine joining the route connects: the relay, or this socket."""
        return self.relay.back_url if self.relay is not None else self.url

    def send(self, base: str, engines: list[str], msg_ids: list[str], body: bytes, result):
        """Send the request ``body`` (its id, then the pickled call: the same bytes for
        every rank) to ``engines``; their replies finish ``result``'s (an ExpressResult's)
        children."""
        with self._lock:
            alone = not self.pending  # (the only call waiting: its piped replies count down)
            self.pending.update(zip(msg_ids, result._children))
            send, via = self._socket.send, self.via_relay
            if via.issuperset(engines):  # (every rank through the relay: no look at each)
                relayed, direct = engines, []
            else:
                relayed = [e for e in engines if e in via]
                direct = [(e, m) for e, m in zip(engines, msg_ids) if e not in via]
            sealed, piping = None, (self.pipes.to if self.pipes is not None else {})
            counted, piped = self._piped_request(body, direct, piping, alone)
            for engine, msg_id in direct:
                if engine in piping:
                    failed = self.pipes.send(engine, piped)
                    if failed is None:
                        continue
                    if counted:  # (its rank will not count down: done for it)
                        self.pipes.uncount()
                    how, why = failed
                    if how == "full":  # (this call fails; the rank is reached as before)
                        self._failed(msg_id, why, wrote=False)
                        continue
                    if how == "gone":
                        self._unreached(msg_id, engine, why)
                        continue
                sealed = sealed or self.seal.sealed(REQUEST, body)
                try:
                    send(engine.encode(), SNDMORE)
                    send(sealed)
                except Exception as exc:  # zmq: the engine is not connected (it died)
                    self._unreached(msg_id, engine, f"not reachable: {exc}")
            if relayed:  # one message for all of them
                sealed = sealed or self.seal.sealed(REQUEST, body)
                try:
                    self._socket.send_multipart(self.relay.request(base, relayed, sealed))
                except Exception as exc:  # the relay ended: its ranks rejoin directly
                    for engine in relayed:
                        self._unreached(f"{base}-{engine}", engine, f"relay gone: {exc}")

    def _piped_request(self, body: bytes, direct: list, piping: dict, alone: bool):
        """Whether the ranks reached by their pipes count their replies down, and the
        request's record for them (None: none is). Counted when this call is ``alone``:
        its last piped reply rings the pipes' bell, so a wait wakes once for them all, not
        for each few ranks that answered together. A call sent while another waits is not:
        each of its piped replies wakes a wait, until no call waits."""
        n = sum(1 for engine, _ in direct if engine in piping) if piping else 0
        if not n:
            return False, None
        counted = alone and self.pipes.count(n)
        self._each_reply = (self._each_reply and not alone) or not counted
        return counted, record((COUNTED if counted else REQUEST) + body)

    def pipes_for(self, engines: list[str]) -> str | None:
        """A request pipe for each engine about to join, their folder (None: they join the
        socket alone, as through the relay)."""
        with self._lock:
            if self.pipes is None or self.relay is not None or not self.pipes.offer(engines):
                return None
            return self.pipes.folder

    def piped(self, engines: list[str]) -> None:
        """The engines joined: their pipes that their ranks opened are held."""
        with self._lock:
            if self.pipes is not None:
                self.pipes.take(engines)

    def given_up(self, engines: list[str]) -> None:
        """The notebook no longer waits for one reply from each of ``engines`` (their ranks
        died, or the call was given up on): the relay, if any, stops waiting too."""
        with self._lock:
            if self.relay is not None:
                try:
                    self._socket.send_multipart(self.relay.given_up(engines))
                except Exception:  # the relay ended: the next call finds it so
                    pass

    def check(self) -> None:
        """Whether the relay still runs (:meth:`_relay_check`), before a call."""
        with self._lock:
            self._relay_check()

    def _unreached(self, msg_id: str, engine: str, why: str, wrote: bool = True) -> None:
        """A call that cannot reach ``engine``, failed; ``wrote``: its output may still come
        (False: the rank runs on, and its 'idle' is not waited for)."""
        self.ready.discard(engine)
        self.via_relay.discard(engine)
        if self.pipes is not None:
            self.pipes.drop(engine)
        self._failed(msg_id, why, wrote)

    def _failed(self, msg_id: str, why: str, wrote: bool) -> None:
        reply = self.pending.pop(msg_id, None)
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
        self.ready -= relayed
        for msg_id, reply in list(self.pending.items()):
            if reply.engine in relayed:
                self._unreached(msg_id, reply.engine, why, wrote=False)

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for something, then take all that has come
        (replies to any waiter, hellos)."""
        import zmq

        lock = self._lock
        if not (lock.acquire(timeout=timeout) if timeout > 0 else lock.acquire(False)):
            return
        try:
            sock = self._socket
            poller = self._each_poller if self._each_reply else self._bell_poller
            ready = dict(poller.poll(_whole_ms(timeout))) if sock is not None else {}
            pipes = self.pipes
            # the piped replies are read when the bell rang, when each wakes a wait, and
            # when nothing came (a counted call with a rank yet to answer, or dead)
            if pipes is not None and (not ready or pipes.bell in ready or pipes.fd in ready):
                if pipes.bell in ready:
                    pipes.rang()
                for engine, frames in pipes.replies():
                    first = frames[0]
                    if first[:1] == REPLY:  # (a rank's hello comes by the socket, sealed)
                        self._one(engine, REPLY, first[1:], frames[1:], False)
                self._each_reply = self._each_reply and bool(self.pending)
            if not ready:
                self._relay_check()  # (a relay's end is looked for while nothing comes)
                return
            if sock not in ready:
                return
            while True:
                try:
                    frames = received(sock)
                except zmq.Again:
                    return
                self._take(frames)
        finally:
            lock.release()

    def _take(self, frames: list) -> None:
        """One message: a rank's hello, or a reply, checked against the cluster's key
        (anything else is dropped)."""
        if len(frames) < 2:
            return
        sender = frames[0].bytes
        if self.relay is not None and sender == self.relay.ident:
            for engine, kind, body, extra in relay_entries(self.seal, frames[1:]):
                if kind is None:  # not reachable from the relay for request ``body``
                    self._unreached(f"{body}-{engine}", engine, "not reachable (relay)")
                else:
                    self._one(engine, kind, body, extra, True)
            return
        extra = [f.buffer for f in frames[2:]]
        opened = self.seal.opened(frames[1].buffer, extra)
        if opened is None or opened[0] not in (REPLY, HELLO):
            log.debug("an invalid message on the express route")
            return
        self._one(sender.decode(), *opened, extra, False)

    def _one(self, engine: str, kind: bytes, body, extra, relayed: bool) -> None:
        """One rank's hello or reply, its seal checked (here, or by the relay)."""
        if kind == HELLO:
            said = bytes(body).decode()
            self.ready.add(said)
            (self.via_relay.add if relayed else self.via_relay.discard)(said)
            return
        if kind != REPLY:
            return
        # the body: the request's id, a byte each (ok, wrote, how), any output, the value
        msg_id = f"{str(body[:32], 'ascii')}-{engine}"
        reply = self.pending.pop(msg_id, None)
        rest = _output_in_reply(self.records, msg_id, body)
        if reply is None:  # a call already given up on: what its rank wrote for it goes
            if body[34] == _FRAMES and body[32] == _OK:
                discard([rest, *extra])
            return
        value = [rest, *extra] if body[34] == _FRAMES else pickle.loads(rest)
        if body[32] == _OK:
            reply.finish(value, None, body[33] == _ONE)
        else:
            reply.finish(None, ExpressError(**value), body[33] == _ONE)

    def outstanding(self, engine: str) -> bool:
        """Whether an express call to this engine (uuid) waits for its reply."""
        return any(r.engine == engine for r in list(self.pending.values()))

    def close(self) -> None:
        """Before the client closes (its context would wait for an open socket)."""
        with self._lock:
            socket, self._socket = self._socket, None
            if socket is not None:
                socket.close(linger=0)
            pipes, self.pipes = self.pipes, None
            if pipes is not None:
                pipes.close()
            relay, self.relay = self.relay, None
            if relay is not None:
                relay.close()
