"""``%dist_init --launcher mpi``: engines started by a real mpiexec (Open MPI from Debian's
openmpi-bin), ranks in MPI rank order, and nothing left behind however it ends.

CI installs openmpi-bin and sets NOTEBOOK_DIST_REQUIRE_MPI=1, so there these tests must
run; elsewhere they skip when mpiexec is missing.
"""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest
from conftest import DDP_IN_SYNC, pids_alive, wait_until

pytestmark = pytest.mark.slow

if shutil.which("mpiexec") is None:
    if os.environ.get("NOTEBOOK_DIST_REQUIRE_MPI") == "1":
        raise RuntimeError("NOTEBOOK_DIST_REQUIRE_MPI=1 but mpiexec is not on the PATH")
    pytest.skip("needs mpiexec (Debian: apt-get install openmpi-bin)", allow_module_level=True)


def test_mpi_launcher_runs_ranks_in_mpi_order_and_stops_them_all(no_current, run):
    from notebook_dist import session

    out = run("%dist_init --launcher mpi -n 2")
    assert out.error is None, out.output
    cluster = session.current()
    assert cluster.launcher.name == "mpi"
    out = run(
        "%%distributed\nimport os\nt = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
        "(float(t), int(os.environ['OMPI_COMM_WORLD_RANK']), os.environ['LOCAL_RANK'])"
    )
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: (3.0, 0, "0"), 1: (3.0, 1, "1")}
    out = run("%%distributed\n" + DDP_IN_SYNC)
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: True, 1: True}, "DDP replicas differ"
    mpiexec = next(iter(cluster.processes.ipp.engines.values())).pid
    pids = [r.pid for r in cluster.ranks] + [mpiexec, cluster.processes.ipp.controller.pid]
    # what mpiexec started is each rank's witness (runtime/witness.py), the engine its child
    witnesses = [psutil.Process(r.pid).ppid() for r in cluster.ranks]
    assert mpiexec not in witnesses and not set(witnesses) & set(pids), witnesses
    pids += witnesses
    out = run("%dist_shutdown")
    assert out.stdout.strip() == "notebook_dist: cluster stopped: the controller and 2 ranks."
    wait_until(lambda: not pids_alive(pids), 10)
    assert pids_alive(pids) == []


def test_a_rank_ending_under_mpi_is_reported_and_restart_brings_fresh_ranks(no_current, run):
    from notebook_dist import session

    assert run("%dist_init --launcher mpi -n 2").error is None
    old = session.current()
    out = run("%%distributed\nimport os, time\nif nd.rank == 1:\n    os._exit(5)\ntime.sleep(30)")
    assert type(out.error).__name__ == "ClusterError", out.output
    # mpiexec's rank is no child of ours, so its exit status is unseen: os._exit() wrote
    # its code in the rank's report (and mpiexec then ends the other rank)
    assert "rank 1 exited with code 5 at line 4" in str(out.error), str(out.error)
    out = run("%dist_restart")
    assert out.error is None, out.output
    fresh = session.current()
    assert fresh is not old and fresh.launcher.name == "mpi"
    assert dict(fresh.run("nd.rank").values) == {0: 0, 1: 1}
    assert pids_alive([r.pid for r in old.ranks]) == []
    # one killed from outside (the OOM killer's SIGKILL) leaves no stack: its witness
    # wrote its exit status; it said "ended (its engine process is gone)"
    out = run(
        "%%distributed\nimport os, signal, time\nif nd.rank == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)"
    )
    assert type(out.error).__name__ == "ClusterError", out.output
    assert "rank 1 was killed by SIGKILL." in str(out.error), str(out.error)
    print(f"an mpiexec rank killed: {out.error}")
    # and so it is said from then on (the next cell, %dist_status), read here once
    assert fresh.dead_ranks()[1] == "was killed by SIGKILL"
    out = run("%%distributed\n1")
    assert "rank 1 was killed by SIGKILL" in str(out.error), out.output


