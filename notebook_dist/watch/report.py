"""What a watched cell says in the notebook, as it happens: a hang's diagnosis with every
rank's stack, a release and the rebuilt group, an interrupt, a group torch's timeout broke.

Each method writes one block to the cell's output and returns the sentence the cell's
record keeps (``CellWatch.outcome``)."""

from __future__ import annotations

from typing import TextIO

from ..doctor import Diagnosis, format_stacks
from ..doctor.words import call_text
from ..phrases import rank_list


class Reporter:
    def __init__(self, stream: TextIO, cell_file: str, config=None):
        self.stream = stream
        self.cell_file = cell_file
        # every rank's row in a hang's table, however many (DistConfig.dashboard_full_table)
        self.full_table = bool(config and config.dashboard_full_table)

    def line(self, text: str) -> None:
        self._say(text + "\n")

    def _say(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def hang(self, diag: Diagnosis, waited_s: float, stopping: str | None, snaps: dict) -> None:
        """The live verdict: the cell goes on, or stops (``stopping`` says why)."""
        tail = (
            f"stopping the cell ({stopping})"
            if stopping
            else "the cell keeps running; interrupt to stop it"
        )
        # every rank's stack, now: the kernel is busy with this cell, so %dist_stacks
        # could only run after it; the same stacks stay available to it then
        self._say(
            f"\nnotebook_dist: no rank has made progress for {waited_s:.0f} s ({tail})\n"
            f"{diag.text(self.full_table)}\nStacks (innermost last):\n"
            f"{format_stacks(snaps, self.cell_file)}\n\n"
        )

    def released(self, ranks, took_s: float, groups: str = "") -> str:
        gone = f" {groups}" if groups else ""
        self._say(
            f"notebook_dist: released {rank_list(ranks)} from collectives that could not "
            "complete; every rank kept its variables and the process group was rebuilt "
            f"({took_s:.2f} s).{gone}\n"
        )
        return (
            f"Released {rank_list(ranks)} from collectives that could not complete; every "
            f"rank kept its variables and the process group was rebuilt.{gone}"
        )

    def rebuild_failed(self, why: str, said: str = "") -> str:
        outcome = (
            f"{said}{' ' if said else ''}The process group could not be rebuilt ({why}); the "
            "next cell tries again (%dist_restart starts fresh ranks)."
        )
        self._say(f"notebook_dist: {outcome[0].lower()}{outcome[1:]}\n")
        return outcome

    def interrupted(self, stuck: list[int], quiet: bool) -> str:
        if stuck:
            outcome = (
                f"Interrupted: {rank_list(stuck)} did not stop (inside code that ignores "
                "interrupts). %dist_restart replaces the ranks; add --replay to re-run your "
                "setup cells."
            )
            self._say(f"notebook_dist: {outcome}\n")
            return outcome
        if not quiet:
            self._say("notebook_dist: interrupted; every rank is idle and kept its variables.\n")
        return "Interrupted; every rank is idle and kept its variables."

    def broke(
        self,
        timed: dict[int, dict],
        broken: dict[int, dict],
        timeout_s: float,
        why: str | None,
    ) -> str:
        """Why the group broke in plain words: torch's timeout (which rank waited in which
        collective, where, for how long, and ``why``, the doctor's verdict), or the error."""
        if timed:
            ended = " and ".join(
                f"{rec['op']} #{rec.get('seq', '?')} at {call_text(rec, self.cell_file)} on "
                f"rank {r}, after {max(0.0, rec.get('t1', 0) - rec.get('t0', 0)):.1f} s"
                for r, rec in sorted(timed.items())
            )
            return (
                f"torch's collective timeout ({timeout_s:g} s, %dist_init --timeout) ended "
                f"{ended} of waiting. Why it waited: {why}"
            )
        return (
            "the process group broke in this cell ("
            + "; ".join(f"rank {r}: {b['why']}" for r, b in sorted(broken.items()))
            + ")."
        )

    def rebuilt_broken(self, said: str, took_s: float, groups: str = "") -> str:
        outcome = (
            f"{said} The process group could not be used any more; it was rebuilt "
            f"({took_s:.2f} s) and every rank kept its variables."
            + (f" {groups}" if groups else "")
        )
        self._say(f"notebook_dist: {outcome}\n")
        return outcome

    def stuck_line(self, stuck: list[int], ranks: list[int]) -> str:
        """The one line a Ctrl-C ends the cell with (CellInterrupted)."""
        if stuck:
            return f"the cell was interrupted; {rank_list(stuck)} did not stop (see above)"
        return f"the cell was interrupted on {rank_list(ranks)}; every rank kept its variables"
