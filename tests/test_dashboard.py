"""The dashboard: its state on a real cluster, exact widget model values, text fallback."""

from __future__ import annotations

import re

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


def test_a_cells_progress_bar_is_its_ranks_progress_when_it_reports_none(live):
    """A training loop under tqdm, no nd.report: the dashboard's progress is the bar's,
    live and at the end, and the rank whose steps take 3x as long is the straggler."""
    rec = Recorder()
    feed = DashboardFeed(rec, hz=4)
    result = live.run(
        "import time\nfrom tqdm import tqdm\nfor _ in tqdm(range(12), desc='train'):\n"
        "    time.sleep(0.05 * (1 + 2 * nd.rank))  # rank 1 is the slow one\n",
        on_update=feed,
    )
    feed.close(live.last_watch)
    assert not result.errors
    rows = rec.closed.rows
    assert [(row.step, row.total) for row in rows.values()] == [(12, 12)] * 2
    assert rows[1].straggler and not rows[0].straggler
    midway = [row.step for st in rec.states for row in st.rows.values() if row.step]
    assert any(0 < step < 12 for step in midway), midway


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


def _cells(html_text: str) -> dict[int, list[str]]:
    """Each rank row's cells, by rank, from the dashboard's HTML."""
    rows = re.findall(r"<tr class='nd-rank-row nd-rank-(\d+)'>(.*?)</tr>", html_text)
    return {int(r): re.findall(r"<td[^>]*>(.*?)</td>", body) for r, body in rows}


def test_widget_model_values_and_no_leaks(patched_comm):
    from ipywidgets.widgets.widget import _instances

    from notebook_dist.ui.html import COLUMNS
    from notebook_dist.ui.widget import WidgetDashboard

    before = set(_instances)
    board = WidgetDashboard()
    board._handle = type("H", (), {"update": lambda self, x: None})()  # no front end here
    board.update(_state(20))
    value = board.view.value
    assert value.startswith(
        "<div class='nd-dashboard nd-live' style='line-height:1.3;overflow-x:auto'><div class='nd-header'>"
        "<b>2 ranks</b> · gloo · cpu · <span class='nd-wall'>3.2 s</span></div>"
    )
    cells = _cells(value)
    assert sorted(cells) == [0, 1] and len(cells[1]) == len(COLUMNS)
    col = dict(zip(COLUMNS, cells[1]))
    assert col["rank"] == "<b>rank 1</b>"
    assert col["state"].startswith("<span class='nd-state' data-state='running'")
    assert "straggler" not in col["state"]
    assert "data-value='20' data-max='50'" in col["progress"] and "width:40.0%" in col["progress"]
    assert col["step"] == "<span class='nd-step'>20/50</span>"
    assert col["metrics"] == "<span class='nd-metrics'>loss=0.5</span>"
    assert "<polyline" in col["chart"] and col["chart"].endswith(">loss</div>")
    assert col["memory"] == "100.0 MiB" and col["last output"] == "hi"
    assert "nd-verdict" not in value
    # the exact value reached the front end in one message; an unchanged redraw sends none
    sent = [m for m in patched_comm if m[1] == "comm_msg" and m[2].get("method") == "update"]
    assert [m[2]["state"] for m in sent] == [{"value": value}]
    board.update(_state(20))
    assert len([m for m in patched_comm if m[1] == "comm_msg"]) == len(sent)
    st = _state(50, "done", verdict="Nothing is stuck.")
    st.rows[1].straggler = True
    board.update(st)
    col = dict(zip(COLUMNS, _cells(board.view.value)[1]))
    assert "data-state='done'" in col["state"] and "⚠ straggler" in col["state"]
    assert "width:100.0%" in col["progress"] and col["step"] == "<span class='nd-step'>50/50</span>"
    assert "<b>Diagnosis:</b> Nothing is stuck.</div>" in board.view.value
    board.close(_state(50, "done"))
    assert set(_instances) == before  # every widget closed: no comm left open
    closes = [m for m in patched_comm if m[1] == "comm_close"]
    assert len(closes) == len(board.widgets()) == 3


def test_the_record_a_cell_keeps_draws_the_same_table():
    from notebook_dist.ui.html import render_html

    st = _state(50, "done")
    live, final = render_html(st, live=True), render_html(st)
    assert final.startswith(
        "<div class='nd-dashboard nd-final' style='line-height:1.3;overflow-x:auto'>"
    )
    assert final.replace("nd-final", "nd-live", 1) == live


