"""A cluster's controller: ipyparallel's own, with its own arguments, started sooner
(``python -m notebook_dist.runtime.controller``, the command ``cluster/processes.py``
gives ipyparallel's controller launcher).

With the fork server started ahead (``%load_ext``), the controller's start is most of what
``%dist_init`` waits for: about 0.6 s here, of which

- 0.3 s is importing ipyparallel, made here without the garbage collector (as the fork
  server imports; 0.03 s less), and
- 0.25 s is a fixed pause the hub takes once it has made its database
  (``time.sleep(0.25)`` in ``IPController.init_hub``, from when that database could be a
  server to connect to; the controller's is in memory). It is skipped: nothing else of
  the hub's start is changed, and a controller without that pause starts as before.

Each engine then registers once the controller's heart monitor has heard its heart; the
monitor pings every heart at its beat, and tells the hub of new hearts at the beat after, so
a new heart waited up to one heartbeat period (100 ms) for its first ping and one more for
its answer to count. Here the monitor pings a heart as soon as it connects, and tells the
hub as soon as a new heart answers. (The monitor is a process forked from the controller,
as multiprocessing starts processes on Linux up to Python 3.13; started otherwise, it runs
unchanged.)
"""

from __future__ import annotations

import time


class _NoPause:
    """The ``time`` module, but for ``sleep``: what the hub's start sees of it."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(_seconds: float) -> None:
        pass


def without_pause(app) -> None:
    """``app`` (``ipyparallel.controller.app``) with its controller's ``init_hub`` run
    without the pause: the hub sees :class:`_NoPause` as its ``time`` while it starts."""
    init_hub = app.IPController.init_hub

    def init_hub_without_pause(self):
        module_time, app.time = getattr(app, "time", time), _NoPause()
        try:
            return init_hub(self)
        finally:
            app.time = module_time

    app.IPController.init_hub = init_hub_without_pause


def new_hearts_at_once(heartmonitor) -> None:
    """``heartmonitor`` (``ipyparallel.controller.heartmonitor``) telling the hub of a new
    engine's heart as soon as it answers a ping, not at the next beat: the hub completes an
    engine's registration when it hears of its heart, so each engine registered one
    heartbeat period (100 ms) later than it could. A heart already known is announced by
    the beat as before; one that answers late is new at the next beat, as before."""
    monitor = heartmonitor.HeartMonitor
    handle_pong = monitor.handle_pong

    def handle_pong_at_once(self, msg):
        handle_pong(self, msg)
        heart = msg[0]
        if heart in self.responses and heart not in self.hearts:
            self.handle_new_hearts({heart})

    monitor.handle_pong = handle_pong_at_once


class _PingsToSubscribers:
    """The ``zmq`` module as the heart monitor's set-up sees it: its ping socket, asked
    for as a PUB, is an XPUB, which sends as a PUB does and also hears each subscription."""

    def __getattr__(self, name: str):
        import zmq

        return zmq.XPUB if name == "PUB" else getattr(zmq, name)


def ping_new_hearts(heartmonitor) -> None:
    """``heartmonitor`` pinging each heart as it subscribes, not at the next beat: an
    engine's heart otherwise waits up to one heartbeat period (100 ms) for its first ping.
    With :func:`new_hearts_at_once`, an engine registers one round trip after its heart
    connects. The pings at each beat, and how answers count, are unchanged."""
    import zmq

    heartmonitor.zmq = _PingsToSubscribers()
    monitor = heartmonitor.HeartMonitor
    start = monitor.start

    def start_pinging_subscribers(self):
        socket = self.ping_stream.socket
        if socket.type == zmq.XPUB:
            socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every heart's subscription, not the first

            def subscribed(msg):
                if msg and msg[0][:1] == b"\x01":  # (an unsubscription starts with 0)
                    self.ping_stream.send(str(self.lifetime).encode("ascii"))

            self.ping_stream.on_recv(subscribed)
        start(self)

    monitor.start = start_pinging_subscribers


def main() -> None:
    from .imports import frozen_after

    with frozen_after():
        from ipyparallel.controller import app, heartmonitor

    without_pause(app)
    # (the heart monitor is a process forked from this one, the class as patched here)
    new_hearts_at_once(heartmonitor)
    ping_new_hearts(heartmonitor)
    app.main()


if __name__ == "__main__":
    main()
