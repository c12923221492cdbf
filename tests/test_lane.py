"""The direct lane (cluster/lane.py, runtime/lane.py): cells and calls reach the ranks
over a socket of their own, not through the controller's queue, with the same output,
values and errors; a rank that dies with a call outstanding fails it; a message not signed
with the cluster's key is dropped; an engine that cannot join is served through the queue."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytestmark = pytest.mark.slow

CELL = (
    "import sys\nprint('out', nd.rank)\nprint('err', nd.rank, file=sys.stderr)\n"
    "x = torch.ones(2) * (nd.rank + 1)\nif nd.rank == 1:\n    raise ValueError('on one')\nx"
)


def _completed(c) -> int:
    """How many requests the controller's queue has passed to the ranks' engines, once
    the hub has booked every reply (its books lag the client's results a little: the
    start's join can still show as queued when the cluster is already up)."""
    deadline = time.monotonic() + 30
    while True:
        status = c.processes.client.queue_status()
        if all(status[e]["queue"] == 0 for e in c.processes.engine_ids):
            return sum(status[e]["completed"] for e in c.processes.engine_ids)
        assert time.monotonic() < deadline, f"the hub never booked its replies: {status}"
        time.sleep(0.02)


def _run(c):
    import io

    out, err = io.StringIO(), io.StringIO()
    r = c.run(CELL, out=out, err=err)
    return r, out.getvalue(), err.getvalue()


def test_cells_and_calls_take_the_lane_with_what_the_queue_gives():
    """The same cell on a cluster with the lane and one without: the same lines, values
    and error; the lane's requests never pass through the controller's queue."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    said = {}
    for lane in (True, False):
        with DistCluster(n=2, config=DistConfig(spare_engines=0, direct_lane=lane)) as c:
            assert (c.processes.lane is not None) is lane
            before = _completed(c)
            r, out, err = _run(c)
            assert dict(c.apply(int)) == {0: 0, 1: 0}
            through_queue = _completed(c) - before
            said[lane] = (
                sorted(out.splitlines()),
                sorted(err.splitlines()),
                r.values[0].tolist(),
                sorted(r.errors),
                r.errors[1].ename,
                "on one" in r.errors[1].evalue,
            )
            if lane:
                uuids = {c.processes.client._engines[e] for e in c.processes.engine_ids}
                assert uuids <= c.processes.lane.ready
                assert through_queue == 2  # the one call that asked both engines to join
            else:
                assert through_queue == 4  # the cell and the call, on each engine
    assert said[True] == said[False], said


def test_a_rank_that_dies_with_a_call_outstanding_fails_the_call():
    """A call the lane carried to a rank that then died fails (ipyparallel's EngineError,
    as through the queue) once the controller finds the engine gone, never hangs."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    made: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(
        "def slow_large(s):\n    import time, torch\n    time.sleep(s)\n"
        "    return b'z' * (1 << 20), torch.ones(1 << 19)\n"
        "def die_on_one():\n    import os\n    import notebook_dist as nd\n"
        "    if nd.rank == 1:\n        os._exit(3)\n    return nd.rank\n",
        made,
    )
    die_on_one = made["die_on_one"]

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        assert c.processes.lane.ready
        # (a call left hanging would end at its timeout, "not ready", and fail the match)
        with pytest.raises(ClusterError, match="died"):
            c.apply(die_on_one, timeout=60)


CALLS = (
    "def scaled(t, by=1):\n    import notebook_dist as nd\n    return t * by + nd.rank\n"
    "def fails():\n    import notebook_dist as nd\n    return 1 / nd.rank\n"
    "def echo(x):\n    return x\n"
    "secret = -1\n"
    "def reads_secret(add=0):\n    return secret + add\n"
    "def slow_large(s):\n    import time, torch\n    time.sleep(s)\n"
    "    return b'z' * (1 << 20), torch.ones(1 << 19)\n"
    "def die_on_one():\n    import os\n    import notebook_dist as nd\n"
    "    if nd.rank == 1:\n        os._exit(3)\n    return nd.rank\n"
)


