"""Attaching to a running ipyparallel cluster (ipcluster start ...): ranks made from
engines notebook_dist did not start, and left running when it lets go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
from conftest import pids_alive, rank_table, wait_until

from notebook_dist.errors import PreflightError
from notebook_dist.plan import master_address, rank_order

PROFILE = "ndattach"


# ---- rank order and MASTER_ADDR: pure functions ----------------------------------------


def _probe(machine, host, ip="10.0.0.1", launcher_rank=None):
    return {"machine": machine, "host": host, "ip": ip, "launcher_rank": launcher_rank}


def test_rank_order_follows_the_launcher_rank_when_every_engine_has_one():
    probes = {
        0: _probe("a", "a", launcher_rank=2),
        1: _probe("b", "b", launcher_rank=0),
        2: _probe("a", "a", launcher_rank=1),
    }
    assert rank_order(probes) == [1, 2, 0]


def test_rank_order_groups_hosts_by_their_first_engine():
    probes = {
        0: _probe("a", "a"),
        1: _probe("b", "b"),
        2: _probe("a", "a"),
        3: _probe("b", "b", launcher_rank=5),  # not every engine has one: ignored
    }
    assert rank_order(probes) == [0, 2, 1, 3]


def test_master_address_is_loopback_on_one_machine_and_rank_0s_address_across_hosts():
    one = [_probe("here", "vm"), _probe("here", "vm")]
    assert master_address(one, "here", loopback_only=True) == "127.0.0.1"
    two = [_probe("m1", "node1", ip="10.200.0.2"), _probe("m2", "node2", ip="10.200.0.3")]
    with pytest.raises(PreflightError) as info:
        master_address(two, "here", loopback_only=True)
    assert str(info.value).startswith(
        "the engines run on 2 hosts (node1, node2), so the ranks must meet over the network: "
        "add --network to let rank 0's rendezvous store and Gloo listen on 10.200.0.2"
    )
    assert master_address(two, "here", loopback_only=False) == "10.200.0.2"
    isolated = [_probe("m1", "node1", ip="127.0.0.1"), _probe("m2", "node2")]
    with pytest.raises(PreflightError, match="has no address off the machine"):
        master_address(isolated, "here", loopback_only=False)


# ---- a real ipcluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ipcluster():
    """``ipcluster start -n 2 --daemonize`` in the tests' IPYTHONDIR; stopped (by pid) after."""
    cluster_id = "t" + uuid.uuid4().hex[:8]
    cmd = [sys.executable, "-m", "ipyparallel.cluster"]
    subprocess.run(
        cmd + ["start", "--profile", PROFILE, "--cluster-id", cluster_id, "-n", "2", "--daemonize"],
        check=True,
        capture_output=True,
        timeout=120,
        # engines as a user's: ipykernel watches their file descriptors, except under pytest
        env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
    )
    import ipyparallel as ipp

    c = ipp.Client(profile=PROFILE, cluster_id=cluster_id, timeout=30)
    wait_until(lambda: len(c.ids) >= 2, 60)
    pids = c[:].apply_sync(os.getpid)
    c.close()
    yield cluster_id, pids
    subprocess.run(
        cmd + ["stop", "--profile", PROFILE, "--cluster-id", cluster_id],
        capture_output=True,
        timeout=60,
    )
    for pid in pids_alive(pids):
        os.kill(pid, signal.SIGKILL)


def test_attach_runs_ranks_and_leaves_the_engines_running(ipcluster, no_current, run):
    from notebook_dist import session

    cluster_id, pids = ipcluster
    out = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id}")
    assert out.error is None, out.output
    lines = rank_table(out.stdout)
    assert lines[0].split() == ["rank", "host", "pid", "device", "backend"]
    # engine order = rank order (pids were read in engine-id order, which need not be theirs)
    assert [int(ln.split()[2]) for ln in lines[1:]] == pids
    out = run(
        "%%distributed\nimport os\nt = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
        "(float(t), os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'])"
    )
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: (3.0, "0", "127.0.0.1"), 1: (3.0, "1", "127.0.0.1")}
    # its cells took the lane, not the ipcluster's queue
    processes = session.current().processes
    lane = processes.lane
    assert lane is not None and not lane.refused
    assert {processes.client._engines[e] for e in processes.engine_ids} <= lane.route.ready
    # the engine's streams became a rank's (runtime.outstream.adopt): a cell's os.write is
    # that cell's output (1 line in 9 came late or not at all with ipykernel's own thread)
    for i in range(15):
        out = run(f"%%distributed\nos.write(1, b'line {i}\\n')")
        said = sorted(ln for ln in out.stdout.splitlines() if ln.endswith(f"line {i}"))
        assert said == [f"[rank {r}] line {i}" for r in (0, 1)], out.output
    again = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id}")
    assert again.stdout.strip() == "notebook_dist: reusing the running cluster (2 ranks, gloo)."
    out = run("%dist_restart")
    assert str(out.error).startswith(
        "this cluster's engines were started outside notebook_dist (ipcluster)"
    )
    out = run("%dist_shutdown")
    assert out.stdout.strip() == (
        "notebook_dist: the ranks left their process group; the engines keep running (they are "
        f"not ours to stop: ipcluster stop --profile {PROFILE} --cluster-id {cluster_id})."
    )
    assert session.current() is None
    assert pids_alive(pids) == pids, "shutdown must not touch engines it did not start"
    import ipyparallel as ipp

    c = ipp.Client(profile=PROFILE, cluster_id=cluster_id, timeout=30)
    try:
        # not block=True: that also waits, without end, for the engines' iopub 'idle', which a
        # client that has just connected can miss on a busy machine (a zmq subscription made
        # late); the reply is enough here
        ar = c[:].execute(
            "import torch.distributed as dist\nok = dist.is_initialized()\n"
            "from notebook_dist.runtime import lane\nlane_open = len(lane._STREAM)"
        )
        ar.get(timeout=60)
        assert c[:].pull("ok", block=True) == [False, False]
        # and they let go of the notebook's lane, which closed
        assert c[:].pull("lane_open", block=True) == [0, 0]
    finally:
        c.close()
    out = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id} -n 1")  # again, fewer
    assert out.error is None, out.output
    assert dict(run("%%distributed\ndist.get_world_size()").result.result) == {0: 1}


