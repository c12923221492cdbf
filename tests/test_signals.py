"""Only what the cluster started is ever signalled (notebook_dist.signals).

Once, after every rank had died, shutting down signalled pid -1: every process the user
owns (the whole machine, as root). The checks here cannot harm the machine: the
function's refusals are tried with signal 0 or on processes the test started, the
property test records what would be signalled instead of sending it, and the end-to-end
scenarios run inside a fresh PID namespace (``unshare --pid --fork --mount-proc``), where
pid -1 reaches only the namespace, with a sentinel beside the cluster that must live.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from notebook_dist import signals
from notebook_dist.signals import Started

ROOT = Path(__file__).resolve().parents[1]


def _child(*cmd: str, session: bool = True) -> subprocess.Popen:
    return subprocess.Popen(list(cmd) or ["sleep", "600"], start_new_session=session)


def _gone(proc: subprocess.Popen, within_s: float = 5.0) -> bool:
    try:
        proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


# ---- the one function's refusals ----------------------------------------------------


@pytest.mark.parametrize("pid", [-1, 0, 1, None, True, "12", 2.0])
def test_a_placeholder_pid_is_never_recorded_nor_signalled(pid):
    assert Started.record(pid) is None
    proc = Started(pid, "1", True)
    assert signals.refusal(proc) is not None
    # signal 0 is a probe: a broken check would only return True here, and send nothing
    assert signals.send(proc, 0) is False
    assert signals.send_group(proc, 0) is False
    assert signals.group_members(proc) == []


def test_this_process_its_parent_and_protected_pids_are_refused():
    for pid in (os.getpid(), os.getppid()):
        assert Started.record(pid) is None
        own = Started(pid, signals.start_time(pid), True)
        assert "this process, its parent or protected" in signals.refusal(own)
        assert signals.send(own, 0) is False
    guarded = _child()
    try:
        signals.protect(guarded.pid)
        proc = Started(guarded.pid, signals.start_time(guarded.pid))
        assert signals.send(proc, signal.SIGTERM) is False and guarded.poll() is None
    finally:
        signals._PROTECTED.discard(guarded.pid)
        guarded.kill()
        guarded.wait()


def test_a_pid_with_another_start_time_is_not_the_process_that_was_started():
    child = _child()
    try:
        proc = Started.record(child.pid, "engine", parent=os.getpid())
        assert proc is not None and proc.leads_group and proc.what == "engine"
        reused = Started(child.pid, str(int(proc.start) + 1), True)
        assert "no longer the process that was started" in signals.refusal(reused)
        assert signals.send(reused, signal.SIGTERM) is False
        assert signals.send_group(reused, signal.SIGTERM) is False
        assert signals.end([reused], grace_s=0.1) == [] and child.poll() is None
        assert signals.send(proc, signal.SIGTERM) is True and _gone(child)
        assert signals.is_running(proc) is False and signals.send(proc, 0) is False
    finally:
        child.kill()
        child.wait()


def test_record_with_a_parent_refuses_a_process_that_is_not_its_child():
    shell = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    orphan = int(shell.stdout.strip())  # sleep's parent was the shell, now gone
    try:
        assert Started.record(orphan, parent=os.getpid()) is None
        assert Started.record(orphan) is not None  # it exists; it is just not ours
        assert Started.reported(orphan, "") is None
        assert Started.reported(orphan, "1") is None  # a start time that is not its own
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_a_group_is_signalled_only_when_its_leader_leads_a_session_of_its_own():
    leader = _child("sh", "-c", "sleep 600 & wait", session=True)
    plain = _child("sh", "-c", "sleep 600 & wait", session=False)
    try:
        own = Started.record(leader.pid, parent=os.getpid())
        wait_until(lambda: signals.group_members(own), 5, every_s=0.05)
        members = signals.group_members(own)
        assert own.leads_group and len(members) == 1
        shared = Started.record(plain.pid, parent=os.getpid())
        assert not shared.leads_group and signals.group_members(shared) == []
        # a group whose leader is gone: its members are still ended, as ours
        assert signals.send(own, signal.SIGKILL) and _gone(leader)
        assert signals.group_members(own) == members
        assert signals.end([own], grace_s=2.0) == [own]
        assert signals.group_members(own) == []
        # the test runner's own group is never signalled through a leader that does not lead it
        assert signals.send_group(shared, signal.SIGTERM) and _gone(plain)
    finally:
        for p in (leader, plain):
            p.kill()
            p.wait()
    for pid in signals.group_members(Started(plain.pid, "0", True)):
        os.kill(pid, signal.SIGKILL)  # (plain's sleep, left in this group on purpose)


def test_nothing_but_the_one_function_signals_a_process():
    """No module but notebook_dist/signals.py calls os.kill, os.killpg, pidfd_send_signal,
    or a Popen's or psutil's kill/terminate/send_signal."""
    found = []
    banned = {"kill", "killpg", "pidfd_send_signal", "terminate", "send_signal"}
    for path in [*(ROOT / "notebook_dist").rglob("*.py"), *(ROOT / "magics").rglob("*.py")]:
        if path.name == "signals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in banned:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}"
                    found.append(where)
    # the one exception: ipyparallel's client asks an engine's own nanny, on the engine's
    # host, to signal it (ranks this kernel did not start: an ipcluster's, another host's)
    assert [f for f in found if not f.endswith(" processes.client.send_signal")] == []
    assert len(found) == 1, found


# ---- a property: what a cluster records, and so may signal -----------------------------


class _Launcher:
    """What Processes reads of an ipyparallel launcher: its ``pid`` (-1 until it runs)."""

    def __init__(self, pid):
        self.pid = pid


@pytest.fixture(scope="module")
def pool():
    """Real processes of every kind a launcher's or a rank's pid can name."""
    children = [_child(), _child()]
    shell = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    stranger = int(shell.stdout.strip())
    ended = _child()
    ended_start = signals.start_time(ended.pid)
    ended.kill()
    ended.wait()
    yield {
        "children": {p.pid: signals.start_time(p.pid) for p in children},
        "stranger": (stranger, signals.start_time(stranger)),
        "ended": (ended.pid, ended_start),
    }
    for p in children:
        p.kill()
        p.wait()
    os.kill(stranger, signal.SIGKILL)


def _pids(pool):
    return st.sampled_from(
        [-1, 0, 1, None, os.getpid(), os.getppid(), pool["stranger"][0], pool["ended"][0]]
        + list(pool["children"])
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_cluster_signals_nothing_outside_what_it_started(pool, data, monkeypatch):
    from notebook_dist.cluster.launchers import Launcher
    from notebook_dist.cluster.processes import Processes
    from notebook_dist.cluster.ranks import RankInfo
    from notebook_dist.config import DistConfig

    launcher = Launcher(DistConfig())
    launcher.watch_rank_pids = data.draw(st.booleans(), "ranks not our children (mpi, slurm)")
    processes = Processes(DistConfig(), launcher)
    els = [_Launcher(p) for p in data.draw(st.lists(_pids(pool), max_size=5), "launcher pids")]
    for el in els:
        processes._record(el, "engine")
    starts = {**pool["children"], pool["stranger"][0]: pool["stranger"][1]}
    ranks = []
    for rank in range(data.draw(st.integers(0, 4), "ranks")):
        pid = data.draw(_pids(pool))
        start = data.draw(
            st.sampled_from(["", "1", starts.get(pid, ""), pool["ended"][1]]), "start"
        )
        machine = data.draw(st.sampled_from([processes.here, "another-host", ""]), "machine")
        ranks.append(RankInfo(rank, rank, "h", pid, "cpu", "gloo", machine, start))
    processes.ranks_joined(ranks)

    allowed = set(pool["children"])
    if launcher.watch_rank_pids:  # a rank on this machine, as it reported itself
        allowed |= {
            r.pid
            for r in ranks
            if r.machine in (processes.here, "") and r.start == starts.get(r.pid)
        }
    assert {p.pid for p in processes.started} <= allowed
    assert set(processes.rank_procs.values()) <= set(processes.started)

    sent = []  # what stopping would signal, recorded instead of sent
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(pid))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append(pid))
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig: sent.append(-100))
    monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError()))
    signals.end(processes.started, grace_s=0.0)
    assert set(sent) <= allowed and not {-1, 0, 1, os.getpid(), os.getppid()} & set(sent)


# ---- every rank dies, then shutdown, restart or the kernel's end: in a PID namespace ---


def _in_pid_namespace(how: str, then: str) -> dict:
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    script = Path(__file__).with_name("pidns_scenario.py")
    done = subprocess.run(
        [*cmd, sys.executable, str(script), how, then],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


def _said(report: dict) -> dict[str, str]:
    return {s["step"]: s["text"] for s in report["steps"]}


def _nothing_else_was_hit(report: dict) -> None:
    assert all(s["sentinel"] for s in report["steps"]) and report["sentinel"], report
    assert report["left"] == [], f"left running in the namespace: {report['left']}"


DIED = {
    "os_exit": "rank 0 exited with code 1; rank 1 exited with code 1",
    "sigkill": "rank 0 was killed by SIGKILL; rank 1 was killed by SIGKILL",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, then",
    [
        ("os_exit", "shutdown"),
        ("sigkill", "restart"),
        ("os_exit", "replay"),
        ("os_exit", "kernel_shutdown"),
        ("sigkill", "kernel_kill"),
    ],
)
def test_after_every_rank_died_only_the_clusters_processes_are_ended(how, then):
    report = _in_pid_namespace(how, then)
    _nothing_else_was_hit(report)
    said = _said(report)
    died = DIED[how]
    assert "ClusterError: Every rank of the cell has ended: rank 0 " in said["end ranks"]
    assert all(part in said["end ranks"] for part in died.split("; ")), said["end ranks"]
    assert said["next cell"].strip() == (
        f"ClusterError: Every rank has ended: {died}. Their variables are gone. Run "
        "%dist_restart for fresh ranks (add --replay to re-run your setup cells), or %dist_shutdown."
    )
    assert said["status"].count("dead (") == 2 and "Every rank has ended" in said["status"]
    before = f"every rank had already ended ({died})"
    if then == "shutdown":
        assert said["shutdown"] == f"notebook_dist: cluster stopped: the controller; {before}.\n"
    if then in ("restart", "replay"):
        assert f"(stopped: the controller; {before})" in said[then], said[then]
        want = "[rank 0] 10\n[rank 1] 11" if then == "replay" else "[rank 0] 0\n[rank 1] 1"
        assert want in said["after restart"], said["after restart"]
        assert said["shutdown"] == "notebook_dist: cluster stopped: the controller and 2 ranks.\n"
    if then.startswith("kernel"):
        assert report["kernel_alive"] is False


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, called",
    [
        ("exit", "exit() at line 3 (exit code 0)"),
        ("sys_exit", "sys.exit() at line 4 (exit code 3)"),
    ],
)
def test_exit_in_a_cell_ends_the_cell_on_each_rank_and_the_ranks_stay(how, called):
    report = _in_pid_namespace(how, "shutdown")
    _nothing_else_was_hit(report)
    said = _said(report)
    assert "[rank 0] before\n[rank 1] before\n" in said["end ranks"]
    assert "after" not in said["end ranks"].replace("before", "")
    assert (
        f"notebook_dist: ranks 0, 1 called {called}. The cell ended there on those ranks, "
        "which stay running with their variables.\n"
    ) in said["end ranks"], said["end ranks"]
    assert "[rank 0] 10\n[rank 1] 11" in said["next cell"]  # alive, variables kept
    assert said["shutdown"] == "notebook_dist: cluster stopped: the controller and 2 ranks.\n"
