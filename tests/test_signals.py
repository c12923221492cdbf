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
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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


def _record(child: subprocess.Popen, what: str = "process") -> Started:
    """A child this test started, recorded the way a cluster records its processes."""
    proc = Started.record(child.pid, what, parent=os.getpid())
    assert proc is not None
    return proc


def _stray() -> Started:
    """A ``sleep 600`` this test started whose parent (a shell) is gone: not its child."""
    shell = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    proc = Started.record(int(shell.stdout.strip()), "stray")
    assert proc is not None
    return proc


def _forged(pid, start: str, leads: bool = False) -> Started:
    """A record as if :meth:`Started.record` had made it, which it never would: only to
    reach the checks behind the first one (a record built by hand is refused at once)."""
    proc = Started(pid, start, leads)
    object.__setattr__(proc, "recorded", True)
    return proc


def _gone(proc: subprocess.Popen, within_s: float = 5.0) -> bool:
    try:
        proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


# ---- the one function's refusals ----------------------------------------------------


def test_only_a_record_made_by_started_record_is_signalled():
    child = _child()
    try:
        proc = _record(child, "engine")
        by_hand = Started(child.pid, proc.start, proc.leads_group, "engine")
        assert by_hand == proc and proc.recorded and not by_hand.recorded
        for fake in (by_hand, dataclasses.replace(proc), (child.pid, proc.start), child.pid):
            assert "was not made by Started.record" in signals.refusal(fake)
            assert signals.send(fake, signal.SIGTERM) is False
            assert signals.send_group(fake, signal.SIGTERM) is False
            assert signals.group_members(fake) == [] and not signals.is_running(fake)
        assert signals.end([by_hand], grace_s=0.1) == [] and child.poll() is None
        assert signals.is_running(proc) and Started.reported(child.pid, proc.start).recorded
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("pid", [-1, 0, 1, None, True, "12", 2.0])
def test_a_placeholder_pid_is_never_recorded_nor_signalled(pid):
    assert Started.record(pid) is None
    assert Started.reported(pid, "1") is None
    for proc in (Started(pid, "1", True), _forged(pid, "1", True)):
        assert signals.refusal(proc) is not None
        # signal 0 is a probe: a broken check would only return True here, and send nothing
        assert signals.send(proc, 0) is False
        assert signals.send_group(proc, 0) is False
        assert signals.group_members(proc) == []
    assert "is not a single process" in signals.refusal(_forged(pid, "1", True))


def test_this_process_its_parent_and_protected_pids_are_refused():
    for pid in (os.getpid(), os.getppid()):
        assert Started.record(pid) is None
        assert Started.reported(pid, signals.start_time(pid)) is None
        own = _forged(pid, signals.start_time(pid), True)
        assert "this process, its parent or protected" in signals.refusal(own)
        assert signals.send(own, 0) is False
    guarded = _child()
    try:
        proc = _record(guarded)
        signals.protect(guarded.pid)
        assert signals.send(proc, signal.SIGTERM) is False and guarded.poll() is None
        assert Started.record(guarded.pid) is None
    finally:
        signals._PROTECTED.discard(guarded.pid)
        guarded.kill()
        guarded.wait()


def test_a_pid_with_another_start_time_is_not_the_process_that_was_started():
    child = _child()
    try:
        proc = _record(child, "engine")
        assert proc.leads_group and proc.what == "engine"
        later = str(int(proc.start) + 1)
        # changing a record makes one by hand; a forged one meets the start-time check
        assert "not made by Started.record" in signals.refusal(
            dataclasses.replace(proc, start=later)
        )
        reused = _forged(child.pid, later, True)
        assert "no longer the process that was started" in signals.refusal(reused)
        assert signals.send(reused, signal.SIGTERM) is False
        assert signals.send_group(reused, signal.SIGTERM) is False
        assert signals.end([reused], grace_s=0.1) == [] and child.poll() is None
        assert signals.send(proc, signal.SIGTERM) is True and _gone(child)
        assert signals.is_running(proc) is False and signals.send(proc, 0) is False
    finally:
        child.kill()
        child.wait()


