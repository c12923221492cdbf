"""When to release ranks from their collectives, when to give up on a cell, and what a
hang leads to: pure functions of where the cell stands, tested on synthetic timelines
(``tests/test_watch.py``).

A rank that raised or died leaves the others waiting in collectives that cannot complete.
They are released at once when they are inside one, and after ``after_error_s`` without
progress otherwise (they may be about to enter one). A dead rank's peers are then
interrupted, and ``abandon_after_s`` later the cell ends without waiting for them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Situation:
    """Where a cell stands at one poll (times are the kernel's monotonic clock)."""

    now: float
    last_progress: float
    #: since when some rank has failed while others still run (None: not so)
    error_since: float | None
    failed: frozenset[int]  # raised or died
    dead: frozenset[int]
    running: frozenset[int]
    in_collective: frozenset[int]  # running ranks inside a tracked collective
    released: frozenset[int]
    interrupted_for_death: bool = False


@dataclass(frozen=True)
class Decision:
    release: tuple[int, ...] = ()
    interrupt: tuple[int, ...] = ()  # the peers of a dead rank, once
    abandon: bool = False  # stop waiting: a rank died and the others do not stop


def decide(s: Situation, after_error_s: float, abandon_after_s: float) -> Decision:
    """What to do now. ``after_error_s``: DistConfig.release_after_error_s;
    ``abandon_after_s``: DistConfig.abandon_after_death_s."""
    if not s.failed or not s.running or s.error_since is None:
        return Decision()
    stuck = set(s.running) if s.now - s.last_progress >= after_error_s else set(s.in_collective)
    release = tuple(sorted(stuck - s.released))
    if not s.dead:
        return Decision(release=release)
    waited = s.now - s.error_since
    interrupt = ()
    if waited >= after_error_s and not s.interrupted_for_death:
        interrupt = tuple(sorted(s.running))
    return Decision(release, interrupt, waited >= after_error_s + abandon_after_s)


def situation(
    views: dict, now: float, last_progress: float, error_since, released, interrupted
) -> Situation:
    """Where the cell stands, from the ranks' views (``progress.RankView``)."""
    failed = frozenset(r for r, v in views.items() if v.status in ("error", "dead"))
    running = frozenset(r for r, v in views.items() if v.status == "running")
    return Situation(
        now=now,
        last_progress=last_progress,
        error_since=error_since,
        failed=failed,
        dead=frozenset(r for r in failed if views[r].status == "dead"),
        running=running,
        in_collective=frozenset(r for r in running if views[r].snap.get("collective")),
        released=frozenset(released),
        interrupted_for_death=interrupted,
    )


def failed_by_release(v, release_time: float | None, transport_error) -> bool:
    """A rank whose collective failed after others were released: their connections closed
    under it, so its error is a consequence of the release, not a second cause."""
    if release_time is None or v.released:
        return False
    error = v.result.get("error") or {}
    ended = (v.result.get("final") or {}).get("time", 0.0)
    from_collective = error.get("collective") or transport_error.search(error.get("evalue", ""))
    return bool(from_collective) and ended >= release_time


#: why a cell nobody stopped is stopped: stuck, and no rank at a prompt
STUCK = "no rank made progress for DistConfig.stuck_after_s, and none waits at a prompt"


@dataclass(frozen=True)
class Hang:
    stop: str | None = None  # why the cell stops at this verdict (None: it goes on)
    stuck: bool = False  # stopped by DistConfig.stuck_after_s: even with the verdict shown
    said: str = ""  # what the stopped cell's error says first


def on_hang(waited: float, hang_action: str, config, stopping: bool) -> Hang:
    """A cell in which no rank has moved for ``waited`` seconds (past ``hang_after``): the
    verdict shows, and the cell stops with ``--on-hang stop``, or once it is stuck for
    ``config.stuck_after_s`` when torch has no timeout of the user's to end it (never
    while a rank waits at a prompt: the watch's clock stands still then). ``stopping``:
    the ranks are being stopped already."""
    if config.timeout_s is None and not stopping and waited >= config.stuck_after_s:
        return Hang(STUCK, True, f"The cell was stopped: {STUCK} ({waited:.0f} s). ")
    return Hang("--on-hang stop" if hang_action == "stop" else None)
