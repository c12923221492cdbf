"""What a cluster's start is made of, sped up: the controller is ipyparallel's own without
its fixed pause (runtime/controller.py), and the fork server's imports are frozen, so a
forked rank's garbage collections leave the pages it shares with the server alone."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import psutil
import pytest
from conftest import pids_alive, wait_until

pytestmark = pytest.mark.slow

OURS = "notebook_dist.runtime.controller"


def _connection_keys(module: str, profile: str) -> set[str]:
    """The keys of the file engines connect with, as a controller run as ``python -m
    module`` writes it; the controller is then ended."""
    import json

    security = os.path.join(profile, "security")
    for name in os.listdir(security) if os.path.isdir(security) else ():
        os.remove(os.path.join(security, name))
    engine_file = os.path.join(security, "ipcontroller-engine.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, f"--profile-dir={profile}", "--ip=127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: os.path.exists(engine_file), 60, every_s=0.01), module
        wait_until(lambda: _whole_json(engine_file), 10, every_s=0.01)
        with open(engine_file) as f:
            keys = set(json.load(f))
    finally:
        _end_session(proc)
    return keys


def _end_session(proc: subprocess.Popen) -> None:
    """The controller and the processes it forked (its heart monitor and schedulers, which
    outlive it when it is ended while it starts them), all in the session it leads: ended,
    and none left."""
    import signal

    def left() -> list[int]:
        return [p.pid for p in psutil.process_iter() if _in_session(p, proc.pid)]

    with contextlib.suppress(ProcessLookupError):  # (it may have ended on its own)
        os.killpg(proc.pid, signal.SIGTERM)
    if not wait_until(lambda: proc.poll() is not None and not left(), 5):
        with contextlib.suppress(ProcessLookupError):  # (all ended meanwhile)
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert wait_until(lambda: not left(), 10), left()


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


def _whole_json(path: str) -> bool:
    import json

    try:
        with open(path) as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


# initialises ipyparallel's controller (its hub, its schedulers' settings; nothing is
# started) with every sleep recorded rather than slept, and prints what was asked for
_SLEEPS = """
import json, sys, time
slept = []
time.sleep = slept.append
from ipyparallel.controller import app
if sys.argv[1] == "ours":
    from notebook_dist.runtime.controller import without_pause
    without_pause(app)
controller = app.IPController.instance()
controller.initialize([f"--profile-dir={sys.argv[2]}", "--ip=127.0.0.1"])
assert controller.db is not None  # init_hub ran to its end
print(json.dumps(slept))
"""


def _sleeps_while_initialising(which: str, profile: str) -> list[float]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _SLEEPS, which, profile],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_controller_is_ipyparallels_own_without_its_pause(tmp_path):
    # ipyparallel's hub pauses 0.25 s once its database is made; ours initialises the same
    # hub without it (0.35 s to the connection file against 0.6 s, measured here)
    assert 0.25 in _sleeps_while_initialising("theirs", str(tmp_path / "theirs"))
    assert _sleeps_while_initialising("ours", str(tmp_path / "ours")) == []
    # the same controller, started: engines are given the same connection information
    keys = {m: _connection_keys(m, str(tmp_path / m)) for m in (OURS, "ipyparallel.controller")}
    assert keys[OURS] == keys["ipyparallel.controller"]
    assert {"registration", "hb_ping", "key"} <= keys[OURS]


# ipyparallel's heart monitor over real sockets, its beats made by hand (its period is a
# minute): an engine's heart answers the first ping it gets, then no beat follows. Prints
# whether the hub heard of the new heart, and after how many beats.
_NEW_HEART = """
import asyncio, json, sys, zmq
from zmq.eventloop.zmqstream import ZMQStream
from ipyparallel.controller import heartmonitor
if sys.argv[1] == "ours":
    from notebook_dist.runtime.controller import new_hearts_at_once
    new_hearts_at_once(heartmonitor)