def _counted(express, calls: list):
    """The lane's ``express``, noting each function it is asked to carry."""

    def counted(engine_ids, queue_view, func, *args):
        calls.append(func)
        return express(engine_ids, queue_view, func, *args)

    return counted


def test_calls_take_the_express_route_with_what_the_queue_gives():
    """apply, push and pull without a timeout take the express route, as cells do, and
    give what ipyparallel's queue gives: a function the notebook defined, which reads the
    rank's variables (not the notebook's), and its keyword arguments; tensors both ways (a
    large one through a file); a rank's error (said for the ranks it is the same on); more
    than a MiB each way through a file in shared memory. A call with a
    timeout, or one over a MiB without shared memory, takes ipyparallel's way (on the
    lane)."""
    import torch

    from notebook_dist import DistCluster, values
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    made: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(CALLS, made)
    big = torch.arange(400_000, dtype=torch.float32)  # 1.6 MB: through a file both ways
    said = {}
    for lane in (True, False):
        with DistCluster(n=2, config=DistConfig(spare_engines=0, direct_lane=lane)) as c:
            c.run("secret = 40 + nd.rank")  # (the ranks join the lane at the first call)
            before = _completed(c)
            express = []
            if lane:
                route = c.processes.lane
                route.express = _counted(route.express, express)
            # a function the notebook defined reads the rank's variables, as ipyparallel's
            # own calls give it (the notebook has a secret of its own: not sent)
            secrets = dict(c.apply(made["reads_secret"], add=made["reads_secret"]()))
            small = c.apply(made["scaled"], torch.ones(3), by=2)
            large = c.apply(made["scaled"], big, by=3)
            c.push({"pushed": big * 2, "note": "n"})
            pulled = c.pull(["pushed", "note"])
            with pytest.raises(ClusterError, match="ZeroDivisionError: division by zero"):
                c.apply(made["fails"])
            said[lane] = (
                secrets,
                {r: v.tolist() for r, v in small.items()},
                {r: float(v.double().sum()) for r, v in large.items()},
                {r: float(v.double().sum()) for r, v in pulled["pushed"].items()},
                dict(pulled["note"]),
            )
            if not lane:
                continue
            assert len(express) == 6 and _completed(c) == before
            with pytest.raises(ClusterError, match="on the ranks: rank 0: ZeroDivisionError"):
                c.apply(made["fails"])
            assert dict(c.apply(int, timeout=30)) == {0: 0, 1: 0}
            assert len(express) == 7
            # over a MiB each way: through files in shared memory, removed once read
            blob = b"x" * values.SHM_MIN_BYTES
            assert dict(c.apply(len, blob)) == {0: len(blob), 1: len(blob)}
            assert dict(c.apply(made["echo"], blob)) == {0: blob, 1: blob}
            assert len(express) == 9 and not os.listdir(c.shm_dir)
            shm_dir, c.shm_dir = c.shm_dir, None  # (no shared memory: ipyparallel's way)
            try:
                assert dict(c.apply(len, blob)) == {0: len(blob), 1: len(blob)}
            finally:
                c.shm_dir = shm_dir
            assert len(express) == 9
            # a cell's reply and a pull of a MiB or more (not tensors: those go as files
            # of their own) come through a file as well, read once and removed
            filed, frames_from = [], values.frames_from

            def counted(f, consume=True, filed=filed, frames_from=frames_from):
                filed.append(f[0] == values.FRAMES_FILE)
                return frames_from(f, consume)

            values.frames_from = counted
            try:
                got = c.run("blob = b'y' * (1 << 20) * (nd.rank + 1)", gather=["blob"])
                pulled_blob = c.pull("blob")["blob"]
            finally:
                values.frames_from = frames_from
            assert {r: len(b) for r, b in got.gathered["blob"].items()} == {0: 1 << 20, 1: 2 << 20}
            assert dict(pulled_blob) == dict(got.gathered["blob"])
            assert filed.count(True) == 4 and not os.listdir(c.shm_dir)
            assert not route.route.pending
    assert said[True] == said[False]
    assert said[True][:2] == ({0: 39, 1: 40}, {0: [2.0, 2.0, 2.0], 1: [3.0, 3.0, 3.0]})


