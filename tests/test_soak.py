"""Soak: one real kernel runs 300 %%distributed cells mixing output, gathers, exceptions,
interrupts and a restart, and not one output line is lost.

What it checks for leaks is growth that scales with the number of cells: memory,
descriptors, threads and comms at a late point after the warm-up (cell 150, fifty cells
after the restart) against the end (cell 300). Each kind of cell runs at least 3 times in
that span, so a leak tied to any kind shows as a growth of 3 or more; a slack of
``SLACK_FDS`` lets one late lazy open pass. The descriptor count is the smallest of a few
readings: the kernel's own threads (ipyparallel's, ipykernel's) open descriptors for an
instant, and one such, caught mid-count, once failed a strict comparison (85 -> 86 with
the same descriptors open before and after).

``NOTEBOOK_DIST_SOAK_LEAK=KIND`` makes every cell of that kind leak a descriptor in the
kernel: the way to see this test fail for a real leak (``interrupt``, the rarest kind,
leaks 3 in the span).

The figures are printed (pytest -s shows them) and quoted in the issue notes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import threading

import pytest
from conftest import pids_alive

pytestmark = pytest.mark.slow

CELLS = 300
MID = 150  # the late point after the warm-up; the restart is at cell 100
LINES = 5  # printed per rank by each output cell
KERNEL_RSS_MB = 20  # growth bounds between MID and the end (measured: a few MB, about 1 MB)
ENGINE_RSS_MB = 20
SLACK_FDS = 2
SLACK_THREADS = 1
LEAK_KIND = os.environ.get("NOTEBOOK_DIST_SOAK_LEAK")
LEAK = "_soak_leak = globals().setdefault('_soak_leak', [])\n_soak_leak.append(open(os.devnull))"

STATS = r"""
import gc, json, os, threading, psutil
from comm import get_comm_manager
from notebook_dist import session
gc.collect()
_c = session.current()
_k = psutil.Process()
def _fds():  # IPython's history database opens a journal now and then: not ours to count
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(os.path.join("/proc/self/fd", f))
        except OSError:  # closed meanwhile
            continue
        if "history.sqlite" not in target:
            out.append(target)
    return sorted(out)
def _steady_fds():  # descriptors held across readings: an instant's one is not a leak
    import time
    readings = []
    for _ in range(3):
        readings.append(_fds())
        time.sleep(0.05)
    return min(readings, key=len)
