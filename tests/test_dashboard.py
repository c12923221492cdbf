"""The dashboard: its state on a real cluster, exact widget model values, text fallback."""

from __future__ import annotations

import pytest
from comm.base_comm import BaseComm

from notebook_dist.ui import DashboardFeed, build
from notebook_dist.ui.state import DashboardState, RankRow
from notebook_dist.ui.text import render_text

REPORT_CELL = (
    "import time\n"
    "for step in range(1, 51):\n"
    "    time.sleep(0.01 * (1 + 2 * nd.rank))  # rank 1 is the slow one\n"
    "    nd.report(step=step, total=50, loss=1.0 / step + nd.rank, samples=32)\n"
    "print('trained')\n"
)


class Recorder:
    def __init__(self):
        self.states: list[DashboardState] = []
        self.closed: DashboardState | None = None

    def update(self, st):
        self.states.append(st)

    def close(self, st):
        self.closed = st


def test_state_follows_a_real_cell(live):
    rec = Recorder()
    feed = DashboardFeed(rec, hz=4)
    result = live.run(REPORT_CELL, on_update=feed)
    feed.close(live.last_watch)
    assert not result.errors
    final = rec.closed
    assert final.world_size == 2 and final.backend == "gloo" and final.finished
    for r in (0, 1):
        row = final.rows[r]
        assert row.state == "done" and row.step == 50 and row.total == 50
        assert row.metrics["loss"] == pytest.approx(1 / 50 + r)
        assert row.chart_key == "loss" and row.chart[-1] == (50.0, pytest.approx(1 / 50 + r))
        assert row.last_output == "trained"
    assert final.rows[1].straggler and not final.rows[0].straggler  # 3x slower steps
    assert final.throughput and final.throughput > 0
    # live updates were coalesced (4 Hz at most), and some came while it ran
    assert 1 <= feed.updates <= 4 * final.wall_s + 2
    assert any(s.rows[0].state in ("running", "in collective") for s in rec.states)


class DummyComm(BaseComm):
    log: list = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        DummyComm.log.append((self.comm_id, msg_type, data))


@pytest.fixture
def patched_comm(monkeypatch):
    import ipywidgets.comm as ipw_comm

    DummyComm.log = []
    monkeypatch.setattr(ipw_comm, "create_comm", lambda **kw: DummyComm(**kw))
    yield DummyComm.log


def _state(step, state="running", verdict=None):
    st = DashboardState(
        world_size=2,
        backend="gloo",
        devices=["cpu", "cpu"],
        ranks=[0, 1],
        wall_s=3.25,
        verdict=verdict,
    )
    for r in (0, 1):
        st.rows[r] = RankRow(
            rank=r,
            state=state,
            step=step,
            total=50,
            metrics={"loss": 0.5, "step": step, "total": 50},
            chart_key="loss",
            chart=[(1.0, 1.0), (2.0, 0.5)],
            rss_bytes=100 * 2**20,
            last_output="hi",
        )
    return st


def test_widget_model_values_and_no_leaks(patched_comm):
    from ipywidgets.widgets.widget import _instances

    from notebook_dist.ui.widget import WidgetDashboard

    before = set(_instances)
    board = WidgetDashboard()
    board.update(_state(20))
    row = board.rows[1]
    assert row.progress.max == 50 and row.progress.value == 20
    assert row.step.value == "<span class='nd-step'>20/50</span>"
    assert "data-state='running'" in row.state.value and "3.2 s" not in row.state.value
    assert row.metrics.value == "loss=0.5"
    assert "<polyline" in row.chart.value
    assert board.header.value.startswith(
        "<b>2 ranks</b> · gloo · cpu · <span class='nd-wall'>3.2 s</span>"
    )
    assert board.verdict.value == ""
    updates = [m for m in patched_comm if m[1] == "comm_msg"]
    board.update(_state(50, "done", verdict="Nothing is stuck."))
    assert row.progress.value == 50 and "data-state='done'" in row.state.value
    assert "Nothing is stuck." in board.verdict.value
    sent = [m for m in patched_comm[len(updates) :] if m[1] == "comm_msg"]
    assert any(m[2]["state"].get("value") == 50 for m in sent if m[2].get("method") == "update")
    board.close(_state(50, "done"))
    assert set(_instances) == before  # every widget closed: no comm left open
    closes = [m for m in patched_comm if m[1] == "comm_close"]
    assert len(closes) == len(board.widgets())


def test_text_rendering():
    text = render_text(_state(50, "done", verdict="Nothing is stuck."))
    lines = text.splitlines()
    assert lines[0] == "2 ranks · gloo · 3.2 s"
    assert lines[1].split() == [
        "rank",
        "state",
        "step",
        "metrics",
        "collective",
        "compute/wait",
        "memory",
        "last",
        "output",
    ]
    assert lines[2].split()[:4] == ["0", "running", "50/50", "loss=0.5"] or lines[2].split()[
        :4
    ] == ["0", "done", "50/50", "loss=0.5"]
    assert lines[-1] == "Diagnosis: Nothing is stuck."


def test_terminal_gets_text_printed_once_at_the_end(live, run):
    out = run("%%distributed\n" + REPORT_CELL)
    assert out.error is None, out.output
    assert out.stdout.count("compute/wait") == 1  # one table, not a stream of frames
    table = out.stdout[out.stdout.index("2 ranks · gloo") :].splitlines()
    assert table[2].split()[:3] == ["0", "done", "50/50"]
    assert table[3].split()[:4] == ["1", "done", "(straggler)", "50/50"]
    out = run("%%distributed --no-dashboard\n" + REPORT_CELL)
    assert "compute/wait" not in out.stdout


def test_build_handles_a_rank_that_never_reported(live):
    result = live.run("1")
    st = build(live.last_watch)
    assert not result.errors and [st.rows[r].state for r in (0, 1)] == ["done", "done"]
    assert st.rows[0].step is None and st.throughput is None


def test_report_keeps_latest_values_and_a_bounded_chart_of_each_number():
    """nd.report on the rank side: what the agent sends (unit level, no cluster)."""
    import torch

    from notebook_dist.runtime.agent import snapshot
    from notebook_dist.runtime.report import MAX_POINTS, report
    from notebook_dist.runtime.state import STATE

    saved = (STATE.metrics, STATE.series, STATE.reports, STATE.cell_state)
    STATE.reset_cell(0.0, "t")
    try:
        for step in range(1, 1001):
            report(step=step, total=1000, loss=1.0 / step, lr=3, ok=True, name="x", t=torch.ones(1))
        report(samples=8)
        snap = snapshot(with_stack=False)
        assert snap["reports"] == 1001
        assert snap["metrics"]["step"] == 1001  # a report without step counts reports
        assert snap["metrics"]["loss"] == 1.0 / 1000 and snap["metrics"]["name"] == "x"
        assert snap["metrics"]["_samples_total"] == 8
        assert set(snap["series"]) == {"loss", "lr", "ok"}  # numbers only; not step/total
        loss = snap["series"]["loss"]
        assert MAX_POINTS // 2 <= len(loss) <= MAX_POINTS
        assert loss[0] == (1.0, 1.0) and loss[-1] == (1000.0, 0.001)  # the whole run's shape
        assert all(type(x) is float and type(y) is float for x, y in loss)
        assert snap["series"]["ok"][-1] == (1000.0, 1.0)
    finally:
        STATE.metrics, STATE.series, STATE.reports, STATE.cell_state = saved
