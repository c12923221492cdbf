"""A rank's witness on its host (``runtime/witness.py``): the process its launcher started
forks the engine, waits for it, writes its exit status in the fault file the engine named
last, passes the stop's signals on, and takes the engine with it when it is killed. Real
processes, each the test's own child; the notebook's reading of the note in
``test_multihost`` (a rank on another host killed by SIGKILL) and ``test_doctor_unit``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from notebook_dist.cluster.reports import _from_stacks
from notebook_dist.runtime.witness import ENDED_NOTE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the witness is Linux's")

ENGINE = """
import os, signal, sys, time
from notebook_dist.runtime import witness
witness.split()
folder, how = sys.argv[1], sys.argv[2]
first, fault = os.path.join(folder, "fault-old"), os.path.join(folder, "fault")
for path in (first, fault):  # (a rank bootstrapped again names a new fault file)
    open(path, "w").write("its stacks\\n")
    witness.tell(path)
print(os.getpid(), flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "exit":
    os._exit(3)
time.sleep(120)
"""


def start(tmp_path, how: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(tmp_path), how], stdout=subprocess.PIPE, text=True
    )
    engine = int(proc.stdout.readline())
    assert engine != proc.pid  # the engine is the witness's child
    return proc, engine


def ended_with(tmp_path) -> str:
    return (tmp_path / "fault").read_text().splitlines()[-1]


@pytest.mark.parametrize(
    "how,status,code", [("kill", -9, 128 + 9), ("exit", 3, 3)], ids=["sigkill", "os-exit"]
)
def test_the_exit_status_is_written_in_the_fault_file_named_last(tmp_path, how, status, code):
    proc, _ = start(tmp_path, how)
    try:
        assert proc.wait(30) == code  # the witness ends as its engine did
    finally:
        proc.kill()
    assert ended_with(tmp_path) == f"{ENDED_NOTE}{status}"
    assert ENDED_NOTE not in (tmp_path / "fault-old").read_text()
    out: dict = {}
    _from_stacks((tmp_path / "fault").read_text(), out)
    assert out["status"] == status


def test_the_stop_reaches_the_engine_through_its_witness(tmp_path):
    proc, engine = start(tmp_path, "wait")
    try:
        proc.send_signal(signal.SIGTERM)  # what ipyparallel's stop and STOP_ON_HOST send
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert ended_with(tmp_path) == f"{ENDED_NOTE}{-signal.SIGTERM}"
    assert not _alive(engine)


def test_an_engine_does_not_outlive_its_witness_killed(tmp_path):
    proc, engine = start(tmp_path, "wait")
    try:
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        # (one that did would end by itself within the script's 120 s: it is not this
        # test's own child, so it is not signalled from here)
        assert not _alive(engine), "the engine outlived its witness"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_where_no_witness_can_be_had_the_process_is_the_engine(tmp_path):
    """Without ``os.waitid`` (macOS's Python before 3.13) there is no fork: the process
    ipyparallel started stays the engine, and never runs it twice."""
    script = (
        "import os\nfrom notebook_dist.runtime import witness\ndel os.waitid\n"
        "me = os.getpid()\nwitness.split()\nprint(os.getpid() == me, witness._TO_WITNESS)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "True None\n", out