def test_the_files_of_a_reply_nobody_waits_for_are_removed_when_it_comes():
    """A call given up on (Ctrl-C in the notebook) whose ranks then return a MiB or more
    leaves nothing in shared memory: its late replies' files, and their tensors', are
    removed as they come."""
    import _thread
    import threading

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    made: dict = {"__name__": "__main__"}
    exec(CALLS, made)
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        got = dict(c.apply(made["slow_large"], 0))  # (read: nothing left behind)
        assert [len(got[r][0]) for r in (0, 1)] == [1 << 20] * 2 and not os.listdir(c.shm_dir)
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            c.apply(made["slow_large"], 2)
        timer.join()
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}  # (after the late replies)
        assert not c.processes.lane.route.pending
        assert not os.listdir(c.shm_dir)


def test_a_rank_that_dies_in_an_express_call_fails_it_naming_the_rank():
    """A call without a timeout (the express route) to a rank that then dies fails with
    how the rank ended, never hangs; the other rank's cells go on."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    made: dict = {"__name__": "__main__"}
    exec(CALLS, made)
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        with pytest.raises(
            ClusterError, match="die_on_one on the ranks: rank 1 exited with code 3"
        ):
            c.apply(made["die_on_one"])
        assert not c.processes.lane.route.pending
        assert dict(c.run("nd.rank", ranks=[0]).values) == {0: 0}


def test_messages_not_signed_with_the_clusters_key_are_dropped():
    """A process that connects to the lane and says hello, or sends a reply, under a key
    that is not the cluster's is ignored, on either route; the cluster goes on."""
    import pickle

    import zmq
    from jupyter_client.session import Session

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.runtime.lane import HELLO, REPLY, Seal

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        lane = c.processes.lane
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = b"intruder"
        sock.connect(lane.url)
        xsock = zmq.Context.instance().socket(zmq.DEALER)
        xsock.linger = 0
        xsock.identity = b"intruder"
        try:
            forged = Session(key=b"not the cluster's key")
            forged.send(sock, "lane_hello", {"engine": "intruder"})
            forged.send(sock, "apply_reply", {"status": "ok"})
            sock.send_multipart([b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b"{}"])
            # and on the express route: a hello, and a reply to a call in flight
            xsock.connect(lane.route.url)
            xsock.send(Seal(forged).sealed(HELLO, b"intruder"))
            time.sleep(0.5)
            base = next(iter(lane.route.pending), "0" * 32)[:32].encode()
            xsock.send(Seal(forged).sealed(REPLY, base + b"o0p" + pickle.dumps({0: "forged"})))
            time.sleep(0.5)
            assert "intruder" not in lane.ready
            r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
            assert dict(r.values) == {0: 2.0, 1: 2.0}
            assert "intruder" not in lane.route.ready
        finally:
            sock.close()
            xsock.close()


def test_an_engine_that_cannot_join_the_lane_is_served_through_the_queue():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        lane = c.processes.lane
        lane.url = "tcp://127.0.0.1:9"  # nothing listens there: no hello comes
        lane.HELLO_S = 1.0
        before = _completed(c)
        r = c.run("nd.rank")
        assert dict(r.values) == {0: 0, 1: 1}
        assert set(lane.refused) == set(c.processes.engine_ids)
        assert _completed(c) - before == 4  # the attempt to join, then the cell, on each
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        assert _completed(c) - before == 6


