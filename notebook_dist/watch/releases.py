"""Releasing the ranks a failed rank left waiting, as :mod:`.policy` decides: the state
of one cell's releases (who, since when) and the steps that carry the decision out."""

from __future__ import annotations

import time

from ..doctor.facts import TRANSPORT_ERROR
from . import policy


class Releases:
    def __init__(self, cluster, views: dict, token: str):
        self.cluster = cluster
        self.views = views
        self.token = token  # the cell's id on the ranks: a release names it
        self.released: set[int] = set()
        self.release_time: float | None = None  # when the first release was asked for
        self.error_since: float | None = None
        self.interrupted_for_death = self.abandoned = False

    def note_ended(self, ended: list[int]) -> None:
        """A rank whose collective failed once others were released was released too."""
        for r in ended:
            v = self.views[r]
            if v.status == "error" and policy.failed_by_release(
                v, self.release_time, TRANSPORT_ERROR
            ):
                self.released.add(r)
                v.released, v.before_release = True, v.running_snap or None

    def apply(self, now: float, last_progress: float, config) -> None:
        running = any(v.status == "running" for v in self.views.values())
        failing = any(v.status in ("error", "dead") for v in self.views.values())
        self.error_since = (self.error_since or now) if failing and running else None
        decision = policy.decide(
            policy.situation(
                self.views,
                now,
                last_progress,
                self.error_since,
                self.released,
                self.interrupted_for_death,
            ),
            config.release_after_error_s,
            config.abandon_after_death_s,
        )
        if decision.release:
            self.release(list(decision.release))
        if decision.interrupt:
            self.interrupted_for_death = True
            self.cluster.interrupt(list(decision.interrupt))
        self.abandoned = self.abandoned or decision.abandon

    def release(self, ranks: list[int]) -> None:
        if self.release_time is None:
            self.release_time = time.time()
        for r in ranks:
            self.released.add(r)
            self.views[r].released = True
            self.views[r].before_release = dict(self.views[r].snap)
        self.cluster.release_collectives(ranks, self.token)
