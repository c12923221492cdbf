"""The relay: one process between the notebook and many local ranks on the express route
(``cluster/lane.py``), so that a cell costs the notebook one message each way, whatever
the number of ranks.

Without it the notebook sends a cell's request to each rank and reads each rank's reply,
and checks each reply's seal: its CPU per cell grows with the ranks (zmq's IO thread a
frame each way per rank, the main thread a read and a check per rank). Through the relay
the notebook sends the request once with the list of ranks, and reads the ranks' replies
as one message (:class:`Batch`: all of them, or those that came within
:data:`HOLD_S`), sealed once by the relay, which has checked each rank's own seal. The
replies themselves are as the ranks sent them.

It is started by the notebook (``python -m notebook_dist.runtime.relay``), reads what it
needs from its standard input as one JSON line (the cluster's key, the notebook's express
address, its own identity there), says its own address on its standard output, and ends
when its standard input closes (the notebook ended) or on SIGTERM. It imports zmq and
nothing of torch: it starts in about 0.1 s.

The messages:

- notebook to relay: ``[b"F", base, targets, request]``: the request (sealed by the
  notebook, checked by each rank) for each engine uuid in ``targets`` (space-separated);
  ``base`` is the request's id.
- notebook to relay: ``[b"D", targets]``: the notebook no longer waits for one reply from
  each engine in ``targets`` (its rank died during the call): batches are no longer held
  for it.
- relay to notebook: two frames, ``[sealed index, data]`` (kind :data:`BATCH`, the seal
  over both). The index is space-separated words, for each rank's message ``uuid n
  len_1 ... len_n``: its n frames as it sent them (its seal checked), one after another
  in ``data``; or ``uuid - base``: the rank could not be reached for request ``base``.
  Two frames whatever the number of ranks: the notebook reads and checks each frame of a
  message on its own, about 0.5 µs each.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from types import SimpleNamespace

from .lane import HELLO, REPLY, SNDMORE, Seal, received

#: the first byte of the relay's sealed frame to the notebook
BATCH = b"B"
#: the first frame of a request from the notebook
FANOUT = b"F"
#: the first frame of the notebook's word that it gave up on some ranks' replies
DROP = b"D"
#: an entry's count frame when its rank could not be reached
UNREACHED = b"-"
#: the most messages from ranks read in one wake-up
MAX_BATCH = 4096
#: how long a rank's message waits for the others' before its batch goes (seconds)
HOLD_S = 0.002


def _setup(line: str):
    """The sockets and the seal, from the notebook's JSON line."""
    import zmq

    spec = json.loads(line)
    session = SimpleNamespace(
        key=bytes.fromhex(spec["key"]), digest_mod=getattr(hashlib, spec["digest"])
    )
    ctx = zmq.Context()
    back = ctx.socket(zmq.ROUTER)
    back.linger = 0
    back.router_mandatory = 1  # a rank that is not connected: said to the notebook at once
    port = back.bind_to_random_port(f"tcp://{spec['ip']}")
    front = ctx.socket(zmq.DEALER)
    front.linger = 0
    front.identity = spec["identity"].encode()
    front.connect(spec["front"])
    return ctx, front, back, Seal(session), f"tcp://{spec['ip']}:{port}"