def test_a_cell_takes_the_express_route_and_its_output_is_whole(tmp_path):
    """Cells go by the express route (nothing through the controller's queue, nothing left
    pending or in the client's records afterwards); a rank's output, on both streams, is
    all in when the cell ends, and a cell that wrote nothing still returns every rank's
    value."""
    import io
    import os

    from conftest import wait_until

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane, client = c.processes.lane, c.processes.client
        before, records = _completed(c), set(client.metadata)
        cell = (
            "import sys\nfor i in range(300):\n    print('line', i, nd.rank)\n"
            "print('last', nd.rank, file=sys.stderr)\nnd.rank"
        )
        for _ in range(5):
            out, err = io.StringIO(), io.StringIO()
            r = c.run(cell, out=out, err=err)
            lines = out.getvalue().splitlines()
            for rank in (0, 1):
                assert [x for x in lines if x.endswith(f"line 299 {rank}")], lines[-5:]
                assert sum(f"line {i} {rank}" in x for x in lines for i in (0, 150, 299)) == 3
            assert len(lines) == 600
            assert sorted(err.getvalue().splitlines()) == ["[rank 0] last 0", "[rank 1] last 1"]
            assert dict(r.values) == {0: 0, 1: 1}
            assert dict(c.run("nd.rank * 10").values) == {0: 0, 1: 10}
        assert _completed(c) - before == 0  # not one request through the queue
        assert not lane.route.pending
        assert set(client.metadata) <= records  # each cell's records were dropped
        # output that comes after its cell is over (a thread's, written while no cell
        # runs: parented on the cell that was current) does not bring the record back,
        # and goes to the streams of the cell that ran, as that rank's lines
        go, said, late = tmp_path / "go", tmp_path / "said", io.StringIO()
        c.run(
            "import os, sys, threading, time\n"
            "def late():\n"
            f"    while not os.path.exists({str(go)!r}):\n"
            "        time.sleep(0.01)\n"
            "    print('late', nd.rank, flush=True)\n"
            f"    open({str(said)!r} + str(nd.rank), 'w').close()\n"
            "threading.Thread(target=late).start()",
            out=late,
        )
        assert late.getvalue() == ""
        go.touch()
        assert wait_until(lambda: all(os.path.exists(f"{said}{r}") for r in (0, 1)), 30)
        out = io.StringIO()
        c.run("print('next')", out=out)  # its 'idle' comes after the late line
        assert sorted(out.getvalue().splitlines()) == ["[rank 0] next", "[rank 1] next"]
        assert sorted(late.getvalue().splitlines()) == ["[rank 0] late 0", "[rank 1] late 1"]
        assert set(client.metadata) <= records


def test_a_cells_output_comes_in_its_reply_when_it_can_and_as_messages_when_not():
    """What a cell printed on one stream, sent as nothing else was, comes in the rank's
    reply (the notebook waits for no message after it: a cell that prints a line took 5x
    the time of an empty one on 2 cores); output on both streams, a display, or more than
    the reply carries goes as ipykernel's messages. Either way it is whole and in order."""
    import io

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.runtime.streams import IN_REPLY_MOST

    def run(cell):
        out, err = io.StringIO(), io.StringIO()
        r = c.run(cell, out=out, err=err, raw_output=True)
        assert not r.errors, r.errors
        waited = [reply.wrote for reply in c.last_watch.ar._children]
        return out.getvalue(), err.getvalue(), waited

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        out, err, waited = run("for i in range(3):\n    print('line', i, nd.rank)")
        assert waited == [False, False]  # in the reply: nothing to wait for
        for rank in (0, 1):
            mine = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] ")]
            assert mine == [f"[rank {rank}] line {i} {rank}" for i in range(3)], out
        out, err, waited = run("import sys\nprint('é ☃ 𝄞', nd.rank, file=sys.stderr)")
        assert (out, sorted(err.splitlines()), waited) == (
            "",
            ["[rank 0] é ☃ 𝄞 0", "[rank 1] é ☃ 𝄞 1"],
            [False, False],
        )
        both = "import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')"
        out, err, waited = run(both)
        assert waited == [True, True]  # two streams: their messages keep the order
        assert sorted(out.splitlines()) == ["[rank 0] a", "[rank 0] c", "[rank 1] a", "[rank 1] c"]
        assert sorted(err.splitlines()) == ["[rank 0] b", "[rank 1] b"]
        big = f"print('x' * {IN_REPLY_MOST})"
        out, err, waited = run(big)
        assert waited == [True, True] and out.count("x" * IN_REPLY_MOST) == 2
        out, err, waited = run("from IPython.display import display\nprint('p')\ndisplay('d')")
        assert waited == [True, True] and "[rank 0] p" in out and "[rank 1] p" in out, out
        out, err, waited = run("x = 1")
        assert (out, err, waited) == ("", "", [False, False])


