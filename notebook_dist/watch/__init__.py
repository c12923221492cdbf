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
from ..displays import cell_request
from ..doctor import Diagnosis
from ..execute import PreparedCell
from ..output import OutputStreamer
from . import aftermath, policy
from .progress import Progress, RankView, engine_error
from .releases import Releases
from .report import Reporter
from .verdicts import Verdicts
from .view import WatchView

__all__ = ["CellWatch", "RankView", "WatchView", "engine_error"]

#: how long one wait for the ranks' replies lasts between two polls (seconds)
POLL_S = 0.05


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
        metadata = list(ar._metadata)  # (as the call bound them: Progress says why)
        self.progress = Progress(ranks, metadata, list(ar._children), token)
        self.views = self.progress.views
        self.streamer = _streamer(ranks, metadata, out, err, prepared, self.config, raw_output)
        self.report = Reporter(self.streamer.stdout_stream(), prepared.filename, self.config)
        # ranks that ask for a line (a debugger, input()): asked of the notebook's user
        self.console = Console(cluster, self.report.line, answers=answers)
        self.releases = Releases(cluster, self.views, token)
        self.released = self.releases.released  # the ranks released from their collectives
        self.verdicts = Verdicts(cluster, self.views, prepared, self.report)
        self.started = time.time()
        self.interrupted = False
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
        ended = self.progress.poll(self.cluster.dead_ranks)
        self._serve_prompts()
        self.releases.note_ended(ended)
        now = time.monotonic()
        self.releases.apply(now, self.progress.last_progress, self.config)
        waited = now - self.progress.last_progress
        if waited >= self.hang_after and self.running():
            hang = policy.on_hang(waited, self.hang_action, self.config, self.interrupted)
            if self.verdicts.show(waited, hang.stop) and hang.stop or hang.stuck:
                raise _StopHung(hang.said)
        if self.on_update is not None:
            self.on_update(self.view())

    def _serve_prompts(self) -> None:
        """A rank that asks (its debugger, input()) is answered through the notebook; a
        rank at a prompt is not hung."""
        if self.interrupted or not self.progress.asking():
            return
        self.console.serve(self.views, before=self._show_all)
        self.progress.last_progress = time.monotonic()
        if self.console.quit_by is not None:
            raise _Quit()

    def _show_all(self) -> None:
        self.streamer.poll(whole=True)  # what the ranks printed before one asked, first
        if self.on_update is not None:
            self.on_update(self.view())  # the dashboard shows who asks before the prompt

    # ---- the cell's life -------------------------------------------------------------

    def run_to_end(self) -> None:
        """Poll until every rank finished. Ctrl-C interrupts the ranks, then raises
        :class:`~notebook_dist.errors.CellInterrupted` (one short line, not a traceback
        through the kernel)."""
        from ..errors import CellInterrupted, HangError

        try:
            try:
                while self.running() and not self.releases.abandoned:
                    self.ar.wait(POLL_S)
                    self.poll()
            except _StopHung as stop:
                self.interrupt(quiet=True)
                raise HangError(f"{stop}{self.verdicts.shown}") from None
            except _Quit:
                self.console.quit_all(self.views)
                self.interrupt(quiet=True)
                raise CellInterrupted(
                    f"the debugger was quit on rank {self.console.quit_by}; every rank kept "
                    "its variables"
                ) from None
            except KeyboardInterrupt:
                self.interrupt()
                raise CellInterrupted(self.report.stuck_line(self.running(), self.ranks)) from None
            finally:
                self._last_output()
            if not any(v.status == "dead" for v in self.views.values()):
                if self.released:
                    self.rebuild_after_release()
                else:
                    self.outcome = aftermath.after_broken_group(self) or self.outcome
        finally:
            self.final = self.verdicts.final(bool(self.released or self.interrupted), self.outcome)
            forget = getattr(self.ar, "forget", None)  # (what an express call kept)
            if forget is not None:
                forget(late=self.streamer.late_output(cell_request()))

    def _last_output(self) -> None:
        """Every rank's output before the cell ends (its 'idle'; never a dead rank's)."""
        if self.running():  # given up on: one more look, so a rank that died is named
            self.progress.poll(self.cluster.dead_ranks)
        if not self.running():
            dead = any(v.status == "dead" for v in self.views.values())
            self.ar.wait_for_output(
                self.config.output_grace_dead_s if dead else self.config.output_grace_s
            )
        self.streamer.finish()

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            self.ar.wait(POLL_S)
            self.poll()

    def interrupt(self, quiet: bool = False) -> None:
        """Interrupt Python on every rank; release those blocked in collectives."""
        self.interrupted = True
        self.verdicts.freeze()
        stuck = self.cluster.stop_ranks(self.running, self.wait, self.releases.release, self.config)
        self.streamer.finish()
        if stuck or not self.released:
            self.outcome = self.report.interrupted(stuck, quiet)
        else:
            self.rebuild_after_release()

    def rebuild_after_release(self) -> None:
        self.outcome = aftermath.after_release(self)


def _streamer(ranks, metadata, out, err, prepared, config, raw_output) -> OutputStreamer:
    from ..ui import widgets_available

    return OutputStreamer(
        list(zip(ranks, metadata)),
        out,
        err,
        log_name=prepared.filename,
        fold_from=0 if raw_output else config.fold_from_ranks,
        fold_window_s=config.fold_window_s,
        live=widgets_available(),
    )


class _Quit(Exception):
    """Internal: q in a rank's debugger ends the cell as an interrupt does."""


class _StopHung(KeyboardInterrupt):
    """Internal: ends the watch loop like Ctrl-C would, after a diagnosis (--on-hang stop)."""
