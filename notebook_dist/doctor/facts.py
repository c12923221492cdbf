"""What the rules read: the per-rank reports of a cell, sorted once into plain facts.

Each rank comes as a :class:`RankReport`; a running rank is in at most one *wait*
(``waits``). The table rows come from the same facts as the verdicts, so a verdict cannot
see a rank differently from its row. The words are ``words``, the stacks ``stacks``, the
cell's source ``source``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .diagnosis import COLUMNS
from .source import rank_condition, rank_loop
from .stacks import stack_line
from .waits import Wait, wait_of
from .words import cell_line, each_rank

# how a collective fails when a peer's connections close under it (a peer that died or was
# released); torch-internal ones, such as DDP's gradient all_reduce, never pass the tracker
TRANSPORT_ERROR = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe", re.IGNORECASE
)


@dataclass
class RankReport:
    """What the doctor knows of one rank in a cell (the watch makes one per rank)."""

    status: str  # running, done, error, dead
    #: the rank's agent's last snapshot (notebook_dist.runtime.agent.snapshot), or {}
    snap: dict[str, Any] = field(default_factory=dict)
    exit: str | None = None  # how a dead rank ended: "exited with code 1"
    found_dead: float | None = None  # when the kernel found it dead (its clock)
    error: tuple[str, str, int | None] | None = None  # a rank that raised: ename, evalue, line
    #: a dead rank's fault file: the collective ``op``, the ``file`` and ``line`` it was at,
    #: and the ``record`` of the collective it was in (what it passed)
    fault: dict[str, Any] = field(default_factory=dict)


def records(snap: dict) -> list[dict]:
    """The tracked collectives of a snapshot (completed and current), in order."""
    recs = [r for r in (snap.get("history") or []) if r.get("kind") != "p2p"]
    current = snap.get("collective")
    if current and current.get("kind") != "p2p":
        recs.append(current)
    recs += [r for r in snap.get("threads") or [] if r.get("kind") != "p2p"]  # other threads'
    return recs


class Facts:
    """The snapshots of one cell, sorted once, plus the cell it ran."""

    def __init__(
        self,
        ranks: dict[int, RankReport],
        now: float,
        cell_file: str | None,
        source: str | None,
        first_line: int,
        healable: bool = True,
    ):
        self.info = ranks
        self.healable = healable  # (a dead rank: %dist_heal, or only %dist_restart)
        self.now = now
        self.cell_file = cell_file
        self.source = source
        self.first_line = first_line
        self.status = {r: info.status for r, info in ranks.items()}
        self.snaps = {r: ranks[r].snap or {} for r in ranks}
        self.dead = self._with("dead")
        self.raised = self._with("error")
        self.done = self._with("done")
        self.running = self._with("running")
        self.waits: dict[int, Wait] = {}
        for r in self.running:
            w = wait_of(self.snaps[r])
            if w is not None:
                self.waits[r] = w
        #: running ranks in none of the waits above: busy in Python (or in a long op)
        self.busy = [r for r in self.running if r not in self.waits]
        self.members: dict[str, list[int]] = {"default": sorted(ranks)}
        for r in ranks:
            for rec in records(self.snaps[r]):
                if rec["group"] != "default" and rec.get("group_ranks"):
                    self.members[rec["group"]] = sorted(rec["group_ranks"])

    def _with(self, status: str) -> list[int]:
        return sorted(r for r, s in self.status.items() if s == status)

    # ---- helpers the rules share -------------------------------------------------

    def gpu_busy(self) -> list[int]:
        """Ranks whose host thread waits for a kernel that is no collective (a long one)."""
        return [r for r in self.in_kind("gpu") if not self.waits[r].record.get("nccl")]

    def in_kind(self, *kinds: str) -> list[int]:
        return sorted(r for r, w in self.waits.items() if w.kind in kinds)

    def waiting_phrase(self, ranks: list[int] | None = None) -> str:
        """'ranks 0, 2 wait in all_reduce #2 at line 6; rank 1 waits in recv from rank 0 at line 4'."""
        ranks = sorted(self.waits) if ranks is None else ranks
        return each_rank((r, f"waits in {self.wait_text(r)}") for r in ranks)

    def wait_text(self, r: int) -> str:
        """What rank r waits in, and where: 'all_reduce #2 at line 6'."""
        return self.waits[r].text(self, r)

    def p2p_where(self, r: int) -> str:
        """Where rank r waits on point-to-point ops (``waits.P2PWait.where``)."""
        return self.waits[r].where(self, r)

    def waited(self, r: int, rec: dict) -> float:
        """How long rank r has been in ``rec``: on the rank's clock up to its snapshot, then
        on the kernel's since the snapshot came (two machines' clocks are never compared)."""
        snap = self.snaps[r]
        if "received" in snap and "time" in snap:
            return max(0.0, snap["time"] - rec["t0"] + self.now - snap["received"])
        return max(0.0, self.now - rec["t0"])

    def seen_ago(self, r: int, at: float) -> float:
        """How long before ``at`` (the kernel's clock) rank r's last snapshot came."""
        snap = self.snaps[r]
        return max(0.0, at - snap.get("received", snap.get("time", at)))

    def stack_at(self, r: int) -> str:
        return stack_line(self.snaps[r].get("stack"), self.cell_file)[0]

    def condition(self, line: int | None) -> tuple[int, str] | None:
        return rank_condition(self.source, line, self.first_line)

    def guarded(self, rec: dict, find) -> tuple[int | None, tuple[int, str] | None]:
        """The running cell's line of ``rec`` and the rank-dependent statement around it
        (``find`` is :meth:`condition` or :meth:`loop`): around the op itself, or, for an op
        inside a function, around the line that called it."""
        lines = [cell_line(rec, self.cell_file)]
        site = rec.get("site")
        if site and site[0] == self.cell_file and site[1] not in lines:
            lines.append(site[1])
        for line in lines:
            found = find(line)
            if found:
                return line, found
        return lines[0], None

    def loop(self, line: int | None) -> tuple[int, str] | None:
        return rank_loop(self.source, line, self.first_line)

    def wait_line(self, r: int) -> int | None:
        """The cell line of what rank r waits in (or where its stack is)."""
        w = self.waits.get(r)
        if w is None:
            return stack_line(self.snaps[r].get("stack"), self.cell_file)[1]
        return w.line(self, r)

    def elsewhere(self, r: int) -> str:
        """Where a rank is that is not where another waits for it."""
        s = self.status[r]
        if s == "done":
            return "finished the cell"
        if s == "error":
            ename, _, line = self.info[r].error or ("Error", "", None)
            return f"raised {ename}" + (f" at line {line}" if line else "")
        if s == "dead":
            return str(self.info[r].exit or "died")
        if r in self.waits:
            return f"waits in {self.wait_text(r)}"
        return f"is busy in Python at {self.stack_at(r)}"

    # ---- the table ----------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in sorted(self.info):
            info = self.info[r]
            status = self.status[r]
            if status == "dead":
                row = {"state": f"dead ({info.exit or '?'})"}
            elif status == "error":
                ename, _, line = info.error or ("Error", "", None)
                row = {"state": f"raised {ename}", "where": f"line {line}" if line else ""}
            elif status == "done":
                row = {"state": "finished the cell"}
            elif r in self.waits:
                row = self.waits[r].row(self, r)
            else:
                row = {"state": "running Python", "where": self.stack_at(r)}
            rows.append({"rank": r, **{c: row.get(c, "") for c in COLUMNS if c != "rank"}})
        return rows
