"""The doctor's verdicts on one watched cell: shown live when it hangs, and the one its
record keeps once it ended (on the ranks as they were when it hung or was stopped)."""

from __future__ import annotations

import time

from ..doctor import Diagnosis, diagnose
from .inputs import doctor_input, timed_out


class Verdicts:
    def __init__(self, cluster, views: dict, prepared, report):
        self.cluster = cluster  # its fault report (a rank Gloo aborted) is read at each verdict
        self.views = views
        self.prepared = prepared
        self.report = report
        self.diagnosis: Diagnosis | None = None
        self.shown: str | None = None  # the verdict shown live, if any
        #: the ranks' snapshots when the hang was shown or the cell interrupted
        self.frozen: dict[int, dict] | None = None

    def freeze(self, again: bool = False) -> None:
        if again or self.frozen is None:
            self.frozen = {r: dict(v.snap) for r, v in self.views.items()}

    def diagnose(self, before_release: bool = False) -> Diagnosis:
        self.diagnosis = diagnose(
            doctor_input(
                self.views, self.prepared.filename, self.cluster.fault_report, before_release
            ),
            now=time.time(),
            cell_file=self.prepared.filename,
            source=self.prepared.source,
            first_line=self.prepared.first_line,
            healable=self.cluster.processes.spares_possible(),
        )
        return self.diagnosis

    def show(self, waited: float, stopping: str | None) -> bool:
        """The verdict on a hang, said once (again only when it changes); True when said."""
        self.freeze(again=True)
        diag = self.diagnose()
        if diag.verdict == self.shown:
            return False
        self.shown = diag.verdict
        self.report.hang(diag, waited, stopping, self.frozen)
        return True

    def final(self, stopped: bool, outcome: str | None) -> Diagnosis | None:
        """What the record under a cell keeps: None for a cell that ran its course; the
        verdict on the ranks as they were, and how it ended (``outcome``), for one that was
        shown hung, ``stopped`` (released, interrupted) or ended by torch's timeout."""
        if not (self.shown or stopped or timed_out(self.views)):
            return None
        diag = self.diagnose(before_release=True)
        if outcome:
            diag.verdict += f" {outcome}"
        return diag
