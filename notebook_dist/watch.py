"""Watching a running cell from the kernel: output, per-rank state, hangs, release.

One :class:`CellWatch` per cell. Each poll it copies new output, reads the latest agent
snapshot of every rank, notes which ranks finished (and how), and decides:

- no progress on any rank for ``hang_after`` seconds: show the doctor's diagnosis, live,
  without ending the cell;
- a rank raised or died while others wait in a collective: release the waiting ranks
  (their collectives raise at once) so the cell ends in seconds. A rank whose collective
  then fails because a released peer closed its connections counts as released too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from .doctor import Diagnosis, diagnose
from .execute import OutputStreamer, PreparedCell
from .values import unpack

# how a collective fails when a peer's connections close under it (torch-internal ones,
# such as DDP's gradient all_reduce, never pass the tracker)
_TRANSPORT_ERROR = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe", re.IGNORECASE
)


@dataclass
class RankView:
    """What the kernel knows of one rank during a cell."""

    rank: int
    status: str = "running"  # running, done, error, dead
    snap: dict = field(default_factory=dict)
    result: dict | None = None
    exit: str | None = None
    released: bool = False
    fingerprint: tuple = ()


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
        on_update: Callable[[CellWatch], None] | None = None,
    ):
        self.cluster = cluster
        self.ar = ar
        self.ranks = ranks
        self.prepared = prepared
        # each rank's message metadata (output, agent snapshots), as the AsyncResult bound
        # it when it sent the request. Not client.metadata[msg_id]: ipyparallel drops that
        # entry once the reply and output are in, and a fast cell can get there before
        # this line runs; the lookup would then make a fresh, empty entry and every line
        # the cell printed would be lost.
        self.metadata = list(ar._metadata)
        self.futures = list(ar._children)  # one per rank, in rank order
        self.streamer = OutputStreamer(
            list(zip(ranks, self.metadata)), out, err, log_name=prepared.filename
        )
        self.out = out
        self.hang_after = hang_after
        self.on_update = on_update
        self.views = {r: RankView(r) for r in ranks}
        self.started = time.time()
        self.last_progress = time.monotonic()
        self.diagnosis: Diagnosis | None = None
        self.shown_verdict: str | None = None
        self.released: set[int] = set()
        self.release_time: float | None = None  # when the first release was asked for
        self.error_since: float | None = None
        self.interrupted_for_death = False
        self.abandoned = False  # stop waiting: a rank died and the others do not stop
        #: the ranks' snapshots when the hang was shown or the cell interrupted
        self.frozen: dict[int, dict] | None = None
        self.token = ""  # the cell's id on the ranks: releases name it
        self.hang_action = "show"  # or "stop": end the cell once a hang is diagnosed

    # ---- state ----------------------------------------------------------------------

    def poll(self) -> None:
        self.streamer.poll()
        progressed = False
        dead = self.cluster.dead_ranks()
        for r, md, fut in zip(self.ranks, self.metadata, self.futures):
            v = self.views[r]
            snap = (md.get("data") or {}).get("nd")
            if v.status == "running" and snap and snap.get("cell_started", 0) >= self.started - 5:
                v.snap = snap
            if v.status == "running":
                if r in dead:
                    v.status, v.exit = "dead", dead[r]
                elif fut.done():
                    try:
                        v.result = unpack(fut.result())
                        v.status = "error" if v.result["status"] == "error" else "done"
                        # the rank's final record, even if it finished before its agent reported
                        v.snap = dict(v.result.get("final") or {}, collective=None)
                        if v.status == "error" and self._failed_by_release(v):
                            self.released.add(r)
                            v.released = True
                    except Exception as exc:  # engine-level failure
                        v.status = "error"
                        v.result = {
                            "status": "error",
                            "error": {
                                "ename": type(exc).__name__,
                                "evalue": str(exc),
                                "traceback": str(exc),
                            },
                        }
            fp = (
                v.status,
                v.snap.get("collectives_done"),
                (v.snap.get("collective") or {}).get("seq"),
                tuple((f["file"], f["line"]) for f in v.snap.get("stack", [])[-3:]),
                v.snap.get("reports"),
                len(md.get("stdout") or "") + len(md.get("stderr") or ""),
            )
            if fp != v.fingerprint:
                v.fingerprint = fp
                progressed = True
        now = time.monotonic()
        if progressed:
            self.last_progress = now
        self._maybe_release(now)
        if now - self.last_progress >= self.hang_after and self.running():
            self.show_diagnosis()
        if self.on_update is not None:
            self.on_update(self)

    def running(self) -> list[int]:
        return [r for r, v in self.views.items() if v.status == "running"]

    def doctor_input(self) -> dict[int, dict]:
        out = {}
        for r, v in self.views.items():
            info: dict[str, Any] = {"status": v.status, "snap": v.snap}
            if v.status == "dead":
                info["exit"] = v.exit
                info.update(self.cluster.fault_report(r))
            if v.status == "error" and v.result:
                e = v.result["error"]
                info["error"] = (
                    e["ename"],
                    e["evalue"],
                    _error_line(e.get("traceback", ""), self.prepared.filename),
                )
            out[r] = info
        return out

    def diagnose(self) -> Diagnosis:
        self.diagnosis = diagnose(
            self.doctor_input(),
            now=time.time(),
            cell_file=self.prepared.filename,
            source=self.prepared.source,
            first_line=self.prepared.first_line,
        )
        return self.diagnosis

    def freeze(self) -> None:
        self.frozen = {r: dict(v.snap) for r, v in self.views.items()}

    def show_diagnosis(self) -> None:
        self.freeze()
        diag = self.diagnose()
        if diag.verdict == self.shown_verdict:
            return
        self.shown_verdict = diag.verdict
        stream = self.streamer._stream("stdout")
        waited = time.monotonic() - self.last_progress
        tail = (
            "stopping the cell (--on-hang stop)"
            if self.hang_action == "stop"
            else "the cell keeps running; interrupt to stop it"
        )
        stream.write(f"\nnotebook_dist: no rank has made progress for {waited:.0f} s ({tail})\n")
        stream.write(diag.text() + "\n")
        from .doctor import format_stacks

        # every rank's stack, now: the kernel is busy with this cell, so %dist_stacks
        # could only run after it; the same stacks stay available to it then
        stream.write(
            "Stacks (innermost last):\n"
            + format_stacks(self.frozen, self.prepared.filename)
            + "\n\n"
        )
        stream.flush()
        if self.hang_action == "stop":
            raise _StopHung()

    # ---- release --------------------------------------------------------------------

    def _maybe_release(self, now: float) -> None:
        failed = [r for r, v in self.views.items() if v.status in ("error", "dead")]
        running = self.running()
        if not failed or not running:
            self.error_since = None
            return
        if self.error_since is None:
            self.error_since = now
        stuck = [r for r in running if self.views[r].snap.get("collective")]
        if now - self.last_progress >= self.cluster.config.release_after_error_s:
            stuck = running
        to_release = [r for r in stuck if r not in self.released]
        if to_release:
            self.release(to_release)
        if any(self.views[r].status == "dead" for r in failed):
            # the cell cannot succeed without the dead rank: stop the others too
            waited = now - self.error_since
            if (
                waited >= self.cluster.config.release_after_error_s
                and not self.interrupted_for_death
            ):
                self.interrupted_for_death = True
                self.cluster.interrupt(running)
            if waited >= self.cluster.config.release_after_error_s + 5.0:
                self.abandoned = True

    def _failed_by_release(self, v: RankView) -> bool:
        """A rank whose collective failed after others were released: their connections
        closed under it, so its error is a consequence of the release, not a second cause."""
        if self.release_time is None or v.released:
            return False
        error = v.result.get("error") or {}
        ended = (v.result.get("final") or {}).get("time", 0.0)
        from_collective = error.get("collective") or _TRANSPORT_ERROR.search(
            error.get("evalue", "")
        )
        return bool(from_collective) and ended >= self.release_time

    def release(self, ranks: list[int]) -> None:
        if self.release_time is None:
            self.release_time = time.time()
        for r in ranks:
            self.released.add(r)
            self.views[r].released = True
        self.cluster.release_collectives(ranks, self.token)

    def finish(self) -> None:
        self.streamer.finish()

    # ---- the cell's life ------------------------------------------------------------

    def run_to_end(self) -> None:
        """Poll until every rank finished; Ctrl-C interrupts the ranks, then re-raises."""
        try:
            while self.running() and not self.abandoned:
                self.ar.wait(0.05)
                self.poll()
        except _StopHung:
            verdict = self.shown_verdict
            self.interrupt(quiet=True)
            from .errors import HangError

            raise HangError(verdict) from None
        except KeyboardInterrupt:
            self.interrupt()
            raise
        finally:
            # every rank's output arrives before the cell ends (its iopub 'idle'); a big
            # output on a busy machine can take seconds, a dead rank never says idle
            if not self.running():
                dead = any(v.status == "dead" for v in self.views.values())
                self.ar.wait_for_output(1 if dead else 15)
            self.finish()
        if self.released and not any(v.status == "dead" for v in self.views.values()):
            self.rebuild_after_release()

    def _wait_until(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            self.ar.wait(0.05)
            self.poll()

    def interrupt(self, quiet: bool = False) -> None:
        """Interrupt Python on every rank; release those blocked in collectives."""
        stream = self.streamer._stream("stdout")
        if self.frozen is None:
            self.freeze()
        self.cluster.interrupt(self.running())
        self._wait_until(1.0)
        if self.running():
            self.release(self.running())
            self._wait_until(3.0)
        if self.running():
            self.cluster.interrupt(self.running())  # a rank released into Python code
            self._wait_until(1.0)
        self.finish()
        stuck = self.running()
        if stuck:
            stream.write(
                f"notebook_dist: rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} did not stop "
                "(inside code that ignores interrupts). %dist_restart replaces the ranks; add --replay to re-run "
                "your setup cells.\n"
            )
        elif self.released:
            self.rebuild_after_release()
        elif not quiet:
            stream.write("notebook_dist: interrupted; every rank is idle and kept its variables.\n")
        stream.flush()

    def rebuild_after_release(self) -> None:
        from .errors import ClusterError

        stream = self.streamer._stream("stdout")
        try:
            took = self.cluster.rebuild_process_group()
        except ClusterError as exc:
            stream.write(
                f"notebook_dist: the process group could not be rebuilt ({exc}); run %dist_restart.\n"
            )
            return
        who = ", ".join(map(str, sorted(self.released)))
        stream.write(
            f"notebook_dist: released rank{'s' if len(self.released) > 1 else ''} {who} from "
            f"collectives that could not complete; every rank kept its variables and the process group "
            f"was rebuilt ({took:.2f} s). Process groups you made with new_group() must be made again.\n"
        )
        stream.flush()


class _StopHung(KeyboardInterrupt):
    """Internal: ends the watch loop like Ctrl-C would, after a diagnosis (--on-hang stop)."""


def _error_line(traceback_text: str, filename: str) -> int | None:
    """The last line number of ``filename`` in a formatted traceback."""
    line = None
    marker = f'File "{filename}", line '
    for part in traceback_text.splitlines():
        part = part.strip()
        if part.startswith(marker):
            try:
                line = int(part[len(marker) :].split(",", 1)[0])
            except ValueError:
                pass
    return line
