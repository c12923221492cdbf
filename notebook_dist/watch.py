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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from .doctor import Diagnosis, diagnose
from .doctor.facts import TRANSPORT_ERROR
from .doctor.facts import call_text as _call_text
from .execute import OutputStreamer, PreparedCell
from .phrases import rank_list
from .values import unpack


@dataclass
class RankView:
    """What the kernel knows of one rank during a cell."""

    rank: int
    status: str = "running"  # running, done, error, dead
    snap: dict = field(default_factory=dict)
    result: dict | None = None
    exit: str | None = None
    released: bool = False
    #: its snapshot when it was released (what it waited in): the final verdict reads it
    before_release: dict | None = None
    dead_at: float | None = None  # when the kernel found its process gone
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
        self.interrupted = False
        #: how a stopped cell ended ("released rank 0 ...; every rank kept its variables")
        self.outcome: str | None = None
        #: the verdict the record under the cell keeps (None for a cell that ran cleanly)
        self.final: Diagnosis | None = None

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
            snap = v.snap  # (kept: the last running snapshot, if the rank ends now)
            if v.status == "running":
                if r in dead:
                    v.status, v.exit = "dead", dead[r]
                    v.dead_at = time.time()
                elif fut.done():
                    try:
                        reply = fut.result()
                        if isinstance(reply, BaseException):  # our rank side failed itself
                            raise reply
                        v.result = unpack(reply)
                        v.status = "error" if v.result["status"] == "error" else "done"
                        # the rank's final record, even if it finished before its agent reported
                        v.snap = dict(v.result.get("final") or {}, collective=None)
                        if v.status == "error" and self._failed_by_release(v):
                            self.released.add(r)
                            v.released = True
                            v.before_release = snap or None
                    except Exception as exc:  # engine-level failure
                        v.status = "error"
                        v.result = {"status": "error", "error": engine_error(exc)}
            fp = (
                v.status,
                v.snap.get("collectives_done"),
                v.snap.get("p2p_done"),
                len(v.snap.get("p2p_pending") or ()),
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

    def doctor_input(self, before_release: bool = False) -> dict[int, dict]:
        """What the doctor reads; ``before_release``: a released rank as it was when it was
        released (waiting), not as its released collective ended."""
        out = {}
        timed = self.timed_out() if before_release else {}
        for r, v in self.views.items():
            info: dict[str, Any] = {"status": v.status, "snap": v.snap}
            if before_release and v.released:
                info = {"status": "running", "snap": v.before_release or v.snap}
                out[r] = info
                continue
            if r in timed:  # as it was while it waited, before torch's timeout ended the wait
                rec = {k: x for k, x in timed[r].items() if k not in ("t1", "failed")}
                same = (rec.get("group"), rec.get("seq"))
                history = [
                    h for h in v.snap.get("history") or [] if (h.get("group"), h.get("seq")) != same
                ]
                out[r] = {
                    "status": "running",
                    "snap": dict(v.snap, collective=rec, history=history),
                }
                continue
            if v.status == "dead":
                info["exit"] = v.exit
                info["found_dead"] = v.dead_at
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

    def diagnose(self, before_release: bool = False) -> Diagnosis:
        self.diagnosis = diagnose(
            self.doctor_input(before_release),
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
        from_collective = error.get("collective") or TRANSPORT_ERROR.search(error.get("evalue", ""))
        return bool(from_collective) and ended >= self.release_time

    def release(self, ranks: list[int]) -> None:
        if self.release_time is None:
            self.release_time = time.time()
        for r in ranks:
            self.released.add(r)
            self.views[r].released = True
            self.views[r].before_release = dict(self.views[r].snap)
        self.cluster.release_collectives(ranks, self.token)

    def finish(self) -> None:
        self.streamer.finish()

    # ---- the cell's life ------------------------------------------------------------

    def run_to_end(self) -> None:
        """Poll until every rank finished. Ctrl-C interrupts the ranks, then raises
        :class:`~notebook_dist.errors.CellInterrupted` (one short line, not a traceback
        through the kernel)."""
        from .errors import CellInterrupted, HangError

        try:
            try:
                while self.running() and not self.abandoned:
                    self.ar.wait(0.05)
                    self.poll()
            except _StopHung:
                verdict = self.shown_verdict
                self.interrupt(quiet=True)
                raise HangError(verdict) from None
            except KeyboardInterrupt:
                self.interrupt()
                raise CellInterrupted(self._interrupted_line()) from None
            finally:
                # every rank's output arrives before the cell ends (its iopub 'idle'); a big
                # output on a busy machine can take seconds, a dead rank never says idle
                if not self.running():
                    dead = any(v.status == "dead" for v in self.views.values())
                    self.ar.wait_for_output(1 if dead else 15)
                self.finish()
            if not any(v.status == "dead" for v in self.views.values()):
                if self.released:
                    self.rebuild_after_release()
                else:
                    self.rebuild_broken_group()
        finally:
            self.final = self.final_diagnosis()

    def _interrupted_line(self) -> str:
        stuck = self.running()
        if stuck:
            return f"the cell was interrupted; {_ranks(stuck)} did not stop (see above)"
        return f"the cell was interrupted on {_ranks(self.ranks)}; every rank kept its variables"

    def final_diagnosis(self) -> Diagnosis | None:
        """What the record under a stopped cell keeps: the verdict on the ranks as they were
        when the hang showed, the ranks were released or interrupted, or torch's timeout
        ended a collective, and how it ended."""
        if not (self.shown_verdict or self.released or self.interrupted or self.timed_out()):
            return None
        diag = self.diagnose(before_release=True)
        if self.outcome:
            diag.verdict += f" {self.outcome}"
        return diag

    def _wait_until(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            self.ar.wait(0.05)
            self.poll()

    def interrupt(self, quiet: bool = False) -> None:
        """Interrupt Python on every rank; release those blocked in collectives."""
        self.interrupted = True
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
            self.outcome = (
                f"Interrupted: {_ranks(stuck)} did not stop (inside code that ignores interrupts). "
                "%dist_restart replaces the ranks; add --replay to re-run your setup cells."
            )
            stream.write(f"notebook_dist: {self.outcome}\n")
        elif self.released:
            self.rebuild_after_release()
        else:
            self.outcome = "Interrupted; every rank is idle and kept its variables."
            if not quiet:
                stream.write(
                    "notebook_dist: interrupted; every rank is idle and kept its variables.\n"
                )
        stream.flush()

    def rebuild_after_release(self) -> None:
        from .errors import ClusterError

        stream = self.streamer._stream("stdout")
        try:
            took = self.cluster.rebuild_process_group()
        except ClusterError as exc:
            self.outcome = (
                f"The process group could not be rebuilt ({exc}); the next cell tries again "
                "(%dist_restart starts fresh ranks)."
            )
            stream.write(f"notebook_dist: {self.outcome[0].lower()}{self.outcome[1:]}\n")
            return
        self.outcome = (
            f"Released {_ranks(self.released)} from collectives that could not complete; every "
            "rank kept its variables and the process group was rebuilt."
        )
        stream.write(
            f"notebook_dist: released {_ranks(self.released)} from "
            f"collectives that could not complete; every rank kept its variables and the process group "
            f"was rebuilt ({took:.2f} s). Process groups you made with new_group() must be made again.\n"
        )
        stream.flush()

    # ---- a group that broke under the cell ------------------------------------------

    def broken(self) -> dict[int, dict]:
        """Ranks whose default group broke in this cell: rank -> {"kind", "why"}."""
        return {
            r: v.result["group_broken"]
            for r, v in self.views.items()
            if v.result and v.result.get("group_broken")
        }

    def timed_out(self) -> dict[int, dict]:
        """Ranks whose collective torch's own timeout ended: rank -> that collective's record."""
        out = {}
        for r, why in self.broken().items():
            rec = (self.views[r].result.get("error") or {}).get("record")
            if why.get("kind") == "timeout" and rec:
                out[r] = rec
        return out

    def rebuild_broken_group(self) -> None:
        """The group broke under the cell (torch's timeout ended a collective, or a peer's
        connections closed): say why in plain words, rebuild it with every rank's variables
        kept, so the next cell works (a rebuild that fails is tried before the next cell)."""
        broken = self.broken()
        if not broken:
            return
        from .errors import ClusterError

        stream = self.streamer._stream("stdout")
        timed = self.timed_out()
        if timed:
            ended = " and ".join(
                f"{rec['op']} #{rec.get('seq', '?')} at {_call_text(rec, self.prepared.filename)} "
                f"on rank {r}, after {max(0.0, rec.get('t1', 0) - rec.get('t0', 0)):.1f} s"
                for r, rec in sorted(timed.items())
            )
            why = self.diagnose(before_release=True).verdict
            said = (
                f"torch's collective timeout ({self.cluster.config.timeout_s:g} s, %dist_init "
                f"--timeout) ended {ended} of waiting. Why it waited: {why}"
            )
        else:
            said = (
                "the process group broke in this cell ("
                + "; ".join(f"rank {r}: {b['why']}" for r, b in sorted(broken.items()))
                + ")."
            )
        try:
            took = self.cluster.rebuild_process_group()
        except ClusterError as exc:
            self.outcome = (
                f"{said} Rebuilding the process group failed ({exc}); the next cell tries again "
                "(%dist_restart starts fresh ranks)."
            )
        else:
            self.outcome = (
                f"{said} The process group could not be used any more; it was rebuilt "
                f"({took:.2f} s) and every rank kept its variables."
            )
        stream.write(f"notebook_dist: {self.outcome}\n")
        stream.flush()


class _StopHung(KeyboardInterrupt):
    """Internal: ends the watch loop like Ctrl-C would, after a diagnosis (--on-hang stop)."""


def engine_error(exc: BaseException) -> dict[str, str]:
    """A failure of the rank's own machinery rather than of the cell, as the cell's error.
    An ipyparallel RemoteError carries the rank's exception and its traceback: a bug of
    ours, or a torch API this torch lacks, then reads as itself."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None) or str(exc)
    return {
        "ename": ename,
        "evalue": evalue,
        "traceback": getattr(exc, "traceback", None) or f"{ename}: {evalue}",
    }


_ranks = rank_list


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
