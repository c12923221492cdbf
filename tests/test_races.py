"""Races on the kernel side and the rank side, each with a test that fails without its fix.

- a release that lands as the cell ends (the cell ends under the lock a release takes;
  an exception a release scheduled is cancelled once the cell has ended);
- collectives from another thread (the tracker's nesting guard is per thread);
- the rank's environment, in place before the thread that imports torch starts;
- process-group names, forgotten on a rebuild;
- a rank whose clock is off (staleness by the cell's token, waits on one clock).
"""

from __future__ import annotations

import io

import pytest
from conftest import until_verdict, wait_until

pytestmark = pytest.mark.slow

# On a rank: a release that checked "the cell still runs", then took its time before it
# raised in the main thread (as the NCCL release does after ncclCommAbort): the cell ends
# meanwhile. The gap is widened to 0.5 s so it happens every time.
LATE_RELEASE = """
import threading, time
from notebook_dist.runtime import recover
from notebook_dist.runtime.state import STATE

def slow_abort():
    if STATE.cell_state == "running":
        time.sleep(0.5)
        recover.raise_in_main_thread(recover.CollectiveReleased)
    return 1

recover.abort_collectives, _real_abort = slow_abort, recover.abort_collectives
token = STATE.cell_token
threading.Thread(target=recover.release_cell, args=(token,), daemon=True).start()
time.sleep(0.1)  # the release holds the lock now; the cell ends under it
'fine'
"""


def test_a_release_that_lands_as_the_cell_ends_never_reaches_the_engine(live):
    try:
        r = live.run(LATE_RELEASE)
        assert r.errors == {} and dict(r.values) == {0: "fine", 1: "fine"}
        # the release for the cell that ended must not land in the next one (nor in the
        # engine's own code between them)
        nxt = live.run("import time\ntime.sleep(1.0)\n'second'")
        assert nxt.errors == {}, nxt.errors
        assert dict(nxt.values) == {0: "second", 1: "second"}
        for _ in range(3):  # the engines keep answering
            assert dict(live.run("nd.rank", ranks=[0, 1]).values) == {0: 0, 1: 1}
        assert live.dead_ranks() == {}
    finally:
        live.run(
            "from notebook_dist.runtime import recover\nrecover.abort_collectives = _real_abort"
        )


THREADED = """
import threading, time
sub = dist.new_group([0, 1])
seen = {}

def saver():
    time.sleep(0.3)  # while the cell's thread is inside its barrier
    dist.all_reduce(torch.ones(2), group=sub)

th = threading.Thread(target=saver, name="saver")
th.start()
if nd.rank == 1:
    time.sleep(1.0)
dist.barrier()
th.join()
from notebook_dist.runtime.tracker import TRACKER
[(rec["op"], rec.get("thread")) for rec in TRACKER.history]
"""


def test_a_collective_from_another_thread_is_tracked_and_named(live):
    r = live.run(THREADED)
    r.raise_for_errors()
    for rank, recs in r.values.items():
        assert ("all_reduce", "saver") in recs, (rank, recs)  # not hidden by the barrier
        assert ("barrier", None) in recs


def test_a_collective_stuck_in_another_thread_is_named_with_its_thread(live):
    code = (
        "import threading\n"
        "def saver():\n    dist.all_reduce(torch.ones(2))\n"
        "th = threading.Thread(target=saver, name='saver')\n"
        "if nd.rank == 0:\n    th.start()\n    th.join()\n"
    )
    try:
        diag, _, _, _ = until_verdict(live, code, 3.0, give_up_s=30)
        assert diag is not None
        assert diag.rows[0]["state"] == "in collective #1 (in thread 'saver')", diag.rows
        assert "(in thread 'saver')" in diag.verdict, diag.verdict
    finally:  # Ctrl-C ended the cell's thread (in join); the saver still waits: join it
        live.run("dist.all_reduce(torch.ones(2))", ranks=[1]).raise_for_errors()
    waiting = "from notebook_dist.runtime.tracker import TRACKER\nlen(TRACKER.others)"
    assert wait_until(lambda: live.run(waiting).values[0] == 0, 10)


def test_the_ranks_environment_is_complete_when_its_engine_starts(live):
    """What the ranks are given is in their environment from the process's start (its
    /proc environ is the start's), before the thread that imports torch reads it."""
    for r in live.ranks:
        with open(f"/proc/{r.pid}/environ", "rb") as f:
            start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        for key, value in live.config.rank_overrides().items():
            assert start.get(key.encode()) == value.encode(), (r.rank, key)


def test_process_group_names_are_forgotten_on_a_rebuild(live):
    names = "from notebook_dist.runtime import tracker\nlen(tracker._group_names)"
    live.run(
        "sub = dist.new_group([0, 1])\ndist.all_reduce(torch.ones(1), group=sub)"
    ).raise_for_errors()
    assert min(live.run(names).values.values()) >= 1
    live.rebuild_process_group()
    assert set(live.run(names).values.values()) == {0}


def test_a_rank_whose_clock_is_off_is_diagnosed_and_waits_on_one_clock(live):
    """Rank 1's clock 30 s behind the kernel's (another host): its snapshots still count
    (they are this cell's, by token), and how long it waits is not off by 30 s."""
    skew = (
        "import time as _time\n_real = _time.time\n"
        "if nd.rank == 1:\n    _time.time = lambda: _real() - 30.0\n"
    )
    live.run(skew).raise_for_errors()
    try:
        code = "t = torch.ones(1)\nif nd.rank == 1:\n    dist.all_reduce(t)\n"
        diag, out, _, _ = until_verdict(live, code, 3.0, give_up_s=30)
        assert diag is not None, out
        assert diag.kind == "conditional" and diag.culprits == [1], diag.verdict
        waited = float(diag.rows[1]["waiting"].split()[0])
        assert 2.0 <= waited < 20.0, diag.rows
    finally:
        live.run("import time as _time\n_time.time = _real").raise_for_errors()
    out = io.StringIO()
    live.run("t = torch.ones(1)\ndist.all_reduce(t)", out=out).raise_for_errors()