class Batch:
    """The ranks' messages held for the next batch to the notebook, and how many requests
    each rank has not answered yet.

    A batch goes when every rank asked has answered, or :data:`HOLD_S` after its first
    message came. On a machine with fewer cores than ranks the replies to one cell come
    one by one over a few milliseconds; sent as they come, each would wake the notebook
    (about 4 batches a cell at 16 ranks on 2 cores); held, the cell's replies come in one."""

    __slots__ = ("index", "data", "since", "awaited")

    def __init__(self):
        self.index: list[bytes] = []  # the batch's index, word by word
        self.data: list = []  # the frames it indexes
        self.since: float | None = None  # when its first message came (monotonic)
        self.awaited: dict[bytes, int] = {}  # engine uuid -> requests not answered

    def asked(self, engine: bytes) -> None:
        self.awaited[engine] = self.awaited.get(engine, 0) + 1

    def answered(self, engine: bytes) -> None:
        """One request fewer awaited from ``engine``: it replied, or the notebook gave up
        on its reply (a rank that died would otherwise hold every later batch)."""
        left = self.awaited.get(engine, 0) - 1
        if left > 0:
            self.awaited[engine] = left
        else:
            self.awaited.pop(engine, None)

    def add(self, engine: bytes, kind: bytes, parts: list, now: float) -> None:
        if kind == REPLY:
            self.answered(engine)
        elif kind == HELLO:  # (a rank that joins is not kept waiting)
            self.since = now - HOLD_S
        self.index += [engine, b"%d" % len(parts), *(b"%d" % len(f.buffer) for f in parts)]
        self.data += [f.buffer for f in parts]
        if self.since is None:
            self.since = now

    def wait_ms(self, now: float) -> int | None:
        """How long the relay may wait for more before this batch goes (None: nothing
        is held; 0: it goes now)."""
        if not self.index:
            return None
        if not self.awaited:
            return 0
        return max(0, math.ceil((self.since + HOLD_S - now) * 1000))

    def send(self, front, seal: Seal) -> None:
        send(front, seal, self.index, self.data)
        self.index, self.data, self.since = [], [], None


def send(front, seal: Seal, index: list[bytes], data: list) -> None:
    """One batch to the notebook: its index and its data, sealed."""
    body = b"".join(data)
    front.send_multipart([seal.sealed(BATCH, b" ".join(index), (body,)), body], copy=False)


def serve(stdin_fd: int, front, back, seal: Seal) -> None:
    """Pass requests out and replies in until the notebook goes."""
    import zmq

    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    poller.register(stdin_fd, zmq.POLLIN)
    batch = Batch()
    while True:
        events = dict(poller.poll(batch.wait_ms(time.monotonic())))
        if stdin_fd in events and not os.read(stdin_fd, 4096):
            return  # the notebook ended
        if front in events:
            _requests(front, back, seal, batch)
        if back in events:
            _replies(back, seal, batch)
        if batch.wait_ms(time.monotonic()) == 0:
            batch.send(front, seal)


def _requests(front, back, seal: Seal, batch: Batch) -> None:
    import zmq

    while True:
        try:
            frames = front.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) == 2 and frames[0] == DROP:
            for engine in frames[1].split():
                batch.answered(engine)
            continue
        if len(frames) != 4 or frames[0] != FANOUT:
            continue
        _, base, targets, request = frames
        lost: list[bytes] = []
        for engine in targets.split():
            try:  # (two plain sends: send_multipart's frame objects cost 3x their copy)
                back.send(engine, SNDMORE)
                back.send(request)
            except zmq.ZMQError:  # not connected (it ended): the notebook fails its call
                lost += [engine, UNREACHED, base]
                batch.awaited.pop(engine, None)  # (nothing more will come from it)
            else:
                batch.asked(engine)
        if lost:
            send(front, seal, lost, [])


def _replies(back, seal: Seal, batch: Batch) -> None:
    """Every message the ranks sent that is here now, each checked, into the batch."""
    import zmq

    now = time.monotonic()
    for _ in range(MAX_BATCH):
        try:
            frames = received(back)
        except zmq.Again:
            break
        if len(frames) < 2:
            continue
        parts = frames[1:]
        opened = seal.opened(parts[0].buffer, [f.buffer for f in parts[1:]])
        if opened is None or opened[0] not in (REPLY, HELLO):
            continue  # not signed with the cluster's key: dropped, as the notebook would
        batch.add(frames[0].bytes, opened[0], parts, now)


def main() -> None:
    line = sys.stdin.readline()
    ctx, front, back, seal, url = _setup(line)
    print(json.dumps({"back": url}), flush=True)
    try:
        serve(sys.stdin.fileno(), front, back, seal)
    finally:
        front.close(linger=0)
        back.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
