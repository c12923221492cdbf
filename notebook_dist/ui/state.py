"""Dashboard state: what every rank is doing, as plain data."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ..doctor.words import p2p_text

STRAGGLER_RATIO = 1.2  # a rank whose step time is 20% over the median is flagged


@dataclass
class RankRow:
    rank: int
    #: starting, running, in collective, in debugger, waiting for input, done, error, dead, hung
    state: str = "starting"
    elapsed_s: float = 0.0
    collective: str = ""  # "all_reduce #12"
    last_output: str = ""
    rss_bytes: int = 0
    gpu: str = ""  # "cuda:0 NVIDIA H200"
    gpu_allocated: int | None = None
    gpu_reserved: int | None = None
    gpu_peak: int | None = None
    step: float | None = None
    total: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    chart_key: str | None = None
    chart: list[tuple[float, float]] = field(default_factory=list)
    compute_s: float = 0.0
    wait_s: float = 0.0
    step_time_s: float | None = None
    straggler: bool = False
    healed: int = 0  # how many times the rank was replaced by a fresh engine (%dist_heal)


@dataclass
class DashboardState:
    world_size: int
    backend: str
    devices: list[str]
    ranks: list[int]
    wall_s: float = 0.0
    throughput: float | None = None  # samples/s, when ranks report samples=
    verdict: str | None = None
    finished: bool = False
    title: str = ""  # %dist_status: the versions line (notebook_dist.about)
    rows: dict[int, RankRow] = field(default_factory=dict)

    def worth_a_table(self, quiet_s: float) -> bool:
        """Whether the cell deserves the full table: it ran ``quiet_s`` or longer, a rank
        reported metrics, raised, died or was released, or a hang was diagnosed. A quick,
        quiet cell leaves one line (a tutorial must not become a wall of tables)."""
        return (
            self.wall_s >= quiet_s
            or bool(self.verdict)
            or any(
                row.metrics or row.state in ("error", "dead", "released", "hung")
                for row in self.rows.values()
            )
        )

    def summary(self) -> str:
        """The one line a quick, quiet cell leaves: '2 ranks · gloo · 0.04 s · done'."""
        states = sorted({row.state for row in self.rows.values()})
        return (
            f"{len(self.ranks)} ranks · {self.backend} · {self.wall_s:.2f} s · {', '.join(states)}"
        )


def _state_of(view, hung: bool) -> str:
    if view.released:  # freed from a collective that could not complete: not an error of its own
        return "released"
    if view.status == "dead":
        return "dead"
    if view.status == "error":
        return "error"
    if view.status == "done":
        return "done"
    if hung:
        return "hung"
    if not view.snap:
        return "starting"
    asking = view.snap.get("asking")
    if asking:
        return "in debugger" if asking.get("kind") == "pdb" else "waiting for input"
    if view.snap.get("collective"):
        return "in collective"
    return "running"


def build(watch, chart_metric: str = "loss", now: float | None = None) -> DashboardState:
    """The dashboard state of a running (or finished) cell, from its watch's read-only view
    (``notebook_dist.watch.WatchView``; a CellWatch gives its own)."""
    view = watch.view() if hasattr(watch, "view") else watch
    now = time.time() if now is None else now
    cluster = view.cluster
    st = DashboardState(
        world_size=cluster.world_size,
        backend=cluster.backend,
        devices=[r.device for r in cluster.ranks],
        ranks=view.ranks,
        wall_s=now - view.started,
        verdict=view.verdict(),
        finished=view.finished,
    )
    hung = view.hung
    last_lines = view.last_lines()
    samples_rate = 0.0
    any_samples = False
    for r in view.ranks:
        v = view.views[r]
        snap = v.snap or {}
        row = RankRow(rank=r, state=_state_of(v, hung and v.status == "running"))
        row.healed = getattr(cluster, "healed", {}).get(r, 0)
        # a rank's own times are on its clock: measured from its cell's start on that clock
        began = snap.get("cell_started")
        if v.status != "running" and began and snap.get("time"):
            row.elapsed_s = snap["time"] - began
        else:
            row.elapsed_s = now - view.started
        coll = snap.get("collective")
        if coll and v.status == "running":
            row.collective = (
                p2p_text(coll) if coll.get("kind") == "p2p" else f"{coll['op']} #{coll['seq']}"
            )
        row.last_output = last_lines.get(r, "")
        row.rss_bytes = snap.get("rss", 0) or 0
        gpu = snap.get("gpu")
        if gpu:
            row.gpu = f"{gpu['device']} {gpu['name']}"
            row.gpu_allocated, row.gpu_reserved = gpu["allocated"], gpu["reserved"]
            row.gpu_peak = gpu["peak"]
        metrics = {
            k: val for k, val in (snap.get("metrics") or {}).items() if not k.startswith("_")
        }
        row.metrics = metrics
        row.step = metrics.get("step")
        row.total = metrics.get("total")
        if row.step is None:  # no nd.report(step=...): the rank's progress bar, if it has one
            row.step, row.total = bar_progress(snap.get("bars"))
        series = snap.get("series") or {}
        key = chart_metric if chart_metric in series else next(iter(series), None)
        row.chart_key = key
        row.chart = list(series.get(key, [])) if key else []
        row.wait_s = float(snap.get("wait_s") or 0.0)
        row.compute_s = max(0.0, row.elapsed_s - row.wait_s)
        reports = snap.get("reports") or 0
        raw = snap.get("metrics") or {}
        began = began or view.started
        if reports and raw.get("_time"):
            row.step_time_s = (raw["_time"] - began) / reports
        elif row.step and snap.get("bars") and snap.get("time"):  # (a tqdm loop's steps)
            row.step_time_s = (snap["time"] - began) / float(row.step)
        if raw.get("_samples_total") and raw.get("_time") and raw["_time"] > began:
            any_samples = True
            samples_rate += raw["_samples_total"] / (raw["_time"] - began)
        st.rows[r] = row
    times = [row.step_time_s for row in st.rows.values() if row.step_time_s]
    if len(times) >= 2:
        median = statistics.median(times)
        for row in st.rows.values():
            row.straggler = bool(row.step_time_s and row.step_time_s > STRAGGLER_RATIO * median)
    st.throughput = samples_rate if any_samples else None
    return st


def bar_progress(bars: list | None) -> tuple[float | None, float | None]:
    """(count, total) of a rank's progress bar (tqdm) in its snapshot: the outermost one
    still open (an epoch's bar, not its batches', whose count starts again each epoch),
    else the last one that stays shown; (None, None) for none."""
    if not bars:
        return None, None
    open_ = [b for b in bars if not b[3]]
    if open_:
        return open_[0][1], open_[0][2]
    shown = [b for b in bars if b[3] != "hidden"] or bars
    return shown[-1][1], shown[-1][2]


def cluster_state(cluster, rows: list[dict] | None = None, title: str = "") -> DashboardState:
    """The whole cluster when no cell runs (for %dist_status)."""
    rows = cluster.status() if rows is None else rows
    st = DashboardState(
        world_size=cluster.world_size,
        backend=cluster.backend,
        devices=[r.device for r in cluster.ranks],
        ranks=[r["rank"] for r in rows],
        finished=True,
        title=title,
    )
    for r in rows:
        state = (
            "dead"
            if r["state"].startswith("dead")
            else ("running" if r["state"] == "busy" else "idle")
        )
        st.rows[r["rank"]] = RankRow(
            rank=r["rank"],
            state=state,
            last_output=r["state"],
            gpu=r.get("gpu", ""),
            healed=getattr(cluster, "healed", {}).get(r["rank"], 0),
        )
    st.verdict = cluster.dead_note() or None
    return st