def test_an_exit_watch_sees_its_process_end_and_never_another_at_its_pid():
    child = _child()
    try:
        proc = _record(child)
        watch = signals.ExitWatch(proc)
        assert watch.running() is True
        child.kill()
        deadline = time.monotonic() + 5
        while watch.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.running() is False
        # ended, not yet waited for: a zombie, as a crashed controller is until reaped
        assert signals._stat(child.pid)[0] == "Z"
        assert signals.is_running(proc) is False
        watch.close()
        assert watch.running() is False  # (asked of its record once closed)
        child.wait()
        other = _child()  # a record whose start time is not its pid's process's
        try:
            reused = signals.ExitWatch(_forged(other.pid, str(int(proc.start) - 1)))
            live = signals.ExitWatch(_record(other))
            assert reused.running() is False and live.running() is True
            reused.close()
            live.close()  # (its pidfd: a test leaves no descriptor open)
        finally:
            other.kill()
            other.wait()
    finally:
        child.kill()
        child.wait()


def test_record_with_a_parent_refuses_a_process_that_is_not_its_child():
    stray = _stray()  # sleep's parent was the shell, now gone
    try:
        assert Started.record(stray.pid, parent=os.getpid()) is None
        assert Started.record(stray.pid) is not None  # it exists; it is just not ours
        assert Started.reported(stray.pid, "") is None
        assert Started.reported(stray.pid, "1") is None  # a start time that is not its own
    finally:
        signals.send(stray, signal.SIGKILL)


def test_a_group_is_signalled_only_when_its_leader_leads_a_session_of_its_own():
    leader = _child("sh", "-c", "sleep 600 & wait", session=True)
    # in this runner's own group: its sleep says its pid, to be ended by pid at the end
    plain = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    own = _record(leader)
    plain_sleep = Started.record(int(plain.stdout.readline()), "sleep", parent=plain.pid)
    plain.stdout.close()
    try:
        assert plain_sleep is not None and not plain_sleep.leads_group
        wait_until(lambda: signals.group_members(own), 5, every_s=0.05)
        members = signals.group_members(own)
        assert own.leads_group and len(members) == 1
        shared = _record(plain)
        assert not shared.leads_group and signals.group_members(shared) == []
        # a group whose leader is gone: its members are still ended, as ours
        assert signals.send(own, signal.SIGKILL) and _gone(leader)
        assert signals.group_members(own) == members
        assert signals.end([own], grace_s=2.0) == [own]
        assert signals.group_members(own) == []
        # the test runner's own group is never signalled through a leader that does not lead it
        assert signals.send_group(shared, signal.SIGTERM) and _gone(plain)
        assert signals.is_running(plain_sleep)  # (left in this runner's group on purpose)
    finally:
        for p in (leader, plain):
            p.kill()
            p.wait()
        signals.end([own, plain_sleep], grace_s=2.0)  # what is left of what this test started
    assert not signals.is_running(plain_sleep) and signals.group_members(own) == []


# ---- no other place signals a process: read from the source -------------------------

