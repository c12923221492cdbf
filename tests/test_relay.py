"""The relay (runtime/relay.py, cluster/relay.py): a local cluster's cells pass through one
process that sends each cell to every rank and brings their replies back as one message.
What a cell gives back must be the same as without it; a relay that ends must cost the
cell waiting on it a sentence, not the session; nothing it started may outlive the
cluster."""

from __future__ import annotations

import signal
import threading

import pytest
from conftest import pids_alive, wait_until

from notebook_dist import DistCluster
from notebook_dist.config import DistConfig
from notebook_dist.errors import ClusterError


@pytest.fixture(scope="module")
def relayed():
    cluster = DistCluster(n=3, config=DistConfig(relay_from=2, spare_engines=0)).start()
    relay = cluster.processes.lane.route.relay
    assert relay is not None, "the relay did not start"
    pids = [r.pid for r in cluster.ranks] + [relay.proc.pid]
    yield cluster
    cluster.shutdown()
    assert pids_alive(pids) == [], "a rank or the relay outlived the cluster"


def test_cells_values_output_and_errors_come_back_as_without_it(relayed):
    lane = relayed.processes.lane
    r = relayed.run("x = nd.rank * 10\nprint('hello from', nd.rank)\nx")
    assert dict(r.values) == {0: 0, 1: 10, 2: 20} and not r.errors
    assert lane.route.via_relay == {lane._uuid(e) for e in relayed.processes.engine_ids}
    # an error on one rank, the others' values kept
    r = relayed.run("if nd.rank == 1:\n    raise ValueError('only rank 1')\nnd.rank")
    assert set(r.errors) == {1} and "ValueError: only rank 1" in str(r.errors[1])
    assert r.values[0] == 0 and r.values[2] == 2
    # a tensor comes back as its frames, through the relay as they are
    r = relayed.run("torch.arange(100_000) + nd.rank")
    assert [int(v[-1]) for _, v in sorted(r.values.items())] == [99_999, 100_000, 100_001]
    # and the ranks still meet in collectives
    r = relayed.run("t = torch.ones(2) * (nd.rank + 1)\ndist.all_reduce(t)\nt.tolist()")
    assert dict(r.values) == {0: [6.0, 6.0], 1: [6.0, 6.0], 2: [6.0, 6.0]}


def test_messages_not_sealed_with_the_clusters_key_are_dropped_by_the_relay(relayed):
    import zmq

    relay = relayed.processes.lane.route.relay
    ctx = zmq.Context.instance()
    forger = ctx.socket(zmq.DEALER)
    forger.linger = 0
    forger.identity = b"intruder-engine"
    forger.connect(relay.back_url)
    try:
        forger.send_multipart([b"H" + b"\0" * 32 + b"intruder", b""])
        forger.send(b"R" + b"\0" * 32 + b"0" * 32 + b"o0p")
        r = relayed.run("nd.rank")
        assert dict(r.values) == {0: 0, 1: 1, 2: 2} and not r.errors
        assert "intruder" not in relayed.processes.lane.route.ready
    finally:
        forger.close()


def test_a_relay_killed_mid_cell_fails_that_cell_with_a_sentence_and_the_next_goes_direct(
    relayed, tmp_path
):
    from notebook_dist.signals import send

    lane = relayed.processes.lane
    relay = lane.route.relay
    done: list = []
    code = (
        f"import time\nopen(r'{tmp_path}/' + str(nd.rank), 'w').close()\ntime.sleep(1.5)\nnd.rank"
    )
    cell = threading.Thread(target=lambda: done.append(relayed.run(code)))
    cell.start()
    # every rank runs the cell (its request went through the relay) before the relay dies
    assert wait_until(lambda: len(list(tmp_path.iterdir())) == 3, 30)
    assert send(relay.record, signal.SIGKILL)
    cell.join(30)
    assert done, "the cell did not end after the relay was killed"
    said = " ".join(str(e) for e in done[0].errors.values())
    assert set(done[0].errors) == {0, 1, 2}, done[0]
    assert "the relay between the notebook and the ranks killed by signal 9" in said, said
    assert "The next call reaches the ranks directly." in said
    assert lane.route.relay is None and lane.route.via_relay == set()
    # the ranks kept their variables, and the next cell reaches them directly
    r = relayed.run("x")
    assert dict(r.values) == {0: 0, 1: 10, 2: 20} and not r.errors
    assert wait_until(lambda: pids_alive([relay.proc.pid]) == [], 5)


def test_a_relay_that_cannot_start_leaves_the_ranks_reached_directly(monkeypatch):
    import subprocess

    from notebook_dist.cluster import relay as relay_link

    started: list = []

    class Popen(subprocess.Popen):  # the relay's process, as the notebook starts it
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    monkeypatch.setattr(relay_link, "START_S", 0.0)  # it never says its address in time
    monkeypatch.setattr(relay_link, "Popen", Popen)
    cluster = DistCluster(n=2, config=DistConfig(relay_from=2, spare_engines=0)).start()
    try:
        assert cluster.processes.lane.route.relay is None
        assert dict(cluster.run("nd.rank").values) == {0: 0, 1: 1}
        assert len(started) == 1 and pids_alive(started) == [], "a relay that failed was left"
    finally:
        cluster.shutdown()