def test_launcher_preflight_errors(no_current, run, monkeypatch):
    said = {
        line: str(run(f"%dist_init {line}").error)
        for line in (
            "--launcher sge",
            "--launcher carrier-pigeon",
            "--launcher ssh",
            "--launcher ssh --hosts node1,node2",
            "--launcher ssh --hosts node1:2,node2:2 -n 3 --network",
            "--launcher ssh --hosts node1:2,node2 --network",
            "--launcher ssh --hosts node1 --network -n 0",
            "--hosts node1",
            "--ssh '-i key'",
            "--network",
        )
    }
    expected = {
        "--launcher sge": "--launcher sge: start the engines with ipyparallel's own launcher, "
        "e.g. ipcluster start --engines sge",
        "--launcher carrier-pigeon": "unknown launcher 'carrier-pigeon': use local, mpi, slurm or ssh",
        "--launcher ssh": "--launcher ssh needs --hosts, the machines to start ranks on",
        "--launcher ssh --hosts node1,node2": "--launcher ssh starts ranks on other hosts, so "
        "they must meet over the network: add --network",
        "--launcher ssh --hosts node1:2,node2:2 -n 3 --network": "-n 3 asked, but --hosts adds "
        "up to 4 ranks",
        "--launcher ssh --hosts node1:2,node2 --network": "--hosts: give a count for every host "
        "or for none",
        "--launcher ssh --hosts node1 --network -n 0": "-n 0: a cluster needs at least one rank",
        "--hosts node1": "--hosts is for --launcher ssh",
        "--ssh '-i key'": "--ssh is for --launcher ssh",
        "--network": "--network is for ranks on other hosts",
    }
    for line, start in expected.items():
        assert said[line].startswith(start), (line, said[line])
    monkeypatch.setenv("PATH", "/nonexistent")
    out = run("%dist_init --launcher mpi")
    assert str(out.error).startswith("--launcher mpi needs mpiexec on the PATH")
    out = run("%dist_init --launcher slurm")
    assert str(out.error).startswith("--launcher slurm needs sbatch on the PATH")
    out = run("%dist_init --launcher ssh --hosts node1 --network")
    assert str(out.error).startswith("--launcher ssh needs ssh on the PATH")
    out = run('%dist_init --sbatch "--time=5"')
    assert str(out.error) == "--sbatch is for --launcher slurm"


def test_kernel_sigkill_leaves_no_mpi_process(tmp_path):
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    pids: list[int] = []
    try:
        reply = kc.execute_interactive(
            "%load_ext notebook_dist\n%dist_init --launcher mpi -n 2", timeout=120
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        lines: list[str] = []
        kc.execute_interactive(
            "from notebook_dist import session\nc = session.current()\n"
            "print('PIDS', *[r.pid for r in c.ranks], next(iter(c.processes.ipp.engines.values())).pid)",
            timeout=30,
            output_hook=lambda m: lines.append(m["content"].get("text", "")),
        )
        pids = [int(p) for p in "".join(lines).split("PIDS", 1)[1].split()]
        assert len(pids) == 3 and pids_alive(pids) == pids
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        wait_until(lambda: not pids_alive(pids), 10)
        assert pids_alive(pids) == [], "mpiexec or its ranks outlived the kernel"
    finally:
        kc.stop_channels()
        km.cleanup_resources()
        for pid in pids_alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_after_every_mpi_rank_died_restart_and_shutdown_signal_only_their_own(
    no_current, run, signal_spy, bystanders
):
    from conftest import every_rank_dies_twice

    from notebook_dist import session

    assert run("%dist_init --launcher mpi -n 2").error is None
    said = every_rank_dies_twice(run, signal_spy, bystanders)  # restart --replay, shutdown
    assert said.startswith("notebook_dist: cluster stopped: the controller; every rank had")
    assert session.current() is None