#: names that send a signal or end a process, as a function or a method
SIGNALLING = {
    "kill",  # os.kill, a Popen's, psutil's, asyncio's
    "killpg",
    "pidfd_send_signal",
    "pthread_kill",
    "raise_signal",
    "send_signal",
    "terminate",
    "cmd_kill",  # ipyparallel's ssh sender
    "signal_engines",
    "signal_engines_sync",
    "stop_cluster",
    "stop_cluster_sync",
    "stop_engines",
    "stop_engines_sync",
    "stop_controller",
    "stop_controller_sync",
    "restart_engines",
    "restart_engines_sync",
}
#: subprocess's functions that wait for their child, and kill it on a timeout or an error
WAITING = {"run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}

#: every place in notebook_dist/ and magics/ that signals or ends a process: (file,
#: function, form) -> why it reaches only what this project started
ALLOWED = {
    ("notebook_dist/signals.py", "send", "os.kill"): "the one door, after refusal()",
    ("notebook_dist/signals.py", "send", "_signal.pidfd_send_signal"): "the one door, by pidfd",
    ("notebook_dist/signals.py", "send_group", "os.killpg"): "a group whose recorded leader "
    "leads a session of its own",
    ("notebook_dist/cluster/recovery.py", "interrupt", "processes.client.send_signal"): "a "
    "control message, for ranks without a record: an engine with no nanny ignores it; an "
    "attached ipcluster's nanny signals its own engine",
    (
        "notebook_dist/cluster/processes.py",
        "Processes.stop",
        "self.ipp.stop_cluster_sync",
    ): "ipyparallel "
    "stops what its launchers started, and signals a launcher's process only in state 'running'",
    ("notebook_dist/faults.py", "die", "signal.raise_signal"): "a rank signals itself",
    ("notebook_dist/faults.py", "kill", "signal.raise_signal"): "a rank signals itself",
    ("notebook_dist/cluster/launchers.py", "slurm_job_state", "subprocess.run"): "squeue, its "
    "own child, killed on its 30 s timeout",
    ("notebook_dist/cluster/launchers.py", "mpi_settings", "subprocess.run"): "mpiexec "
    "--version, its own child, killed on its 30 s timeout",
    ("notebook_dist/cluster/hosts.py", "ssh_destination_address", "subprocess.run"): "ssh -G, "
    "its own child, killed on its 30 s timeout",
    (
        "notebook_dist/cluster/engine_launchers.py",
        "RankSlurmEngineSetLauncher._run_command",
        "subprocess.run",
    ): "sbatch or scancel, its own child, killed only if the wait is interrupted",
    (
        "notebook_dist/cluster/engine_launchers.py",
        "RankSSHEngineLauncher.signal",
        "super().signal",
    ): "ipyparallel's kill over ssh of the engine it started on that host, only in state "
    "'running'; none on a host found not answering",
    (
        "notebook_dist/cluster/engine_launchers.py",
        "<module>",
        "code: p.terminate(",
    ): "STOP_ON_HOST, "
    "run on a host by the ssh engines' stop: the engines started there, each looked up by "
    "its recorded pid with psutil, which checks it is the same process when it signals",
    ("notebook_dist/cluster/engine_launchers.py", "<module>", "code: p.kill("): "the same, "
    "for those of them still running 5 s after TERM",
    ("notebook_dist/cluster/engine_launchers.py", "held_output", "proc.kill"): "an ssh call "
    "of ipyparallel's, the kernel's own child by its Popen, interrupted while it ran",
    (
        "notebook_dist/cluster/engine_launchers.py",
        "RankSSHEngineSetLauncher.stop",
        "proc.kill",
    ): "the same calls still under way to a host found not answering, by their Popen (one "
    "that ended is not signalled: Popen checks first)",
    ("notebook_dist/runtime/witness.py", "_witness.forward", "os.kill"): "a rank's witness "
    "passes the signals sent to it on to its own child, the engine, until it has reaped it "
    "(a pid is its own until then)",
}


class _Places(ast.NodeVisitor):
    """(function, form, line) for each place in one module that signals or ends a process,
    however it is written: ``os.kill(...)``, ``k = os.kill``, ``p.terminate()``, ``from os
    import kill``, ``getattr(os, "kill")``, ``subprocess.run(...)`` (any alias)."""

    def __init__(self, tree: ast.Module):
        self.found: list[tuple[str, str, int]] = []
        self.scope: list[str] = []
        self.signal_names = {"signal"}  # a module's own names for the signal module
        self.subprocess_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names = {
                        "signal": self.signal_names,
                        "_signal": self.signal_names,  # (the signal module's C half)
                        "subprocess": self.subprocess_names,
                    }
                    names.get(alias.name, set()).add(alias.asname or alias.name)
        self.visit(tree)

    def _add(self, form: str, node: ast.AST) -> None:
        self.found.append((".".join(self.scope) or "<module>", form, node.lineno))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Attribute(self, node):
        owner = ast.unparse(node.value)
        if node.attr in SIGNALLING or (node.attr == "signal" and owner not in self.signal_names):
            self._add(ast.unparse(node), node)
        elif node.attr in WAITING and owner in self.subprocess_names:
            self._add(ast.unparse(node), node)
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name in SIGNALLING or (node.module == "subprocess" and alias.name in WAITING):
                self._add(f"from {node.module} import {alias.name}", node)

    def visit_Constant(self, node):  # getattr(os, "kill"), methodcaller("terminate")
        if isinstance(node.value, str) and node.value in SIGNALLING:
            self._add(repr(node.value), node)
        elif isinstance(node.value, str):  # code run elsewhere (on a host, over ssh)
            for call in CODE_SIGNALS.findall(node.value):
                self._add(f"code: {call}", node)


#: a call that signals a process, in the text of code that is run elsewhere
CODE_SIGNALS = re.compile(r"\b(?:os\.kill|os\.killpg|\w+\.terminate|\w+\.kill|\w+\.send_signal)\(")


def _signalling_places(root: Path) -> list[tuple[str, str, str, int]]:
    out = []
    for path in sorted([*(root / "notebook_dist").rglob("*.py"), *(root / "magics").rglob("*.py")]):
        for scope, form, line in _Places(ast.parse(path.read_text())).found:
            out.append((path.relative_to(root).as_posix(), scope, form, line))
    return out


def test_the_source_reader_sees_every_way_of_writing_a_signal():
    source = """
import os as o, signal as s, subprocess as sp, _signal
from os import kill
from subprocess import run
def f(p, pid):
    o.kill(pid, 9); o.killpg(pid, 9); s.pidfd_send_signal(3, 9); getattr(o, "kill")(pid, 9)
    p.send_signal(9); p.terminate(); p.kill(); launcher.signal(9); k = o.kill
    sp.run(["x"], timeout=1); sp.check_output(["x"]); s.signal(2, None); _signal.signal(2, None)
    send("import os\\nos.kill(pid, 9)\\nproc.terminate()")
"""
    forms = [form for _, form, _ in _Places(ast.parse(source)).found]
    assert forms == [
        "from os import kill",
        "from subprocess import run",
        "o.kill",
        "o.killpg",
        "s.pidfd_send_signal",
        "'kill'",
        "p.send_signal",
        "p.terminate",
        "p.kill",
        "launcher.signal",
        "o.kill",
        "sp.run",
        "sp.check_output",
        "code: os.kill(",
        "code: proc.terminate(",
    ], forms  # s.signal and _signal.signal (a handler) are not a signal sent


def test_nothing_but_the_allowed_places_signals_a_process():
    """Every call that can signal or end a process, however written, is one of ALLOWED,
    and each place ALLOWED names is still there (so the list stays the whole truth)."""
    found = _signalling_places(ROOT)
    where = {(path, scope, form) for path, scope, form, _ in found}
    unexpected = [
        f"{p}:{line} {scope}: {form}"
        for p, scope, form, line in found
        if (p, scope, form) not in ALLOWED
    ]
    assert unexpected == [], "signals a process outside notebook_dist.signals:\n" + "\n".join(
        unexpected
    )
    assert set(ALLOWED) <= where, f"ALLOWED names places that are gone: {set(ALLOWED) - where}"
    assert len(found) == len(ALLOWED), "a form ALLOWED once is written twice: " + repr(found)


# ---- a property: what a cluster records, and so may signal -----------------------------


@pytest.fixture(scope="module")
def pool():
    """Real processes of every kind a launcher's or a rank's pid can name."""
    children = [_child(), _child(session=False)]
    stray = _stray()
    ended = _child()
    ended_start = signals.start_time(ended.pid)
    ended.kill()
    ended.wait()
    pool_dir = tempfile.mkdtemp(prefix="nd-test-signals-")  # the launchers' (never written)
    yield {
        "children": {p.pid: signals.start_time(p.pid) for p in children},
        "stranger": (stray.pid, stray.start),
        "ended": (ended.pid, ended_start),
        "profile_dir": pool_dir,
    }
    for p in children:
        p.kill()
        p.wait()
    signals.send(stray, signal.SIGKILL)
    shutil.rmtree(pool_dir, ignore_errors=True)


def _pids(pool, traits: bool = False):
    """Every pid a launcher or a rank can carry: placeholders, ours, a stranger's, the
    kernel's (an ipyparallel launcher's pid is an int trait: None only where it has none)."""
    placeholders = [-1, 0] if traits else [-1, 0, None]
    return st.sampled_from(
        [*placeholders, 1, os.getpid(), os.getppid(), pool["stranger"][0], pool["ended"][0]]
        + list(pool["children"])
    )


#: how the engines were launched: notebook_dist's Launcher, or someone else's ipcluster
KINDS = ("local", "mpi", "slurm", "ssh", "attached")


def _engine_set(kind: str, data, pool):
    """An ipyparallel engine set as the kind launches it, in a drawn state (ipyparallel's
    launchers carry pid -1 until they run; Slurm's have no pid; ssh's is on another host)."""
    from ipyparallel.cluster import launcher as ipl

    from notebook_dist.cluster import engine_launchers as engines

    states = st.sampled_from(["before", "running", "after"])
    where = {"profile_dir": pool["profile_dir"], "cluster_id": "t"}
    if kind == "slurm":
        es = engines.RankSlurmEngineSetLauncher(**where)
    elif kind == "mpi":
        es = engines.RankMPIEngineSetLauncher(**where)
        es.pid = data.draw(_pids(pool, traits=True), "mpiexec pid")
    else:
        local = kind == "local"
        es = (engines.RankEngineSetLauncher if local else ipl.SSHEngineSetLauncher)(**where)
        one = engines.RankEngineLauncher if local else ipl.SSHEngineLauncher
        for i in range(data.draw(st.integers(0, 3), "engines")):
            el = es.launchers[str(i)] = one(**where)
            el.pid = data.draw(_pids(pool, traits=True), "engine pid")
            el.state = data.draw(states, "engine state")
    es.state = data.draw(states, "set state")
    return es


@settings(max_examples=60, deadline=None)
@given(
    engines=st.lists(
        st.tuples(
            st.sampled_from(["node1", "node2"]),
            st.sampled_from([-1, 0, 1, 4242, 4243]),
            st.sampled_from(["before", "running", "after"]),
        ),
        max_size=5,
    ),
    dark=st.sets(st.sampled_from(["node1", "node2"])),
)
def test_the_ssh_stop_asks_each_host_to_end_only_the_engines_it_started_there(engines, dark):
    """The ssh engines' stop runs STOP_ON_HOST once on each host that answers, naming the
    pids ipyparallel recorded as started there: never a placeholder (-1, 0, 1), nor an
    engine that is not running, nor any on a host that does not answer."""
    import asyncio

    from notebook_dist.cluster import engine_launchers as nd_engines

    es = nd_engines.RankSSHEngineSetLauncher(profile_dir="/nonexistent", cluster_id="t")
    es.dark = set(dark)
    asked: dict[str, list] = {}

    class Sender:  # the host's Python over ssh, as ipyparallel's sender runs it
        def __init__(self, host):
            self.host = host

        def check_output_python_code(self, code):
            assert self.host not in asked, "two calls to one host"
            asked[self.host] = ast.literal_eval(code.split("for pid in ", 1)[1].split(":")[0])
            return "__killed=0__"

    for i, (host, pid, state) in enumerate(engines):
        el = es.launchers[str(i)] = nd_engines.RankSSHEngineLauncher(
            profile_dir="/nonexistent", cluster_id="t", hostname=host
        )
        el.dark, el.pid, el.state, el._ssh_sender = es.dark, pid, state, Sender(host)
    asyncio.run(es.stop())
    expected: dict[str, list] = {}
    for host, pid, state in engines:
        if state == "running" and pid > 1 and host not in dark:
            expected.setdefault(host, []).append(pid)
    assert asked == expected


class _Cluster:
    """What Processes.stop uses of ipyparallel's Cluster. Its own stop (which signals a
    launcher's process only while the launcher is running) is listed in ALLOWED; here it
    does nothing, so that what notebook_dist ends on its own is all that is seen."""

    shutdown_atexit = True

    def __init__(self, engine_sets: dict):
        self.engines = engine_sets

    def stop_cluster_sync(self):
        pass


class _Client:
    """What an attached cluster's stop uses of ipyparallel's Client."""

    ids: list[int] = []

    def __getitem__(self, targets):
        return self

    def apply_sync(self, f):
        return None

    def close(self):
        pass


def _processes(kind: str, data, pool):
    """Processes as Processes.start leaves them for this kind, and the pids among this
    test's children that a launcher on this machine names (what it may record)."""
    from ipyparallel.cluster.launcher import LocalControllerLauncher

    from notebook_dist.cluster import launchers as nd_launchers
    from notebook_dist.cluster.attach import AttachedProcesses
    from notebook_dist.cluster.processes import Processes
    from notebook_dist.config import DistConfig

    if kind == "attached":  # someone else's engines: nothing started, nothing to end
        return AttachedProcesses(
            DistConfig(), nd_launchers.Launcher(DistConfig()), _Client(), [], (None,) * 3
        ), set()
    cls = {
        "local": nd_launchers.Launcher,
        "mpi": nd_launchers.MPILauncher,
        "slurm": nd_launchers.SlurmLauncher,
        "ssh": nd_launchers.SSHLauncher,
    }[kind]
    launcher = object.__new__(cls)  # (its checks of mpiexec, sbatch, ssh hosts left out)
    launcher.config = DistConfig()
    processes = Processes(DistConfig(), launcher)
    # as Processes.start records: the controller, then what each engine set started
    controller = LocalControllerLauncher(profile_dir=pool["profile_dir"], cluster_id="t")
    controller.pid = data.draw(_pids(pool, traits=True), "controller pid")
    processes.record(controller, "controller")
    named = {controller.pid}
    processes.ipp = _Cluster({})
    for i in range(data.draw(st.integers(1, 2), "engine sets (a restart adds one)")):
        es = processes.ipp.engines[f"set{i}"] = _engine_set(kind, data, pool)
        launchers = list(getattr(es, "launchers", {}).values())
        for el in launcher.started_processes(es, launchers):
            processes.record(el, "engine")
        if kind != "ssh":  # an ssh launcher's pid is on another host
            named |= {el.pid for el in launcher.started_processes(es, launchers)}
    return processes, named & set(pool["children"])


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_cluster_signals_nothing_outside_what_it_started(pool, data, monkeypatch):
    from notebook_dist.cluster.ranks import RankInfo

    kind = data.draw(st.sampled_from(KINDS), "launcher kind")
    processes, expected = _processes(kind, data, pool)

    # ranks join, saying their pid and start time (MPI's and Slurm's are not our children)
    starts = {**pool["children"], pool["stranger"][0]: pool["stranger"][1]}
    ranks = []
    for rank in range(data.draw(st.integers(0, 4), "ranks")):
        pid = data.draw(_pids(pool), "rank pid")
        start = data.draw(
            st.sampled_from(["", "1", starts.get(pid, ""), pool["ended"][1]]), "start"
        )
        machine = data.draw(st.sampled_from([processes.here, "another-host", ""]), "machine")
        ranks.append(RankInfo(rank, rank, "h", pid, "cpu", "gloo", machine, start))
    processes.ranks_joined(ranks)
    if processes.launcher.watch_rank_pids:
        expected |= {
            r.pid
            for r in ranks
            if r.machine in (processes.here, "") and r.start and r.start == starts.get(r.pid)
        }

    # every engine of a set exits before the stop (the original bug): ipyparallel forgets
    # each launcher as its engine ends, and the set alone is left, with its pid -1
    for es in getattr(processes.ipp, "engines", {}).values():
        if data.draw(st.booleans(), "every engine of the set exited"):
            getattr(es, "launchers", {}).clear()
            es.state = "after"

    recorded = {p.pid for p in processes.started}
    assert recorded <= expected, processes.started
    assert set(processes.rank_procs.values()) <= set(processes.started)

    sent: list[tuple[str, int]] = []  # what stopping signals, recorded instead of sent
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(("kill", pid)))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append(("killpg", pid)))
    monkeypatch.setattr(
        signal, "pidfd_send_signal", lambda fd, sig: sent.append(("pidfd", _pidfd_pid(fd)))
    )
    if not data.draw(st.booleans(), "pidfds"):
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError()))
    real_end = signals.end
    monkeypatch.setattr(signals, "end", lambda procs: real_end(procs, grace_s=0.0))
    try:
        ended = processes.stop()
    finally:
        monkeypatch.undo()

    targets = {pid for _, pid in sent}
    assert targets <= recorded and not {-1, 0, 1, os.getpid(), os.getppid()} & targets, sent
    leaders = {p.pid for p in processes.started if p.leads_group}
    assert {pid for how, pid in sent if how == "killpg"} <= leaders, sent
    # each still runs (nothing was really sent), so each was asked to end
    assert targets == recorded and {p.pid for p in ended or []} == recorded