def test_attach_errors_are_plain(ipcluster, no_current, run):
    cluster_id, _ = ipcluster
    out = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id} -n 3")
    assert str(out.error) == "-n 3 asked, but the cluster has 2 engines"
    out = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id} --port 1234")
    assert str(out.error) == "--port is for clusters %dist_init starts, not attached ones"
    out = run("%dist_init --network")
    assert str(out.error).startswith("--network is for ranks on other hosts")


def test_attach_to_nothing_says_how_to_start_one(no_current, run):
    out = run("%dist_init --profile nosuchprofile --cluster-id nope")
    assert type(out.error).__name__ == "UsageError"
    assert str(out.error).startswith("no running ipyparallel cluster: ")
    assert "profile_nosuchprofile/security/ipcontroller-nope-client.json does not exist" in str(
        out.error
    )
    assert str(out.error).endswith(
        "Start one first, e.g. ipcluster start --profile nosuchprofile --cluster-id nope -n 2 "
        "--daemonize"
    )


def test_after_every_attached_rank_died_nothing_is_signalled(
    ipcluster, no_current, run, signal_spy, bystanders
):
    """Last in this module: it ends the ipcluster's engines (the fixture stops the rest)."""
    from conftest import ALL_RANKS_EXIT

    cluster_id, pids = ipcluster
    out = run(f"%dist_init --profile {PROFILE} --cluster-id {cluster_id}")
    assert out.error is None, out.output
    out = run(ALL_RANKS_EXIT)
    assert type(out.error).__name__ == "ClusterError", out.output
    assert "Every rank of the cell has ended" in str(out.error), str(out.error)
    assert run("%dist_shutdown").error is None
    assert [c for c in signal_spy.calls if c[2] != 0] == [], "attach signals nothing"
    assert [p.poll() for p in bystanders] == [None, None]


def test_dist_init_again_after_an_attached_rank_ended_attaches_to_the_engines_there(
    ipcluster, no_current, run
):
    """After the test above ended the ipcluster's engines: the user's own engines (started
    here, ended by pid), one of which ends in a cell; the user starts another, and the same
    %dist_init attaches to the engines there now (it cannot restart engines it did not
    start, and once said to run it again after restarting them)."""
    import ipyparallel as ipp

    cluster_id, _ = ipcluster
    client = ipp.Client(profile=PROFILE, cluster_id=cluster_id, timeout=30)
    engine = [sys.executable, "-m", "ipyparallel.engine", "--profile", PROFILE]
    started = []

    def start_engine():
        before = len(client.ids)
        started.append(subprocess.Popen(engine + [f"--cluster-id={cluster_id}"]))
        wait_until(lambda: len(client.ids) > before, 60)

    try:
        wait_until(lambda: not client.ids, 60)  # the ipcluster's, ended above
        start_engine()
        start_engine()
        init = f"%dist_init --profile {PROFILE} --cluster-id {cluster_id}"
        assert run(init).error is None
        out = run("%%distributed\nimport os\nif nd.rank == 1:\n    os._exit(3)")
        assert type(out.error).__name__ == "ClusterError", out.output
        start_engine()
        wait_until(lambda: len(client.ids) == 2, 60)  # the ended one gone from the controller
        out = run(init)
        assert out.error is None, out.output
        assert out.stdout.startswith(
            "notebook_dist: rank 1 ended (its engine process is gone); attaching to the "
            "cluster's engines again (the ranks' variables are lost).\n"
        ), out.stdout
        pids = [int(ln.split()[2]) for ln in rank_table(out.stdout)[1:]]
        assert pids == [started[0].pid, started[2].pid]
        assert dict(run("%%distributed\nnd.rank").result.result) == {0: 0, 1: 1}
        assert run("%dist_shutdown").error is None
    finally:
        client.close()
        for p in started:
            p.terminate()
            p.wait(30)