def test_a_stream_of_an_ipykernel_without_a_buffer_per_parent_gives_nothing_to_the_reply():
    """ipykernel before 7 keeps one buffer for every parent: the rank's stream says it may
    hold text and takes none, so the output goes as that ipykernel sends it."""
    from notebook_dist.runtime.outstream import RankOutStream

    older = RankOutStream.__new__(RankOutStream)  # (no buffers, as an older ipykernel)
    older.echo = None
    assert older.holding() is True and older.take(1 << 16) is None


def test_an_express_request_not_signed_with_the_clusters_key_is_not_run(tmp_path):
    """The rank runs an express request only under the cluster's key: the same request,
    signed with another key, does nothing (and signed right, it runs)."""
    import os
    import pickle

    from jupyter_client.session import Session

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.runtime.lane import REQUEST, Seal

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane = c.processes.lane
        engine = lane._uuid(c.processes.engine_ids[0])
        session = c.processes.client.session

        def request(path, signer):
            call = pickle.dumps((session.session, session.username, os.makedirs, (str(path),)))
            with lane.route._lock:
                lane.route._socket.send_multipart(
                    [engine.encode(), Seal(signer).sealed(REQUEST, b"f" * 32 + call)]
                )

        request(tmp_path / "forged", Session(key=b"not the cluster's key"))
        request(tmp_path / "signed", session)
        deadline = time.monotonic() + 30
        while not (tmp_path / "signed").exists() and time.monotonic() < deadline:
            lane.route.pump(0.05)
        assert (tmp_path / "signed").is_dir()
        assert not (tmp_path / "forged").exists()
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}


def test_express_requests_that_queue_up_are_each_served_once_in_order(tmp_path):
    """Requests that reach a rank while it runs another (the socket's descriptor signals
    once for them all) are each run once, in the order sent, and answered: 20 nested
    folders, each one's parent made by the request before it, asked for while the rank
    sleeps."""
    import os
    import time as _time

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane, ids = c.processes.lane, c.processes.engine_ids
        view = c.processes.view
        busy = lane.express(ids, view, _time.sleep, 0.5)
        paths = [str(tmp_path.joinpath(*map(str, range(i + 1)))) for i in range(20)]
        calls = [lane.express(ids[:1], view, os.mkdir, path) for path in paths]
        for call in [busy, *calls]:
            assert call is not None and call.wait(30)
        assert [call._children[0].result() for call in calls] == [None] * 20
        assert os.path.isdir(paths[-1])
        assert not lane.route.pending
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}


LANE_CONNECTIONS = """
def lane_connections():
    from notebook_dist.runtime import recover
    from notebook_dist.runtime.state import STATE

    ports = STATE.extras.get("lane_ports", set())
    tcp, fds = recover._tcp_table(), recover._socket_inodes()
    to_lane = {fd for inode, fd in fds.items() if inode in tcp and tcp[inode][1] in ports}
    return {"to_lane": len(to_lane), "released": len(to_lane & set(recover.gloo_socket_fds()))}
"""


CONTROLLER_CONNECTION = """
def controller_connection():
    import os
    import socket

    from ipyparallel.engine.app import IPEngine
    from notebook_dist.runtime import recover

    port = IPEngine.instance().connection_info["registration"]
    s = socket.create_connection(("127.0.0.1", port))  # (made after the group, as zmq would)
    seen = {}
    try:  # by each rule: the groups' sockets, and (Gloo connecting lazily) all made since
        for lazily in ("0", "1"):
            os.environ["TORCH_GLOO_LAZY_INIT"] = lazily
            released = set(recover.gloo_socket_fds())
            seen[lazily] = {"controller": s.fileno() in released, "gloo": len(released)}
        return seen
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT")
        s.close()
"""


