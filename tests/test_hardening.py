"""Hardening: huge outputs are capped (with the full log kept), nothing listens off loopback."""

from __future__ import annotations

import io
import os
import stat

import psutil


def test_a_hundred_thousand_lines_are_capped_with_the_full_log_kept(live):
    out = io.StringIO()
    r = live.run(
        "if nd.rank == 1:\n    for i in range(100_000):\n        print('line', i)\nprint('done')",
        out=out,
    )
    assert not r.errors
    lines = out.getvalue().splitlines()
    rank1 = [ln for ln in lines if ln.startswith("[rank 1] line ")]
    assert len(rank1) == 2000 and rank1[-1] == "[rank 1] line 1999"
    note = next(ln for ln in lines if "output capped" in ln)
    assert note.startswith("[rank 1] ... output capped: 98,001 more lines of stdout not shown")
    path = note.rsplit(" are in ", 1)[1]
    with open(path) as f:
        logged = f.read().splitlines()
    assert logged[0] == "line 0" and logged[99_999] == "line 99999" and logged[-1] == "done"
    assert "[rank 0] done" in lines  # the other rank is untouched
    os.unlink(path)


def test_one_enormous_line_is_not_shown(live):
    out = io.StringIO()
    r = live.run(
        "import sys\nif nd.rank == 0:\n    sys.stdout.write('x' * 100_000_000 + '\\n')\nprint('after')",
        out=out,
    )
    assert not r.errors
    text = out.getvalue()
    assert len(text) < 100_000, "the 100 MB line reached the notebook"
    note = next(ln for ln in text.splitlines() if "output capped" in ln)
    path = note.rsplit(" are in ", 1)[1]
    assert os.path.getsize(path) >= 100_000_000
    os.unlink(path)


def _ours(cluster) -> list[psutil.Process]:
    pids = [r.pid for r in cluster.ranks] + [
        cluster._cluster.controller.pid,
        cluster._reaper.proc.pid,
    ]
    return [psutil.Process(p) for p in pids]


def test_everything_listens_on_loopback_only(live):
    live.run(
        "t = torch.ones(1)\ndist.all_reduce(t)"
    ).raise_for_errors()  # Gloo pairs and the store are up
    listening = []
    for proc in _ours(live):
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append((proc.pid, conn.laddr.ip, conn.laddr.port))
    assert listening, "expected the controller and the rendezvous store to listen"
    exposed = [x for x in listening if x[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_connection_files_are_private(live):
    security = os.path.join(live._profile_dir, "security")
    files = [os.path.join(security, f) for f in os.listdir(security) if f.endswith(".json")]
    assert files
    assert stat.S_IMODE(os.stat(live._profile_dir).st_mode) == 0o700  # nobody else can even look
    with_key = [p for p in files if '"key"' in open(p).read()]
    assert len(with_key) == 2  # the client's and the engines' connection files
    for path in with_key:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path} holds the HMAC key and is {oct(mode)}"
    import json

    client_file = next(p for p in files if p.endswith("-client.json"))
    info = json.load(open(client_file))
    assert (
        len(info["key"]) >= 32 and info["signature_scheme"] == "hmac-sha256"
    )  # messages stay signed


def test_sys_exit_on_a_rank_is_an_error_not_a_dead_engine(live):
    r = live.run("import sys\nif nd.rank == 1:\n    sys.exit(3)\n'still here'")
    assert list(r.errors) == [1] and r.errors[1].ename == "SystemExit" and r.errors[1].evalue == "3"
    assert live.dead_ranks() == {}
    assert dict(live.run("nd.rank").values) == {0: 0, 1: 1}


def test_exit_builtin_on_a_rank(live):
    r = live.run("if nd.rank == 0:\n    exit()\n1")
    assert live.dead_ranks() == {}, "exit() in a cell must not end the engine"
    assert dict(live.run("nd.rank").values) == {0: 0, 1: 1}
    assert not r.errors and dict(r.values) == {
        0: 1,
        1: 1,
    }  # IPython's exit() only asks; the engine stays


def test_segfault_is_reported_with_its_line_and_restart_recovers(live, ip, run):
    from notebook_dist import session
    from notebook_dist.errors import ClusterError

    try:
        live.run(
            "import signal\nx = 1\nif nd.rank == 1:\n    signal.raise_signal(signal.SIGSEGV)\n",
            filename="Cell In[77]",
            header="%%distributed",
        )
        raise AssertionError("expected the rank's death to be reported")
    except ClusterError as exc:
        assert str(exc).startswith("rank 1 was killed by SIGSEGV at line 5.")
    out = run("%dist_restart")
    assert out.error is None, out.output
    fresh = session.current()
    assert dict(fresh.run("nd.rank").values) == {0: 0, 1: 1}


def test_a_controller_crash_leaves_no_engine_and_restart_recovers():
    import signal
    import time

    import pytest
    from conftest import pids_alive

    from notebook_dist import DistCluster
    from notebook_dist.errors import ClusterError

    cluster = DistCluster(n=2).start()
    fresh = None
    try:
        from notebook_dist.reaper import group_members

        engines = [r.pid for r in cluster.ranks]
        reaper = cluster._reaper.proc.pid
        controller = cluster._cluster.controller.pid
        schedulers = [p for p in group_members(controller) if p != controller]
        assert schedulers, "expected the controller's scheduler processes in its group"
        os.kill(controller, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pids_alive(engines + schedulers + [reaper]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids_alive(engines + schedulers + [reaper]) == [], (
            "processes outlived their controller by 10 s"
        )
        assert group_members(controller) == []
        with pytest.raises(ClusterError) as info:
            cluster.run("1")
        assert str(info.value).startswith("the ipyparallel controller of this cluster is gone")
        fresh = cluster.restarted()
        assert dict(fresh.run("nd.rank").values) == {0: 0, 1: 1}
    finally:
        cluster.shutdown()
        if fresh is not None:
            fresh.shutdown()
