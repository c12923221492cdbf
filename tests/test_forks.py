"""Local engines forked from one process that imported torch once (runtime/forkserver.py,
cluster/forks.py): the ranks are that process's children in sessions of their own, each
rank's end is reported with its exit code or signal, nothing outlives the cluster, and
the server starts engines only. A cluster without the server starts each engine itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import pids_alive, wait_until

pytestmark = pytest.mark.slow

WHO = "import os, sys\n(os.getppid(), os.getsid(0) == os.getpid(), 'torch' in sys.modules, os.environ.get('ND_TEST_MARK'))"


def test_ranks_are_forked_from_one_server_and_nothing_outlives_the_cluster(monkeypatch):
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.signals import is_running

    monkeypatch.setenv("ND_TEST_MARK", "from the kernel")
    with DistCluster(n=3, config=DistConfig(spare_engines=0)) as c:
        server = c.processes.forks
        assert server is not None
        records = [p for p in c.processes.started if p.what == "fork server"]
        assert [p.pid for p in records] == [server.pid] and is_running(records[0])
        r = c.run(WHO)
        assert not r.errors
        # the server's children, each leading a session of its own (as ipyparallel starts
        # an engine), torch already there, the kernel's environment as it was at the fork
        assert dict(r.values) == {k: (server.pid, True, True, "from the kernel") for k in range(3)}
        assert all(c.processes.rank_procs[k].leads_group for k in range(3))
        pids = [rk.pid for rk in c.ranks] + [server.pid]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


@pytest.mark.parametrize(
    "how, said", [("os._exit(7)", "exited with code 7"), ("os.kill(os.getpid(), 9)", "SIGKILL")]
)
def test_a_forked_rank_ends_with_its_exit_code_or_signal(how, said):
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        try:
            c.run(f"import os\nif nd.rank == 1:\n    {how}\n")
        except ClusterError:
            pass
        assert wait_until(lambda: 1 in c.dead_ranks(), 10)
        assert said in c.dead_ranks()[1], c.dead_ranks()
        assert 0 not in c.dead_ranks()


def test_ranks_outlive_a_killed_fork_server_and_still_end_with_the_cluster():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError
    from notebook_dist.signals import send

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        server = c.processes.forks
        record = next(p for p in c.processes.started if p.what == "fork server")
        assert send(record, 9)
        assert wait_until(lambda: server.gone, 10)
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        assert dict(r.values) == {0: 2.0, 1: 2.0} and c.dead_ranks() == {}
        # a dead rank is then healed by an engine started as ipyparallel starts one
        try:
            c.run("import os\nif nd.rank == 1:\n    os._exit(1)\n")
        except ClusterError:
            pass
        assert wait_until(lambda: 1 in c.dead_ranks(), 10)
        c.heal()
        r = c.run("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n(float(t), os.getppid())")
        assert dict(r.values)[1] == (2.0, os.getpid())
        pids = [rk.pid for rk in c.ranks]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


def test_without_the_fork_server_each_engine_is_started_by_the_kernel():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(fork_engines=False, spare_engines=0)) as c:
        assert c.processes.forks is None
        r = c.run(WHO)
        assert {v[0] for v in r.values.values()} == {os.getpid()}


def test_the_fork_server_starts_engines_only_and_ends_when_its_input_closes(tmp_path):
    """The server process itself, spoken to as the kernel speaks to it: ready once it has
    imported, a request for anything but the engine refused with the reason, and its end
    when its stdin closes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "notebook_dist.runtime.forkserver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        ready = json.loads(server.stdout.readline())
        assert ready == {"ready": server.pid}
        request = {
            "fork": 1,
            "argv": [sys.executable, "-c", "print('not an engine')"],
            "env": env,
            "cwd": str(tmp_path),
            "out": str(tmp_path / "out.log"),
        }
        server.stdin.write((json.dumps(request) + "\n").encode())
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        assert answer["forked"] == 1 and "starts engines only" in answer["error"]
        server.stdin.close()
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdin.close()
        server.stdout.close()