def test_sparkline_draws_a_bounded_number_of_points():
    from notebook_dist.ui.widget_colors import sparkline

    points = [(float(i), 1.0 / (i + 1)) for i in range(1000)]
    drawn = re.search(r"points='([^']*)'", sparkline(points, width=120)).group(1).split()
    assert len(drawn) <= 60
    assert drawn[0] == "1.0,1.0" and drawn[-1] == "119.0,23.0"  # the first and the latest
    assert "<polyline" not in sparkline(points[:1])


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
    assert lines[2].split()[:4] == ["0", "done", "50/50", "loss=0.5"]
    running = render_text(_state(20, "running")).splitlines()
    assert running[2].split()[:4] == ["0", "running", "20/50", "loss=0.5"]
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


def test_a_cell_refused_before_it_runs_shows_no_dashboard(live, run):
    out = run("%%distributed\n" + REPORT_CELL)
    assert out.stdout.count("compute/wait") == 1
    out = run("%%distributed\nfor x in:\n    pass")
    assert type(out.error).__name__ == "CellSyntaxError", out.output
    assert "compute/wait" not in out.output  # not the previous cell's table again


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


def many_ranks(n: int = 32) -> DashboardState:
    """32 ranks: most in one all_reduce, one slow rank still computing, one dead."""
    st = DashboardState(world_size=n, backend="gloo", devices=["cpu"] * n, ranks=list(range(n)))
    st.wall_s = 41.0
    for r in range(n):
        row = RankRow(rank=r, state="in collective", collective="all_reduce #3", step=41, total=100)
        if r == 5:
            row = RankRow(rank=r, state="running", step=40, total=100, straggler=True)
        if r == 17:
            row = RankRow(rank=r, state="dead", healed=2)
        st.rows[r] = row
    return st


def test_many_ranks_are_grouped_with_the_ones_that_need_a_look_first():
    from notebook_dist.ui.compact import groups

    labels = [g.label() for g in groups(many_ranks())]
    assert labels == [
        "rank 5: running (straggler) · step 40/100",
        "rank 17: dead",
        "ranks 0-4, 6-16, 18-31: in collective all_reduce #3 · step 41/100",
    ]
    text = render_text(many_ranks())
    assert text.splitlines()[1:4] == labels and "rank  state" not in text
    full = render_text(many_ranks(), full=True)  # DistConfig.dashboard_full_table
    assert len([ln for ln in full.splitlines()[1:] if re.match(r"\d+ ", ln)]) == 32
    uneven = many_ranks()  # ranks with more data than others: each is steps of its own total
    uneven.rows[6].step, uneven.rows[6].total = 50, 120
    assert [g.label() for g in groups(uneven)][2].endswith(" · steps 41-50 of 100-120")
    few = many_ranks(8)
    few.rows.pop(5)
    few.ranks = [r for r in few.ranks if r in few.rows]
    assert "rank  state" in render_text(few)  # up to 8 ranks: the table, a row each


def test_the_compact_view_keeps_every_row_one_click_away():
    from notebook_dist.ui.html import render_html

    page = render_html(many_ranks())
    assert page.count("class='nd-group'") == 3 and page.count("nd-rank-row") == 32
    assert page.count("class='nd-cell nd-cell-") == 32  # the strip: a square per rank
    assert "<details class='nd-all-ranks'" in page and "every rank (32)" in page
    assert "title='rank 17: dead (healed 2x)'" in page


def test_thirty_two_ranks_read_on_one_screen_in_chromium(tmp_path):
    import os
    import shutil

    from notebook_dist.ui.html import render_html

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        if os.environ.get("NOTEBOOK_DIST_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no Chromium at {chromium}: apt-get install chromium")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    html_file = tmp_path / "dashboard.html"
    html_file.write_text(f"<html><body>{render_html(many_ranks())}</body></html>")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(html_file.as_uri())
            board = page.locator(".nd-dashboard")
            closed = board.bounding_box()
            assert closed["height"] < 200, closed  # groups and strip: a few lines, not 32 rows
            assert not page.locator("tr.nd-rank-row").first.is_visible()
            board.screenshot(path=str(tmp_path / "compact.png"))
            page.locator("summary").click()  # the full table, one click away
            assert page.locator("tr.nd-rank-row").nth(31).is_visible()
            assert board.bounding_box()["height"] > closed["height"] * 3
        finally:
            browser.close()


def test_a_progress_bar_that_cannot_be_read_stops_the_bars_never_the_cell(caplog):
    """A rank's bar in a form the notebook cannot read (a rank of another version, say):
    the grouped bars stop, said in the log, and the cell goes on."""
    import io
    from types import SimpleNamespace

    from notebook_dist.ui.bars import GroupedBars

    out = io.StringIO()
    bars = GroupedBars(out, live=False)
    views = {0: SimpleNamespace(snap={"bars": [["train", 3]]})}
    bars.following(None)(SimpleNamespace(views=views))  # (looked at once LOOK_S passed)
    bars.finish(views)
    assert not bars.on and out.getvalue() == ""
    assert "the ranks' progress bars stopped" in caplog.text