def test_a_release_leaves_the_engines_channels_to_the_controller_alone():
    """A connection to the controller made after the group (zmq connecting a channel
    again) is never taken for Gloo's, which a release shuts down, by either rule (the
    groups' sockets; all made since the group, when Gloo connects lazily); Gloo's are."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    made: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(CONTROLLER_CONNECTION, made)
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        seen = dict(c.apply(made["controller_connection"]))
        rules = [rule for rank in seen.values() for rule in rank.values()]
        assert len(rules) == 4 and all(not v["controller"] and v["gloo"] > 0 for v in rules), seen
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}


def test_a_sockets_remote_address_is_read_as_proc_writes_it():
    """The table of TCP sockets a release reads (/proc/net/tcp and tcp6) gives each
    socket's remote address as an IP, an IPv4 one mapped into IPv6 as IPv4: the
    controller's channels are told from a Gloo peer by address and port."""
    import socket

    from notebook_dist.runtime import recover

    def remote_of(family, host):
        server = socket.create_server((host, 0), family=family)
        client = socket.create_connection(server.getsockname()[:2])
        try:
            inode = os.fstat(client.fileno()).st_ino
            table = recover._tcp_table()
            assert table[inode][1] == server.getsockname()[1]
            return recover._address(table[inode][3])
        finally:
            client.close()
            server.close()

    assert remote_of(socket.AF_INET, "127.0.0.1") == "127.0.0.1"
    if socket.has_ipv6:
        try:
            assert remote_of(socket.AF_INET6, "::1") == "::1"
        except OSError:  # (no IPv6 loopback here)
            pass
    # an IPv4 address mapped into IPv6, as tcp6 writes it on this machine
    mapped = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])
    words = (
        mapped
        if sys.byteorder == "big"
        else b"".join(mapped[i : i + 4][::-1] for i in range(0, 16, 4))
    )
    assert recover._address(words.hex().upper()) == "127.0.0.1"


