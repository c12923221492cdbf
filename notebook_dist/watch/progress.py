"""What the kernel knows of each rank during a cell, and when any rank last made progress.

Each poll reads, per rank, the agent's latest snapshot (for this cell only: it carries the
cell's token, so no two machines' clocks are compared) and whether its reply came, from
what ipyparallel keeps for the cell's message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..values import unpack


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
    published: dict | None = None  # the agent's last snapshot, as published
    running_snap: dict | None = None  # its last snapshot while it ran (once it has ended)


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


class Progress:
    """The ranks' views, updated from ipyparallel's per-message metadata and futures.

    ``metadata``: each rank's message metadata (output, agent snapshots) as the call bound
    it when it sent the request, not ``client.metadata[msg_id]``: ipyparallel drops that
    entry once the reply and output are in, and a fast cell can get there before the
    watch is made."""

    def __init__(self, ranks: list[int], metadata: list[dict], futures: list, token: str):
        self.ranks = ranks
        self.metadata = metadata
        self.futures = futures
        self.token = token
        self.views = {r: RankView(r) for r in ranks}
        self.last_progress = time.monotonic()

    def running(self) -> list[int]:
        return [r for r, v in self.views.items() if v.status == "running"]

    def asking(self) -> bool:
        """Whether a running rank waits for the user (its debugger, input())."""
        return any(v.snap.get("asking") for v in self.views.values() if v.status == "running")

    def poll(self, dead_ranks: Callable[[], dict[int, str]]) -> list[int]:
        """Read every rank once; returns the ranks whose reply came in this poll.
        ``dead_ranks()`` (the ranks whose process ended, and how) is asked only for a rank
        still running whose reply has not come, or came as a failure: a rank that answered
        finished the cell, and most polls of a short cell find every rank so."""
        ended = []
        progressed = False
        views, token = self.views, self.token
        dead = None
        for r, md, fut in zip(self.ranks, self.metadata, self.futures):
            v = views[r]
            if v.status == "running":
                # this cell's snapshot (by its token: the rank's clock may differ from
                # ours), and when it came, on our clock: how long a rank has waited never
                # mixes two clocks
                data = md.get("data")
                snap = data.get("nd") if data else None
                if snap and snap is not v.published and snap.get("cell_token") == token:
                    v.published = snap
                    v.snap = dict(snap, received=time.time())
                reply = _reply(fut) if fut.done() else _NONE
                if reply is _NONE or isinstance(reply, BaseException):
                    dead = dead_ranks() if dead is None else dead
                    if r in dead:
                        v.status, v.exit, v.dead_at = "dead", dead[r], time.time()
                        reply = _NONE
                if reply is not _NONE:
                    self._take_reply(v, reply)
                    ended.append(r)
            if v.status == "running":
                fp = fingerprint(v, md)
            else:  # (a rank that ended changes only by its output coming in)
                fp = (v.status, written(md))
            if fp != v.fingerprint:
                v.fingerprint = fp
                progressed = True
        if progressed:
            self.last_progress = time.monotonic()
        return ended

    @staticmethod
    def _take_reply(v: RankView, reply) -> None:
        if isinstance(reply, BaseException):  # not reached, or our rank side failed
            v.status, v.result = "error", {"status": "error", "error": engine_error(reply)}
            return
        try:
            v.result = unpack(reply)
            v.status = "error" if v.result["status"] == "error" else "done"
            v.running_snap = v.snap
            # the rank's final record, even if it finished before its agent reported
            v.snap = dict(v.result.get("final") or {}, collective=None, received=time.time())
        except Exception as exc:  # a reply that cannot be read
            v.status, v.result = "error", {"status": "error", "error": engine_error(exc)}


#: no reply (yet) from a rank
_NONE = object()


def _reply(fut):
    """A finished future's reply: the rank's answer, or the exception that came instead
    (the rank not reached, or our rank side failed)."""
    try:
        return fut.result()
    except BaseException as exc:
        return exc


def fingerprint(v: RankView, md: dict) -> tuple:
    """What changes when a running rank makes progress: a collective done, a new line,
    output."""
    snap = v.snap
    stack = snap.get("stack")
    return (
        v.status,
        snap.get("collectives_done"),
        snap.get("p2p_done"),
        len(snap.get("p2p_pending") or ()),
        (snap.get("collective") or {}).get("seq"),
        tuple([(f["file"], f["line"]) for f in stack[-3:]]) if stack else (),
        snap.get("reports"),
        written(md),
    )


def written(md: dict) -> int:
    """How much a rank has written (its record's two streams)."""
    return len(md.get("stdout") or "") + len(md.get("stderr") or "")