def _pidfd_pid(fd: int) -> int:
    """The pid a pidfd refers to (its line ``Pid:`` in /proc/self/fdinfo)."""
    return int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("Pid:")[1].split()[0])


# ---- every rank dies, then shutdown, restart or the kernel's end: in a PID namespace ---


def _in_pid_namespace(*scenarios: tuple[str, str]) -> dict:
    """Run the scenarios (HOW, THEN) one after another in one kernel in a fresh PID namespace."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    script = Path(__file__).with_name("pidns_scenario.py")
    done = subprocess.run(
        [*cmd, sys.executable, str(script), *(f"{how}:{then}" for how, then in scenarios)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


def _said(scenario: dict) -> dict[str, str]:
    return {s["step"]: s["text"] for s in scenario["steps"]}


def _nothing_else_was_hit(report: dict) -> None:
    steps = [s for sc in report["scenarios"] for s in sc["steps"]]
    assert all(s["sentinel"] for s in steps) and report["sentinel"], report
    assert report["left"] == [], f"left running in the namespace: {report['left']}"


DIED = {
    "os_exit": "ranks 0, 1 exited with code 1",
    "sigkill": "ranks 0, 1 were killed by SIGKILL",
}
EACH_DIED = {"os_exit": "exited with code 1", "sigkill": "was killed by SIGKILL"}

#: every way of ending every rank, then every way on: two chains, one kernel each (each
#: cluster start costs seconds); a scenario after a restart goes on with its fresh ranks
CHAINS = [
    [
        ("os_exit", "shutdown"),
        ("sigkill", "restart"),
        ("os_exit", "replay"),
        ("os_exit", "kernel_shutdown"),
    ],
    [
        ("sigkill", "shutdown"),
        ("os_exit", "restart"),
        ("sigkill", "replay"),
        ("sigkill", "kernel_kill"),
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: ",".join(f"{h}-{t}" for h, t in c))
def test_after_every_rank_died_only_the_clusters_processes_are_ended(chain):
    report = _in_pid_namespace(*chain)
    _nothing_else_was_hit(report)
    assert [(sc["how"], sc["then"]) for sc in report["scenarios"]] == chain
    for sc in report["scenarios"]:
        _every_rank_died_then(sc["how"], sc["then"], _said(sc))
    assert report["kernel_alive"] is False  # each chain ends with the kernel's end


def _every_rank_died_then(how: str, then: str, said: dict[str, str]) -> None:
    which = f"({how} then {then})"
    died = DIED[how]
    assert "Error" not in said["setup"], (which, said["setup"])
    end = said["end ranks"]
    assert "ClusterError: Every rank of the cell has ended: " in end, (which, said)
    # the two alike, or each said apart: a rank whose agent saw it wait in the barrier just
    # before it was killed is said with where it was last seen (a busy machine)
    each = EACH_DIED[how]
    assert died in end or all(f"rank {r} {each}" in end for r in (0, 1)), (which, end)
    assert said["next cell"].strip() == (
        f"ClusterError: Every rank has ended: {died}. Their variables are gone. Run "
        "%dist_restart for fresh ranks (add --replay to re-run your setup cells), or %dist_shutdown."
    ), which
    assert said["status"].count("dead (") == 2 and "Every rank has ended" in said["status"], which
    before = f"every rank had already ended ({died})"
    if then == "shutdown":
        assert said["shutdown"] == f"notebook_dist: cluster stopped: the controller; {before}.\n"
    if then in ("restart", "replay"):
        # the controller lives on: the fresh ranks come from the warm pool under it
        assert f"(stopped: nothing left running; {before})" in said[then], (which, said[then])
        want = "[rank 0] 10\n[rank 1] 11" if then == "replay" else "[rank 0] 0\n[rank 1] 1"
        assert want in said["after restart"], (which, said["after restart"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, called",
    [
        ("exit", "exit() at line 3 (exit code 0)"),
        ("sys_exit", "sys.exit() at line 4 (exit code 3)"),
    ],
)
def test_exit_in_a_cell_ends_the_cell_on_each_rank_and_the_ranks_stay(how, called):
    report = _in_pid_namespace((how, "shutdown"))
    _nothing_else_was_hit(report)
    said = _said(report["scenarios"][0])
    # each rank's line before the note; lines of different ranks come as they arrive
    lines = said["end ranks"].splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("notebook_dist: ranks 0, 1"))
    assert sorted(lines[:note]) == ["[rank 0] before", "[rank 1] before"], said["end ranks"]
    assert "after" not in said["end ranks"].replace("before", "")
    assert (
        f"notebook_dist: ranks 0, 1 called {called}. The cell ended there on those ranks, "
        "which stay running with their variables.\n"
    ) in said["end ranks"], said["end ranks"]
    assert "[rank 0] 10\n[rank 1] 11" in said["next cell"]  # alive, variables kept
    assert said["shutdown"] == "notebook_dist: cluster stopped: the controller and 2 ranks.\n"


def test_a_proc_of_another_pid_namespace_is_refused_with_a_sentence_before_any_start(tmp_path):
    """In a PID namespace whose /proc is the parent's, every pid read there names another
    process: %dist_init says so and how to mend it, and starts nothing."""
    cmd = ["unshare", "--pid", "--fork"]  # no --mount-proc: /proc stays the parent's
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    code = (
        "from IPython.testing.globalipapp import start_ipython\n"
        "ip = start_ipython()\n"
        "ip.run_line_magic('load_ext', 'notebook_dist')\n"
        "r = ip.run_cell('%dist_init -n 2 --backend gloo')\n"
        "import os\n"
        "try:\n    os.waitpid(-1, os.WNOHANG)\n    print('A CHILD WAS STARTED')\n"
        "except ChildProcessError:\n    print('NO CHILD')\n"
    )
    done = subprocess.run(
        [*cmd, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, IPYTHONDIR=str(tmp_path)),
        cwd=tmp_path,
    )
    said = done.stdout + done.stderr
    assert "/proc here belongs to another PID namespace" in said, said
    assert "Mount a /proc for this namespace (unshare --pid --fork --mount-proc" in said
    assert "Traceback" not in said, said
    assert "NO CHILD" in done.stdout, said  # nothing was started
