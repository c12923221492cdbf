"""The direct lane (cluster/lane.py, runtime/lane.py): cells and calls reach local ranks
over a socket of their own, not through the controller's queue, with the same output,
values and errors; a rank that dies with a call outstanding fails it; a message not signed
with the cluster's key is dropped; an engine that cannot join is served through the queue."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow

CELL = (
    "import sys\nprint('out', nd.rank)\nprint('err', nd.rank, file=sys.stderr)\n"
    "x = torch.ones(2) * (nd.rank + 1)\nif nd.rank == 1:\n    raise ValueError('on one')\nx"
)


def _completed(c) -> int:
    """How many requests the controller's queue has passed to the ranks' engines."""
    status = c.processes.client.queue_status()
    return sum(status[e]["completed"] for e in c.processes.engine_ids)


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


def test_messages_not_signed_with_the_clusters_key_are_dropped():
    """A process that connects to the lane and says hello, or sends a reply, under a key
    that is not the cluster's is ignored; the cluster goes on."""
    import zmq
    from jupyter_client.session import Session

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        lane = c.processes.lane
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = b"intruder"
        sock.connect(lane.url)
        try:
            forged = Session(key=b"not the cluster's key")
            forged.send(sock, "lane_hello", {"engine": "intruder"})
            forged.send(sock, "apply_reply", {"status": "ok"})
            sock.send_multipart([b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b"{}"])
            time.sleep(0.5)
            assert "intruder" not in lane.ready
            r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
            assert dict(r.values) == {0: 2.0, 1: 2.0}
        finally:
            sock.close()


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