_e = [psutil.Process(r.pid) for r in _c.ranks]
print("STATS " + json.dumps({
    "kernel_rss": _k.memory_info().rss, "kernel_fds": _steady_fds(),
    "kernel_threads": threading.active_count(), "comms": len(get_comm_manager().comms),
    "engine_pids": [p.pid for p in _e], "engine_rss": [p.memory_info().rss for p in _e],
    "engine_fds": [p.num_fds() for p in _e], "engine_threads": [p.num_threads() for p in _e],
}))
"""


class Kernel:
    def __init__(self, tmp_path):
        from jupyter_client.manager import start_new_kernel

        env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
        self.comms_opened = 0  # the live dashboards' widgets

    def run(self, code: str, timeout: float = 120, interrupt_after: float | None = None):
        out: list[str] = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "comm_open":
                self.comms_opened += 1

        timer = None
        if interrupt_after is not None:
            timer = threading.Timer(interrupt_after, self.km.interrupt_kernel)
            timer.start()
        try:
            reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        finally:
            if timer is not None:
                timer.cancel()
        return reply["content"], "".join(out)

    def ok(self, code: str, **kw) -> str:
        content, text = self.run(code, **kw)
        assert content["status"] == "ok", (code, content.get("evalue"), text[-2000:])
        return text

    def stats(self) -> dict:
        text = self.ok(STATS)
        return json.loads(text.split("STATS ", 1)[1])


def _cell(i: int) -> tuple[str, str]:
    """The i-th soak cell: (kind, code)."""
    if i % 50 == 25:
        return "interrupt", "%%distributed\nimport time\nfor _ in range(300):\n    time.sleep(0.1)"
    if i % 7 == 3:
        return "error", (
            f"%%distributed\nif nd.rank == 1:\n    raise ValueError('soak {i}')\nnd.rank"
        )
    if i % 5 == 1:
        return "gather", (
            f"%%distributed --gather g\ng = torch.full((4096,), float({i} + nd.rank))\n"
            "dist.all_reduce(g)"
        )
    return "output", (  # it reports, so its live dashboard opens (a quiet cell's would not)
        f"%%distributed\nfor j in range({LINES}):\n    print('soak', {i}, j)\n"
        f"t = torch.ones(8) * {i}\ndist.all_reduce(t)\nnd.report(step=1, total=1)\nfloat(t[0])"
    )


def test_three_hundred_cells_leak_nothing_and_lose_no_line(tmp_path):
    k = Kernel(tmp_path)
    pids: list[int] = []
    try:
        k.ok("%load_ext notebook_dist\n%dist_init -n 2", timeout=180)
        kinds: dict[str, int] = {}
        expected_lines = got_lines = 0
        mid = None
        for i in range(1, CELLS + 1):
            if i == 100:
                text = k.ok("%dist_restart --replay", timeout=180)
                assert "the ranks are where they were" in text
            kind, code = _cell(i)
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "interrupt":
                content, _ = k.run(code, interrupt_after=1.5)
                assert content["status"] == "error" and content["ename"] == "CellInterrupted"
                assert len(content["traceback"]) == 1  # one line, no frames of the tool
            elif kind == "error":
                content, text = k.run(code)
                assert content["status"] == "error", text
                shown = "\n".join(content["traceback"]) + text
                assert f"ValueError: soak {i}" in shown, shown[-2000:]
            elif kind == "gather":
                k.ok(code)
                k.ok(f"assert float(g[1][0]) == 2 * {i} + 1, g")
            else:
                text = k.ok(code)
                expected_lines += 2 * LINES
                shown = [ln for ln in text.splitlines() if " soak " in ln]
                want = [f"[rank {r}] soak {i} {j}" for r in (0, 1) for j in range(LINES)]
                assert sorted(shown) == want, (i, text)
                got_lines += len(shown)
            if kind == LEAK_KIND:
                k.ok("import os\n" + LEAK)
            if i == MID:
                mid = k.stats()
                pids += mid["engine_pids"]
        end = k.stats()
        assert mid is not None
        figures = growth(mid, end)
        figures.update(cells=kinds, comms_opened=k.comms_opened)
        figures["output_lines"] = (got_lines, expected_lines)
        print("\nSOAK", json.dumps(figures))
        assert got_lines == expected_lines, figures
        assert leaks(figures) == [], figures
        assert k.comms_opened >= CELLS, "the dashboards did not run: the comm check is empty"
        assert end["engine_pids"] == mid["engine_pids"]
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=False)
        for pid in pids_alive(pids):
            os.kill(pid, signal.SIGKILL)


def growth(mid: dict, end: dict) -> dict:
    """What grew between the two late points, with the descriptors that came and went."""
    mb = 1 << 20
    came = collections.Counter(end["kernel_fds"]) - collections.Counter(mid["kernel_fds"])
    went = collections.Counter(mid["kernel_fds"]) - collections.Counter(end["kernel_fds"])
    return {
        "kernel_rss_growth_mb": round((end["kernel_rss"] - mid["kernel_rss"]) / mb, 1),
        "engine_rss_growth_mb": [
            round((a - b) / mb, 1) for a, b in zip(end["engine_rss"], mid["engine_rss"])
        ],
        "kernel_fds": (len(mid["kernel_fds"]), len(end["kernel_fds"])),
        "kernel_fds_new": sorted(came.elements()),
        "kernel_fds_gone": sorted(went.elements()),
        "kernel_threads": (mid["kernel_threads"], end["kernel_threads"]),
        "comms": (mid["comms"], end["comms"]),
        "engine_fds": (mid["engine_fds"], end["engine_fds"]),
        "engine_threads": (mid["engine_threads"], end["engine_threads"]),
    }


def leaks(fig: dict) -> list[str]:
    """The growths that scale with the number of cells (beyond the slack for a lazy open)."""
    found = []
    if fig["kernel_rss_growth_mb"] >= KERNEL_RSS_MB:
        found.append("kernel memory")
    if max(fig["engine_rss_growth_mb"]) >= ENGINE_RSS_MB:
        found.append("engine memory")
    pairs = [("kernel descriptors", fig["kernel_fds"], SLACK_FDS)]
    pairs += [("kernel threads", fig["kernel_threads"], SLACK_THREADS), ("comms", fig["comms"], 0)]
    for n, (a, b) in enumerate(zip(*fig["engine_fds"])):
        pairs.append((f"engine {n} descriptors", (a, b), SLACK_FDS))
    for n, (a, b) in enumerate(zip(*fig["engine_threads"])):
        pairs.append((f"engine {n} threads", (a, b), SLACK_THREADS))
    for name, (before, after), slack in pairs:
        if after - before > slack:
            found.append(f"{name} {before} -> {after}")
    return found


def test_the_leak_check_passes_a_lazy_open_and_fails_a_leak_per_kind_of_cell():
    mid = {
        "kernel_rss": 0,
        "engine_rss": [0, 0],
        "kernel_threads": 12,
        "comms": 0,
        "kernel_fds": ["pipe:[1]"] * 85,
        "engine_fds": [60, 60],
        "engine_threads": [13, 13],
    }
    lazy = dict(mid, kernel_fds=mid["kernel_fds"] + ["/tmp/x.log"])
    assert leaks(growth(mid, lazy)) == []
    per_interrupt = dict(mid, kernel_fds=mid["kernel_fds"] + ["/dev/null"] * 3)
    assert leaks(growth(mid, per_interrupt)) == ["kernel descriptors 85 -> 88"]
    assert leaks(growth(mid, dict(mid, comms=1))) == ["comms 0 -> 1"]
    assert leaks(growth(mid, dict(mid, engine_threads=[13, 15]))) == ["engine 1 threads 13 -> 15"]
