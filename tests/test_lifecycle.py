"""Processes: nothing this project starts outlives the notebook, however it ends."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest
from conftest import pids_alive, wait_until

pytestmark = pytest.mark.slow

PIDS_CODE = (
    "from notebook_dist import session\n"
    "c = session.current()\n"
    "print('PIDS', *[r.pid for r in c.ranks], c.processes.ipp.controller.pid, c.processes.reaper.proc.pid, c.processes.forks.pid)\n"
)


def _wait_gone(pids, within_s):
    wait_until(lambda: not pids_alive(pids), within_s)
    return pids_alive(pids)


@contextmanager
def _kernel_with_cluster(tmp_path):
    """A real kernel running a 2-rank cluster: (manager, client, the cluster's pids). On
    the way out the kernel is stopped if it still runs and no pid is ever left behind."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    pids: list[int] = []
    try:
        reply = kc.execute_interactive("%load_ext notebook_dist\n%dist_init -n 2", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        lines = []
        kc.execute_interactive(
            PIDS_CODE, timeout=30, output_hook=lambda m: lines.append(m["content"].get("text", ""))
        )
        pids = [int(p) for p in "".join(lines).split("PIDS", 1)[1].split()]
        assert len(pids) == 5 and pids_alive(pids) == pids  # ranks, controller, reaper, fork server
        yield km, kc, pids
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        else:
            km.cleanup_resources()
        for pid in pids_alive(pids):  # never leave them, even when an assertion fails
            os.kill(pid, signal.SIGKILL)


def test_kernel_sigkill_leaves_no_process_behind(tmp_path):
    from notebook_dist.signals import Started, group_members

    with _kernel_with_cluster(tmp_path) as (km, _, pids):
        controller = Started.record(pids[2])
        family = pids + [p for p in group_members(controller) if p not in pids]  # schedulers
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        left = _wait_gone(family, 10.0)
        assert left == [], f"still running 10 s after the kernel was SIGKILLed: {left}"


def test_kernel_shutdown_stops_the_cluster(tmp_path):
    with _kernel_with_cluster(tmp_path) as (km, _, pids):
        km.shutdown_kernel(now=False)
        left = _wait_gone(pids, 10.0)
        assert left == [], f"still running after kernel shutdown: {left}"


def test_kernel_restart_stops_the_cluster_and_the_new_kernel_starts_clean(tmp_path):
    with _kernel_with_cluster(tmp_path) as (km, kc, pids):
        km.restart_kernel(now=False)
        left = _wait_gone(pids, 10.0)
        assert left == [], f"still running after the kernel restarted: {left}"
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive("%load_ext notebook_dist\n%dist_status", timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]


def test_a_script_that_never_shuts_its_cluster_down_ends_and_leaves_nothing(tmp_path):
    """A script that starts a cluster and ends without ``shutdown()``, the cluster held
    to the interpreter's very end (here by a reference cycle; a test framework's kept
    traceback does the same). The interpreter ends, the cluster with it. Before, the
    cluster was collected where no thread can start any more, and its stop waited for
    one for ever."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import gc\n"
        "from notebook_dist import DistCluster\n"
        "gc.disable()  # the cycle is collected only at the interpreter's end\n"
        "class Holder:\n"
        "    pass\n"
        "h = Holder()\n"
        "h.me = h\n"
        "h.cluster = DistCluster(n=2).start()\n"
        "p = h.cluster.processes\n"
        "print('PIDS', *[r.pid for r in h.cluster.ranks], p.ipp.controller.pid, "
        "p.reaper.proc.pid, p.forks.pid, flush=True)\n"
        "del h, p\n"
    )
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        first = proc.stdout.readline()
        assert first.startswith("PIDS"), first
        pids = [int(p) for p in first.split()[1:]]
        assert proc.wait(timeout=60) == 0
        assert _wait_gone(pids, 10.0) == []
    finally:
        if proc.poll() is None:  # (the hang: the script and what it started are ended here)
            proc.kill()
            proc.wait()
        for pid in pids_alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_shutdown_and_dead_rank_report():
    from notebook_dist import DistCluster
    from notebook_dist.errors import ClusterError

    cluster = DistCluster(n=2).start()
    pids = [r.pid for r in cluster.ranks] + [
        cluster.processes.ipp.controller.pid,
        cluster.processes.reaper.proc.pid,
    ]
    try:
        os.kill(cluster.ranks[1].pid, signal.SIGKILL)
        wait_until(cluster.dead_ranks, 5, every_s=0.05)
        assert cluster.dead_ranks() == {1: "was killed by SIGKILL"}
        with pytest.raises(ClusterError) as info:
            cluster.run("1 + 1")
        assert (
            str(info.value)
            == "rank 1 was killed by SIGKILL. Run %dist_heal for a fresh rank in its place while "
            "the others keep their variables (--copy NAMES gives it yours), or %dist_restart for "
            "a fresh set of ranks (or %dist_shutdown)."
        )
        rows = cluster.status()
        assert rows[1]["state"] == "dead (was killed by SIGKILL)" and rows[0]["state"] == "idle"
    finally:
        cluster.shutdown()
    assert _wait_gone(pids, 5.0) == []


def test_a_stop_goes_on_past_a_wait_of_ipyparallels_that_would_not_end():
    """ipyparallel's client closes by waiting for its IO thread with no end: with that
    thread stuck (a callback that returns only when the test lets it), the stop still
    ends while it is stuck, and every process of the cluster with it."""
    import threading

    from notebook_dist import DistCluster

    cluster = DistCluster(n=2).start()
    pids = [r.pid for r in cluster.ranks] + [
        cluster.processes.ipp.controller.pid,
        cluster.processes.reaper.proc.pid,
    ]
    stuck, release, left = threading.Event(), threading.Event(), threading.Event()

    def wedge():
        stuck.set()
        release.wait(3600)  # (past the test's own timeout: the old stop never returned)
        left.set()

    try:
        cluster.processes.client._io_loop.add_callback(wedge)
        assert stuck.wait(10)
        cluster.shutdown()
        assert cluster.state == "stopped"
        assert not left.is_set()  # the stop ended while the IO thread was still stuck
    finally:
        release.set()
        cluster.shutdown()
    assert _wait_gone(pids, 10.0) == []


def test_rank_dying_during_a_cell_ends_the_cell():
    from notebook_dist import DistCluster
    from notebook_dist.errors import ClusterError

    with DistCluster(n=2) as cluster:
        with pytest.raises(ClusterError) as info:
            cluster.run("import os, time\nif nd.rank == 1:\n    os._exit(7)\ntime.sleep(60)")
        # rank 0 was stopped, not left to sleep out its minute
        assert cluster.last_watch.views[0].result["error"]["ename"] == "KeyboardInterrupt"
        assert (
            str(info.value)
            == "rank 1 exited with code 7 at line 3. Rank 0 was interrupted at line 4 and keeps its "
            "variables. Run %dist_heal for a fresh rank in its place while the others keep their "
            "variables (--copy NAMES gives it yours), or %dist_restart (add --replay to re-run "
            "your setup cells)."
        )
        pids = [r.pid for r in cluster.ranks]
    assert _wait_gone(pids, 5.0) == []


def test_an_engine_whose_registration_notice_the_client_missed_still_joins(monkeypatch):
    """ipyparallel's client learns of an engine from a notification, and misses the one sent
    while it connects (seen under load: one of 16 engines never known). The start asks the
    controller for its list: here the client drops its first news of engine 1 (the notice,
    or the list it got as it connected, if engine 1 registered sooner), and the cluster
    starts all the same, every rank answering."""
    import ipyparallel as ipp

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    dropped = []
    update = ipp.Client._update_engines  # (every route by which the client learns of one)

    def lossy(self, engines):
        if not dropped and any(int(e) == 1 for e in engines):
            dropped.append(1)
            engines = {e: u for e, u in engines.items() if int(e) != 1}
        update(self, engines)

    monkeypatch.setattr(ipp.Client, "_update_engines", lossy)
    with DistCluster(n=3, config=DistConfig(spare_engines=0)) as c:
        assert dropped, "no news of engine 1 was seen (so none dropped)"
        assert sorted(c.processes.engine_ids) == [0, 1, 2]
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1, 2: 2}


def test_a_start_whose_engines_never_register_keeps_their_logs(monkeypatch):
    """Engines the client never hears of (every route by which it learns of engines closed:
    the list it gets as it connects, each notice, and the controller asked again): the
    start fails after its timeout, and says where the engines' logs are kept, a copy made
    before the cluster's folder and the engines' own logs are removed."""
    import re
    import shutil

    import ipyparallel as ipp

    from notebook_dist import DistCluster
    from notebook_dist.cluster.forks import end_ahead
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    end_ahead()  # (one started ahead would have engines registered before the client asks)
    # (an engine registered before the client connected comes in the connection's reply)
    monkeypatch.setattr(ipp.Client, "_update_engines", lambda self, engines: None)
    with pytest.raises(ClusterError) as got:
        DistCluster(n=2, config=DistConfig(spare_engines=0, start_timeout_s=8)).start()
    where = re.search(r"their logs are kept in (\S+)", str(got.value))
    assert where and "only 0 of 2 engines registered" in str(got.value), str(got.value)
    try:
        logs = os.listdir(where.group(1))
        engines = [name for name in logs if name.startswith("ipengine-")]
        assert len(engines) == 2, logs
        assert all(
            "Completed registration" in open(os.path.join(where.group(1), name)).read()
            for name in engines
        )
    finally:
        shutil.rmtree(where.group(1), ignore_errors=True)
