"""Watching a running cell from the kernel: one :class:`CellWatch` per cell, a small
coordinator over one module per job.

- ``progress``: each rank's view (snapshot, reply, death) and when any rank last moved;
- ``policy``: when to release ranks left waiting by a rank that raised or died (pure);
- ``inputs``: the doctor's input from the views;
- ``report``: what the cell says as it happens;
- ``view``: a read-only view for the dashboard, the magics and callbacks.

The interrupt's escalation (interrupt, release, interrupt again) is a recovery step:
``notebook_dist.cluster.recovery.stop_ranks``, which the watch asks its cluster for.

Each poll: new output is copied, the views updated; no progress on any rank for
``hang_after`` seconds shows the doctor's verdict live (the cell goes on); a rank that
raised or died gets the others released, so the cell ends in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from ..console import Console
from ..doctor import Diagnosis, diagnose
from ..doctor.facts import TRANSPORT_ERROR
from ..execute import PreparedCell
from ..output import OutputStreamer
from . import aftermath, policy
from .inputs import doctor_input, timed_out
from .progress import Progress, RankView, engine_error
from .report import Reporter
from .view import WatchView

__all__ = ["CellWatch", "RankView", "WatchView", "engine_error"]


class CellWatch:
    def __init__(
        self,
        cluster,
        ar,
        ranks: list[int],
        prepared: PreparedCell,
        out: TextIO | None,
        err: TextIO | None,
        hang_after: float,
        on_update: Callable[[WatchView], None] | None = None,
        token: str = "",
        hang_action: str = "show",
        raw_output: bool = False,
        answers: list[str] | tuple[str, ...] = (),
    ):
        self.cluster = cluster
        self.config = cluster.config
        self.ar = ar
        self.ranks = ranks
        self.prepared = prepared
        self.token = token  # the cell's id on the ranks: releases name it
        self.hang_action = hang_action  # "show", or "stop": end the cell at a verdict
        self.hang_after = hang_after
        self.on_update = on_update
        # each rank's message metadata (output, agent snapshots) as the AsyncResult bound it
        # when it sent the request, not client.metadata[msg_id]: ipyparallel drops that entry
        # once the reply and output are in, and a fast cell can get there before this runs
        metadata = list(ar._metadata)
        self.progress = Progress(ranks, metadata, list(ar._children), token)
        self.views = self.progress.views
        from ..ui import widgets_available

        self.streamer = OutputStreamer(
            list(zip(ranks, metadata)),
            out,
            err,
            log_name=prepared.filename,
            fold_from=0 if raw_output else self.config.fold_from_ranks,
            fold_window_s=self.config.fold_window_s,
            live=widgets_available(),
        )
        self.report = Reporter(self.streamer.stdout_stream(), prepared.filename)
        # ranks that ask for a line (a debugger, input()): asked of the notebook's user
        self.console = Console(cluster, self.report.line, answers=answers)
        self.started = time.time()
        self.diagnosis: Diagnosis | None = None
        self.shown_verdict: str | None = None
        self.released: set[int] = set()
        self.release_time: float | None = None  # when the first release was asked for
        self.error_since: float | None = None
        self.interrupted_for_death = self.abandoned = self.interrupted = False
        #: the ranks' snapshots when the hang was shown or the cell interrupted
        self.frozen: dict[int, dict] | None = None
        #: how a stopped cell ended ("released rank 0 ...; every rank kept its variables")
        self.outcome: str | None = None
        #: the verdict the record under the cell keeps (None for a cell that ran cleanly)
        self.final: Diagnosis | None = None

    def view(self) -> WatchView:
        return WatchView(self)

    def running(self) -> list[int]:
        return self.progress.running()

    # ---- one poll --------------------------------------------------------------------

    def poll(self) -> None:
        self.streamer.poll()
        ended = self.progress.poll(self.cluster.dead_ranks())
        asking = any(v.snap.get("asking") for v in self.views.values() if v.status == "running")
        if asking and not self.interrupted:
            self.streamer.poll()  # what the rank printed before it asked, first
            self.console.serve(self.views)
            self.progress.last_progress = time.monotonic()  # at a prompt is not a hang
            if self.console.quit_by is not None:
                raise _Quit()
        for r in ended:
            v = self.views[r]
            if v.status == "error" and policy.failed_by_release(
                v, self.release_time, TRANSPORT_ERROR
            ):
                self.released.add(r)
                v.released, v.before_release = True, v.running_snap or None
        now = time.monotonic()
        self._apply_policy(now)
        if now - self.progress.last_progress >= self.hang_after and self.running():
            self.show_diagnosis()
        if self.on_update is not None:
            self.on_update(self.view())

    def _apply_policy(self, now: float) -> None:
        failing = any(v.status in ("error", "dead") for v in self.views.values())
        self.error_since = (self.error_since or now) if failing and self.running() else None
        decision = policy.decide(
            policy.situation(
                self.views,
                now,
                self.progress.last_progress,
                self.error_since,
                self.released,
                self.interrupted_for_death,
            ),
            self.config.release_after_error_s,
            self.config.abandon_after_death_s,
        )
        if decision.release:
            self.release(list(decision.release))
        if decision.interrupt:
            self.interrupted_for_death = True
            self.cluster.interrupt(list(decision.interrupt))
        self.abandoned = self.abandoned or decision.abandon

    # ---- the doctor -------------------------------------------------------------------

    def diagnose(self, before_release: bool = False) -> Diagnosis:
        self.diagnosis = diagnose(
            doctor_input(
                self.views, self.prepared.filename, self.cluster.fault_report, before_release
            ),
            now=time.time(),
            cell_file=self.prepared.filename,
            source=self.prepared.source,
            first_line=self.prepared.first_line,
        )
        return self.diagnosis

    def show_diagnosis(self) -> None:
        self.frozen = {r: dict(v.snap) for r, v in self.views.items()}
        diag = self.diagnose()
        if diag.verdict == self.shown_verdict:
            return
        self.shown_verdict = diag.verdict
        stopping = self.hang_action == "stop"
        waited = time.monotonic() - self.progress.last_progress
        self.report.hang(diag, waited, stopping, self.frozen)
        if stopping:
            raise _StopHung()

    def final_diagnosis(self) -> Diagnosis | None:
        """What the record under a stopped cell keeps: the verdict on the ranks as they were
        when the hang showed, the ranks were released or interrupted, or torch's timeout
        ended a collective, and how it ended."""
        if not (self.shown_verdict or self.released or self.interrupted):
            if not timed_out(self.views):
                return None
        diag = self.diagnose(before_release=True)
        if self.outcome:
            diag.verdict += f" {self.outcome}"
        return diag

    # ---- the cell's life -------------------------------------------------------------

    def run_to_end(self) -> None:
        """Poll until every rank finished. Ctrl-C interrupts the ranks, then raises
        :class:`~notebook_dist.errors.CellInterrupted` (one short line, not a traceback
        through the kernel)."""
        from ..errors import CellInterrupted, HangError

        try:
            try:
                while self.running() and not self.abandoned:
                    self.ar.wait(0.05)
                    self.poll()
            except _StopHung:
                self.interrupt(quiet=True)
                raise HangError(self.shown_verdict) from None
            except _Quit:
                self.console.quit_all(self.views)
                self.interrupt(quiet=True)
                raise CellInterrupted(
                    f"the debugger was quit on rank {self.console.quit_by}; every rank kept "
                    "its variables"
                ) from None
            except KeyboardInterrupt:
                self.interrupt()
                stuck = self.running()
                raise CellInterrupted(self.report.stuck_line(stuck, self.ranks)) from None
            finally:
                # every rank's output arrives before the cell ends (its iopub 'idle'); a big
                # output on a busy machine can take seconds, a dead rank never says idle
                if not self.running():
                    dead = any(v.status == "dead" for v in self.views.values())
                    self.ar.wait_for_output(1 if dead else self.config.output_grace_s)
                self.streamer.finish()
            if not any(v.status == "dead" for v in self.views.values()):
                if self.released:
                    self.rebuild_after_release()
                else:
                    self.rebuild_broken_group()
        finally:
            self.final = self.final_diagnosis()

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            self.ar.wait(0.05)
            self.poll()

    def release(self, ranks: list[int]) -> None:
        if self.release_time is None:
            self.release_time = time.time()
        for r in ranks:
            self.released.add(r)
            self.views[r].released = True
            self.views[r].before_release = dict(self.views[r].snap)
        self.cluster.release_collectives(ranks, self.token)

    def interrupt(self, quiet: bool = False) -> None:
        """Interrupt Python on every rank; release those blocked in collectives."""
        self.interrupted = True
        if self.frozen is None:
            self.frozen = {r: dict(v.snap) for r, v in self.views.items()}
        stuck = self.cluster.stop_ranks(self.running, self.wait, self.release, self.config)
        self.streamer.finish()
        if stuck or not self.released:
            self.outcome = self.report.interrupted(stuck, quiet)
        else:
            self.rebuild_after_release()

    def rebuild_after_release(self) -> None:
        self.outcome = aftermath.after_release(self)

    def rebuild_broken_group(self) -> None:
        self.outcome = aftermath.after_broken_group(self) or self.outcome


class _Quit(Exception):
    """Internal: q in a rank's debugger ends the cell as an interrupt does."""


class _StopHung(KeyboardInterrupt):
    """Internal: ends the watch loop like Ctrl-C would, after a diagnosis (--on-hang stop)."""
