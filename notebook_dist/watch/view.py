"""A read-only view of a watched cell: what the dashboard, the magics and callbacks read,
instead of the watch's own workings."""

from __future__ import annotations

from ..doctor import Diagnosis, format_stacks


class WatchView:
    def __init__(self, watch):
        self._w = watch

    # ---- the cell ----------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return list(self._w.ranks)

    @property
    def views(self) -> dict:
        """rank -> RankView (data: read, do not change)."""
        return self._w.views

    @property
    def started(self) -> float:
        """When the cell was sent (the kernel's clock)."""
        return self._w.started

    @property
    def finished(self) -> bool:
        return not self._w.running()

    @property
    def cluster(self):
        return self._w.cluster

    @property
    def cell_file(self) -> str:
        return self._w.prepared.filename

    def last_lines(self) -> dict[int, str]:
        """Each rank's last line of output so far."""
        return dict(self._w.streamer.last_line)

    # ---- hangs and verdicts ---------------------------------------------------------------
    @property
    def shown_verdict(self) -> str | None:
        """The verdict the cell showed live for a hang, if it did."""
        return self._w.verdicts.shown

    @property
    def diagnosis(self) -> Diagnosis | None:
        """The last diagnosis made (live), if any."""
        return self._w.verdicts.diagnosis

    @property
    def hung(self) -> bool:
        return bool(self._w.verdicts.shown) and not self.finished

    def verdict(self) -> str | None:
        """The final verdict once the cell ended; while it runs, the one shown for a hang."""
        final = self._w.final
        if final is not None:
            return final.verdict
        diag = self._w.verdicts.diagnosis
        return diag.verdict if self._w.verdicts.shown and diag else None

    def diagnosis_now(self) -> Diagnosis:
        """While the cell runs, the doctor on the ranks now; after it, the record's verdict
        on the ranks as they were when the hang showed or they were released."""
        if not self.finished:
            return self._w.verdicts.diagnose()
        return self._w.final or self._w.verdicts.diagnose(before_release=True)

    def stacks(self, ranks: list[int]) -> str:
        """Every chosen rank's stack, and when it was taken."""
        w = self._w
        frozen = w.verdicts.frozen is not None and self.finished
        snaps = w.verdicts.frozen if frozen else {r: v.snap for r, v in w.views.items()}
        when = (
            "now"
            if not self.finished
            else (
                "when the last cell hung or was interrupted"
                if frozen
                else "at the end of the last cell"
            )
        )
        chosen = {r: snaps.get(r, {}) for r in ranks if r in snaps}
        return f"stacks {when}:\n{format_stacks(chosen, self.cell_file)}"
