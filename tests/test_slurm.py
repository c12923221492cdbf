"""``%dist_init --launcher slurm``: the batch script ipyparallel's Slurm launcher writes
(unit-tested anywhere), and a real single-node Slurm (Debian's slurm-wlm: munged,
slurmctld, slurmd, started by the test on its own ports) running the ranks as the
tasks of one job.

CI installs slurm-wlm and sets NOTEBOOK_DIST_REQUIRE_SLURM=1, so the real part must run
there; elsewhere it skips when Slurm or root is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
from conftest import DDP_IN_SYNC, pids_alive, wait_until

from notebook_dist.cluster.engine_launchers import RankSlurmEngineSetLauncher
from notebook_dist.cluster.engines import engine_cmd


def test_the_batch_script_carries_the_options_and_our_engine(tmp_path):
    launcher = RankSlurmEngineSetLauncher(
        profile_dir=str(tmp_path),
        cluster_id="c1",
        engine_cmd=engine_cmd("/opt/py/bin/python"),
        queue="gpu",
        account="proj7",
        qos="high",
        timelimit="30",
        options="--gres=gpu:4 --cpus-per-task=8",
    )
    launcher.write_batch_script(4)
    script = open(launcher.batch_file).read()
    assert launcher.batch_file == str(tmp_path / "slurm_engine.sbatch")  # not the notebook's folder
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    for line in (
        "#SBATCH --ntasks=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj7",
        "#SBATCH --qos=high",
        "#SBATCH --time=30",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --export=ALL",
    ):
        assert line in lines, (line, script)
    srun = [ln for ln in lines if ln.startswith("srun ")]
    assert srun and srun[0].startswith(
        "srun /opt/py/bin/python -m notebook_dist.runtime.engine --IPEngine.enable_nanny=False"
    )
    assert "--mpi" not in script  # the engines do not need mpi4py
    assert lines.index("#SBATCH --gres=gpu:4") < lines.index(srun[0])


# ---- a real single-node Slurm --------------------------------------------------------------


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run slurmctld/slurmd"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: apt-get install slurm-wlm)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not()
    if why is not None:
        if os.environ.get("NOTEBOOK_DIST_REQUIRE_SLURM") == "1":
            raise RuntimeError(f"NOTEBOOK_DIST_REQUIRE_SLURM=1 but Slurm cannot run here: {why}")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    procs: list[subprocess.Popen] = []
    ok = subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0
    if not ok:  # no munge daemon yet: start one (the package made its key)
        os.makedirs("/run/munge", exist_ok=True)
        procs.append(
            subprocess.Popen(
                ["munged", "--foreground", "--force"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(0.5)
    conf = tmp / "slurm.conf"
    conf.write_text(
        f"ClusterName=ndtest\nSlurmctldHost={host}\nSlurmUser=root\nSlurmdUser=root\n"
        f"SlurmctldPort={_free_port()}\nSlurmdPort={_free_port()}\nAuthType=auth/munge\n"
        f"StateSaveLocation={tmp}/state\nSlurmdSpoolDir={tmp}/spool\n"
        f"SlurmctldPidFile={tmp}/ctld.pid\nSlurmdPidFile={tmp}/d.pid\n"
        f"SlurmctldLogFile={tmp}/ctld.log\nSlurmdLogFile={tmp}/d.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n"
        "JobAcctGatherType=jobacct_gather/none\n"
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE\n"
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    for daemon in ("slurmctld", "slurmd"):
        procs.append(
            subprocess.Popen(
                [daemon, "-D", "-f", str(conf)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # sbatch/squeue here, and the engines (--export=ALL)
    try:

        def idle() -> bool:
            info = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
            return info.stdout.strip() in ("idle", "mixed")

        if not wait_until(idle, 60):
            raise RuntimeError("slurmd never became idle (sinfo -h -o %T)")
            time.sleep(0.3)
        yield conf
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if old is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = old


def _jobs() -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()


def test_ranks_as_the_tasks_of_a_slurm_job(slurm, no_current, run):
    from notebook_dist import session

    out = run('%dist_init --launcher slurm -n 2 --sbatch "--time=10 --job-name=nd-ranks"')
    assert out.error is None, out.output
    cluster = session.current()
    job = next(iter(cluster.processes.ipp.engines.values())).job_id
    assert _jobs() == [job]
    out = run(
        "%%distributed\nimport os\nt = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
        "(float(t), int(os.environ['SLURM_PROCID']), os.environ['SLURM_JOB_ID'])"
    )
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: (3.0, 0, job), 1: (3.0, 1, job)}
    out = run("%%distributed\n" + DDP_IN_SYNC)
    assert out.error is None and dict(out.result.result) == {0: True, 1: True}, out.output
    pids = [r.pid for r in cluster.ranks]
    assert run("%dist_shutdown").error is None
    wait_until(lambda: not (pids_alive(pids) or _jobs()), 15)
    assert pids_alive(pids) == [] and _jobs() == []


def test_a_job_slurm_refuses_is_reported(slurm, no_current, run):
    out = run('%dist_init --launcher slurm -n 2 --sbatch "--partition=nosuchpartition"')
    assert type(out.error).__name__ == "ClusterError", out.output
    assert "failed (exit 1)" in str(out.error) and "invalid partition" in str(out.error).lower()
    assert _jobs() == []


def test_after_every_slurm_rank_died_restart_and_shutdown_signal_only_their_own(
    slurm, no_current, run, signal_spy, bystanders
):
    from conftest import every_rank_dies_twice

    from notebook_dist import session

    out = run('%dist_init --launcher slurm -n 2 --sbatch "--time=10 --job-name=nd-dead"')
    assert out.error is None, out.output
    cluster = session.current()
    started = {p.pid for p in cluster.processes.started}
    assert {r.pid for r in cluster.ranks} <= started  # the job's tasks, as reported
    every_rank_dies_twice(run, signal_spy, bystanders)  # restart --replay (a new job), shutdown
    wait_until(lambda: not _jobs(), 15)
    assert _jobs() == []