async def main():
    ctx = zmq.Context()
    ping, pong, hub = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    url = "tcp://127.0.0.1"
    ports = [s.bind_to_random_port(url) for s in (ping, pong, hub)]
    to_hub = ctx.socket(zmq.PUSH)  # (the hub's is a SUB, the monitor's an XPUB)
    to_hub.connect(f"{url}:{ports[2]}")
    monitor = heartmonitor.HeartMonitor(
        ping_stream=ZMQStream(ping), pong_stream=ZMQStream(pong),
        monitor_stream=ZMQStream(to_hub), period=60_000,
    )
    monitor.pong_stream.on_recv(monitor.handle_pong)  # as its start does, but no timer
    heart_in, heart_out = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    heart_in.subscribe(b"")
    heart_out.identity = b"an-engines-heart"
    heart_in.connect(f"{url}:{ports[0]}")
    heart_out.connect(f"{url}:{ports[1]}")
    beats = 0
    while not heart_in.poll(0):  # a ping sent before the heart subscribed is lost
        monitor.beat()
        beats += 1
        await asyncio.sleep(0.01)
    heart_out.send(heart_in.recv())  # the heart's answer, as ipyparallel's Heart echoes
    for _ in range(300):
        if hub.poll(0):
            break
        await asyncio.sleep(0.01)
    heard = hub.poll(0) and b"new_heart" in b"".join(hub.recv_multipart())
    print(json.dumps({"heard": bool(heard), "beats": beats}), flush=True)
    ctx.destroy(linger=0)