def test_a_batch_goes_once_every_rank_asked_answered_or_when_its_first_has_waited():
    from notebook_dist.runtime.lane import HELLO, REPLY
    from notebook_dist.runtime.relay import HOLD_S, Batch

    class Frame:
        buffer = b"R..."

    batch = Batch()
    assert batch.wait_ms(0.0) is None  # nothing held
    batch.asked(b"a")
    batch.asked(b"b")
    batch.add(b"a", REPLY, [Frame()], now=10.0)
    assert 0 < batch.wait_ms(10.0) <= HOLD_S * 1000 + 1  # b not in yet: a waits, a little
    assert batch.wait_ms(10.0 + HOLD_S) == 0  # but no longer than HOLD_S
    batch.add(b"b", REPLY, [Frame()], now=10.0005)
    assert batch.wait_ms(10.0005) == 0 and batch.awaited == {}  # every rank answered
    assert batch.index[::3] == [b"a", b"b"] and batch.data == [b"R...", b"R..."]
    # a rank's hello (it joins) is never held, and a reply nobody waits for is not counted
    other = Batch()
    other.asked(b"c")
    other.add(b"d", HELLO, [Frame()], now=5.0)
    assert other.wait_ms(5.0) == 0 and other.awaited == {b"c": 1}


def test_a_slow_rank_does_not_hold_back_the_others_replies(relayed):
    seen: list = []

    def on_update(view):
        seen.append({r: v.status for r, v in view.views.items()})

    r = relayed.run(
        "import time\nif nd.rank == 2:\n    time.sleep(1.5)\nnd.rank", on_update=on_update
    )
    assert dict(r.values) == {0: 0, 1: 1, 2: 2}
    # ranks 0 and 1 were seen done while rank 2 still slept: their batch did not wait for it
    assert any(s[0] == s[1] == "done" and s[2] == "running" for s in seen), seen


def test_a_cell_leaves_nothing_for_the_garbage_collector(relayed):
    """Every rank's record of a cell, and the cell's output streamer, go when the cell
    ends: none is in a reference cycle that only the collector would free (at 16 ranks
    such cycles made the collector run after every few cells)."""
    import gc

    relayed.run("pass")
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            relayed.run("print('x')\nnd.rank")
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith("notebook_dist")]
        ours += [o for o in gc.garbage if type(o).__name__ in ("InOrder", "LateRecord")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == [], sorted({type(o).__qualname__ for o in ours})


def test_the_relay_stops_waiting_for_a_rank_the_notebook_gave_up_on():
    """A rank that died owes the relay its reply: told so, the relay no longer holds every
    later batch for it."""
    import hashlib

    import zmq

    from notebook_dist.runtime import relay
    from notebook_dist.runtime.lane import Seal

    ctx = zmq.Context()
    notebook, front, back, rank = (
        ctx.socket(k) for k in (zmq.ROUTER, zmq.DEALER, zmq.ROUTER, zmq.DEALER)
    )
    try:
        for s in (notebook, front, back, rank):
            s.linger = 0
        back.router_mandatory = 1
        front.identity, rank.identity = b"relay", b"x"
        port = notebook.bind_to_random_port("tcp://127.0.0.1")
        front.connect(f"tcp://127.0.0.1:{port}")
        back_port = back.bind_to_random_port("tcp://127.0.0.1")
        rank.connect(f"tcp://127.0.0.1:{back_port}")
        rank.send(b"hello")  # (the relay's router knows it once it has spoken)
        assert back.poll(5000) and back.recv_multipart()[0] == b"x"
        seal = Seal(type("Session", (), {"key": b"k", "digest_mod": hashlib.sha256}))
        batch = relay.Batch()

        def delivered(*frames):
            notebook.send_multipart([b"relay", *frames])
            assert front.poll(5000)
            relay._requests(front, back, seal, batch)

        delivered(relay.FANOUT, b"base", b"x", b"request")
        assert rank.poll(5000) and rank.recv() == b"request"
        assert batch.awaited == {b"x": 1}
        delivered(relay.DROP, b"x y")  # (y: a rank it never asked, ignored)
        assert batch.awaited == {}
    finally:
        for s in (notebook, front, back, rank):
            s.close()
        ctx.term()


def test_a_call_whose_rank_died_tells_the_relay_to_stop_waiting_for_it(monkeypatch):
    from notebook_dist.cluster.route import ExpressRoute

    given_up: list = []
    original = ExpressRoute.given_up

    def spy(route, engines):  # (the real call, noted)
        given_up.append(list(engines))
        return original(route, engines)

    monkeypatch.setattr(ExpressRoute, "given_up", spy)
    cluster = DistCluster(n=2, config=DistConfig(relay_from=2, spare_engines=0)).start()
    try:
        lane = cluster.processes.lane
        engines = [dict.get(lane.client._engines, r.engine_id) for r in cluster.ranks]
        assert dict(cluster.run("nd.rank").values) == {0: 0, 1: 1}  # (the ranks joined it)
        assert lane.route.relay is not None and set(engines) <= lane.route.via_relay
        with pytest.raises(ClusterError, match="rank 1 was killed by SIGKILL"):
            cluster.run(
                "import os, signal\nif nd.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)"
            )
        assert given_up == [[engines[1]]]  # rank 0 answered; rank 1 never will
    finally:
        cluster.shutdown()