def test_a_release_leaves_the_lane_alone():
    """A release shuts down the rank's Gloo connections, never its connections to the lane
    (made after the group, so not among the sockets it had before): the cell after a
    release goes by the lane at once."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    made: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(LANE_CONNECTIONS, made)  # on a rank: its connections to the lane, and how many of
    # them a release would shut down
    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        seen = dict(c.apply(made["lane_connections"]))
        assert all(v["to_lane"] == 2 and v["released"] == 0 for v in seen.values()), seen
        r = c.run("t = torch.ones(1)\nif nd.rank == 1:\n    raise ValueError\ndist.all_reduce(t)")
        assert r.released == [0] and set(r.errors) == {1}
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        uuids = {c.processes.client._engines[e] for e in c.processes.engine_ids}
        assert uuids <= c.processes.lane.route.ready  # (an engine not reached leaves it)
        assert dict(c.apply(made["lane_connections"])) == seen


def test_a_replys_final_snapshot_leaves_out_only_its_empty_entries():
    from notebook_dist.runtime.agent import OFTEN_EMPTY, snapshot, sparse

    snap = snapshot(with_stack=False)
    snap.update(rank=0, collectives_done=0, wait_s=0.0, history=[{"op": "all_reduce"}])
    snap.update(metrics={}, stack=[], asking=None)
    kept = sparse(snap)
    # numbers stay, even when 0 (rank 0 is a rank); what happened stays
    assert kept["rank"] == 0 and kept["collectives_done"] == 0 and kept["wait_s"] == 0.0
    assert kept["history"] == [{"op": "all_reduce"}]
    # the empty ones go; each is read with .get(...) or its empty value in the notebook
    assert not {"metrics", "stack", "asking"} & set(kept)
    assert set(snap) - set(kept) <= OFTEN_EMPTY


MARK = "def mark(path):\n    import notebook_dist as nd\n    with open(path, 'a') as f:\n        f.write(str(nd.rank))\n"


def test_a_request_given_up_on_never_runs_on_a_rank_still_busy(live, tmp_path):
    """A wait with a bound (the start's probes, the lane's join, the clocks' reading:
    ``engines.answered``; ``apply(timeout=...)``) gives up on a rank busy with an earlier
    request and says which; its request is then dropped from the rank's queue, not run
    there seconds later, after the notebook moved on."""
    from notebook_dist.cluster import engines
    from notebook_dist.errors import ClusterError

    made: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(MARK, made)
    marks = tmp_path / "marks"
    p = live.processes
    busy = p.rank_view([1]).apply_async(time.sleep, 6)  # rank 1's engine, busy for 6 s
    silent = p.engine_ids[1]
    with pytest.raises(ClusterError, match=r"did not answer the mark within 1\.5 s") as info:
        engines.answered(p.rank_view([0, 1]), made["mark"], str(marks), within=1.5, what="the mark")
    assert str(silent) in str(info.value).split(" did not")[0], str(info.value)
    with pytest.raises(ClusterError, match="could not run mark on the ranks"):
        live.apply(made["mark"], str(marks), timeout=1.5)
    assert not busy.ready(), "rank 1 was not busy for the whole test: it proves nothing"
    busy.get(timeout=60)
    assert p.rank_view([1]).apply_async(int).get(timeout=60) == [0]  # (its queue is through)
    assert "1" not in marks.read_text(), "rank 1 ran a request given up on"


def test_a_cell_that_waits_wakes_the_notebook_once_a_look_not_in_a_loop(live, monkeypatch):
    """While a cell's ranks work, the notebook waits on the route in 50 ms looks; a look's
    last fraction of a millisecond, rounded down to a wait of 0, made it spin about 36
    times a look (2,169 wake-ups in a 3 s cell, 1.8% of a core for nothing). Counted here:
    the route's wake-ups over a cell that sleeps 1 s."""
    from notebook_dist.cluster.route import ExpressRoute

    woke = [0]
    pump = ExpressRoute.pump

    def counted(self, timeout):
        woke[0] += 1
        return pump(self, timeout)

    monkeypatch.setattr(ExpressRoute, "pump", counted)
    started = time.monotonic()
    live.run("import time\ntime.sleep(1.0)").raise_for_errors()
    looks = (time.monotonic() - started) / 0.05
    assert woke[0] <= 2 * looks + 10, (woke[0], looks)


def test_the_lane_listens_where_the_controller_listens_for_its_engines(tmp_path):
    """With ranks on other hosts the lane listens where the controller does (its engine
    connection file): on its one address, or on every interface, reached at the
    controller's location; a file written late is waited for, one that never comes says
    so (the cluster then goes without a lane). The network itself: test_multihost.py."""
    import json
    import threading

    from notebook_dist.cluster.engines import connection_file, engines_address

    def at(cluster_id: str) -> str:
        return connection_file(None, str(tmp_path), cluster_id, "engine")

    def write(cluster_id: str, interface: str, delay: float = 0.0) -> None:
        path = at(cluster_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        time.sleep(delay)
        with open(path, "w") as f:
            json.dump({"interface": interface, "location": "node0.example", "key": "k"}, f)

    write("a", "tcp://10.1.2.3")
    assert engines_address(at("a")) == ("10.1.2.3", "10.1.2.3")
    write("b", "tcp://*")
    assert engines_address(at("b")) == ("*", "node0.example")
    late = threading.Thread(target=write, args=("c", "tcp://0.0.0.0", 0.3))
    late.start()
    try:
        assert engines_address(at("c"), wait_s=10) == ("0.0.0.0", "node0.example")
    finally:
        late.join()
    with pytest.raises(OSError, match="no engine connection file"):
        engines_address(at("never"), wait_s=0.2)