asyncio.run(main())
"""


def _heart_monitors(script: str) -> dict[str, dict]:
    """What ``script`` prints (its last line, JSON) run with our heart monitor and with
    ipyparallel's, each in a Python of its own."""
    import json

    results = {}
    for which in ("ours", "theirs"):
        out = subprocess.run(
            [sys.executable, "-c", script, which],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[which] = json.loads(out.stdout.splitlines()[-1])
    return results


def test_the_controller_registers_an_engine_when_its_heart_first_answers():
    results = _heart_monitors(_NEW_HEART)
    # ipyparallel's monitor tells the hub at its next beat (100 ms later in a cluster),
    # and none came; ours told it when the heart answered
    assert results["ours"]["heard"] is True and results["theirs"]["heard"] is False, results


_FIRST_PING = """
import json, sys, threading, time, zmq
from ipyparallel.controller import heartmonitor
if sys.argv[1] == "ours":
    from notebook_dist.runtime.controller import new_hearts_at_once, ping_new_hearts
    new_hearts_at_once(heartmonitor)
    ping_new_hearts(heartmonitor)
monitor_class = heartmonitor.HeartMonitor
start, where = monitor_class.start, {}

def start_and_say_where(self):  # (the monitor's thread) started: where it bound its sockets
    start(self)
    for name in ("ping", "pong"):
        where[name] = getattr(self, name + "_stream").socket.getsockopt(zmq.LAST_ENDPOINT)

monitor_class.start = start_and_say_where
ctx = zmq.Context()
hub = ctx.socket(zmq.SUB)  # the hub's end of the monitor's messages
hub.subscribe(b"")
hub_port = hub.bind_to_random_port("tcp://127.0.0.1")
any_port = "tcp://127.0.0.1:*"
threading.Thread(  # ipyparallel's own set-up, as the controller runs it, with a long beat
    target=heartmonitor.start_heartmonitor,
    args=(any_port, any_port, f"tcp://127.0.0.1:{hub_port}"),
    kwargs={"period": 60_000},
    daemon=True,
).start()
while len(where) < 2:  # the monitor starts once the hub has subscribed to it
    hub.poll(10)
heart_in, heart_out = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
heart_in.subscribe(b"")
heart_out.identity = b"an-engines-heart"
heart_in.connect(where["ping"].decode())
heart_out.connect(where["pong"].decode())
pinged = bool(heart_in.poll(3000))
heard = False
if pinged:
    heart_out.send(heart_in.recv())  # the heart's answer, as ipyparallel's Heart echoes
    heard = bool(hub.poll(10_000)) and b"new_heart" in b"".join(hub.recv_multipart())
print(json.dumps({"pinged": pinged, "heard": heard}), flush=True)
"""


def test_the_controller_pings_a_heart_when_it_connects():
    results = _heart_monitors(_FIRST_PING)
    # the monitor beats every 60 s here: ipyparallel's first ping would come then; ours
    # came when the heart subscribed, and its answer registered the engine at once
    assert results == {
        "ours": {"pinged": True, "heard": True},
        "theirs": {"pinged": False, "heard": False},
    }, results


def test_a_cluster_runs_that_controller_and_its_ranks_work():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        controller = c.processes.ipp.controller
        with open(f"/proc/{controller.process.pid}/cmdline", "rb") as f:
            assert OURS.encode() in f.read()
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        assert dict(r.values) == {0: 2.0, 1: 2.0}, r
        own = (
            "def own():\n"
            "    with open('/proc/self/smaps_rollup') as f:\n"
            "        fields = dict(l.split()[:2] for l in f if l.endswith('kB\\n'))\n"
            "    return (int(fields['Private_Clean:']) + int(fields['Private_Dirty:'])) / 1024\n"
        )
        r = c.run(
            own + "import gc\nbefore = own()\ngc.collect()\n"
            "(gc.isenabled(), gc.get_freeze_count(), own() - before)"
        )
        assert not r.errors, r.errors
        for rank, (enabled, frozen, grown_mib) in dict(r.values).items():
            # the server's imports (torch's included) are frozen, and collections still run
            assert enabled and frozen > 100_000, (rank, enabled, frozen)
            # a full collection that scanned them copied 33 MiB of shared pages, measured
            assert grown_mib < 10, (rank, grown_mib)
        pids = [rk.pid for rk in c.ranks] + [controller.process.pid]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


def test_rank_0s_store_is_up_before_the_others_connect_and_serves_them_when_they_do(
    monkeypatch,
):
    """torch's store waits for every rank to connect, polling their count every 10 ms
    (10-12 ms of each 2-rank group's start here, more at 16); the group's own rendezvous
    waits for each rank anyway. Rank 0's store is up with nobody connected, and serves a
    rank that connects afterwards."""
    from datetime import timedelta

    import torch.distributed as dist

    from notebook_dist.runtime import group

    port = group.open_rendezvous("127.0.0.1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    # a store that waited for the other rank would fail here after its 2 s
    store = group.rendezvous_store(0, 2, timeout_s=2.0)
    later = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    later.set("came", "afterwards")
    assert store.get("came") == b"afterwards"


def _ports_asked(monkeypatch) -> list[tuple]:
    """(the engine asked early, rank 0's engine) for each rendezvous port the start reads."""
    from notebook_dist.cluster import ranks

    seen: list[tuple] = []
    real = ranks.rendezvous_port

    def spy(processes, plan, asked=None):
        seen.append((asked[0] if asked else None, processes.engine_ids[0]))
        return real(processes, plan, asked)

    monkeypatch.setattr(ranks, "rendezvous_port", spy)
    return seen


ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)"
RENDEZVOUS_SOCKETS = "from notebook_dist.runtime import group\nlen(group._listening)"


def test_rank_0s_port_is_asked_for_as_its_engine_registers(monkeypatch):
    """The store's port comes from rank 0's engine while the other engines still start,
    not in a round trip of its own after they all have (6-9 ms of a start here)."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    seen = _ports_asked(monkeypatch)
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        assert seen == [(0, c.processes.engine_ids[0])]
        assert dict(c.run(ALL_REDUCE).values) == {0: 2.0, 1: 2.0}
        # the store took the socket: nothing is left open beside it
        assert dict(c.run(RENDEZVOUS_SOCKETS).values) == {0: 0, 1: 0}


def test_a_port_asked_of_an_engine_that_is_not_rank_0_is_closed_and_rank_0_asked(
    monkeypatch,
):
    """Should the first engine to register not be rank 0's, rank 0's engine is asked at
    once, and the other one's socket is closed: the group is made, nothing is left open."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster import processes
    from notebook_dist.config import DistConfig

    monkeypatch.setattr(processes, "FIRST_ENGINE_ID", 1)
    seen = _ports_asked(monkeypatch)
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        assert seen == [(1, c.processes.engine_ids[0])] and c.processes.engine_ids[0] != 1
        assert dict(c.run(ALL_REDUCE).values) == {0: 2.0, 1: 2.0}
        # (the close goes through the controller's queue, the cell by the direct route)
        assert wait_until(lambda: dict(c.run(RENDEZVOUS_SOCKETS).values) == {0: 0, 1: 0}, 10)
