"""How the console gathers many ranks stopped alike into one prompt, with the clock in the
test's hands: the ranks of a real cell stop when the machine lets them (see
``test_scale.py::test_ranks_stopped_alike_are_asked_once`` for 16 and 32 real ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from notebook_dist import console
from notebook_dist.console import GATHER_MAX_S, GATHER_S, Console

N = 32
STEP = 0.05  # how often the cell's loop serves the console


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def ranks_stopping_at(times: dict[int, float], clock: Clock) -> dict:
    """The ranks' views: rank r asks at ``times[r]`` (seconds after the start), or never."""
    start = clock.t

    def view(r):
        stopped = r in times and clock.t - start >= times[r]
        asking = {"id": 1, "prompt": "(Pdb) ", "kind": "pdb", "where": ["<cell>", 3]}
        return SimpleNamespace(status="running", snap={"asking": asking if stopped else None})

    return lambda: {r: view(r) for r in range(N)}


def first_prompt(times: dict[int, float], monkeypatch) -> tuple[str, float]:
    """Serve the console until it asks; what it asked, and when (seconds from the start)."""
    clock = Clock()
    monkeypatch.setattr(console.time, "monotonic", clock)
    asked = []
    cluster = SimpleNamespace(tell_ranks=lambda tells: None)
    con = Console(cluster, say=lambda line: None, ask=lambda p: asked.append(p) or "c")
    views = ranks_stopping_at(times, clock)
    start = clock.t
    while not asked and clock.t - start < 60:
        con.serve(views())
        clock.t += STEP
    return asked[0], clock.t - STEP - start


def test_a_rank_that_stops_late_on_a_busy_machine_is_asked_with_the_others(monkeypatch):
    """The ranks stop one after another over 0.4 s, and rank 6 a further 0.4 s later: past
    ``GATHER_S`` from the first stop (the prompt went to 31 ranks in a loaded CI run), but
    within it of the last one. One prompt for all 32."""
    times = {r: 0.4 * r / N for r in range(N)}
    times[6] = 0.8
    assert times[6] > GATHER_S and times[6] - max(t for r, t in times.items() if r != 6) < GATHER_S
    prompt, _ = first_prompt(times, monkeypatch)
    assert prompt == f"[ranks 0-{N - 1}] (Pdb) ", prompt


def test_a_rank_that_never_stops_delays_the_prompt_by_the_quiet_period_only(monkeypatch):
    times = {r: 0.2 for r in range(N) if r != 6}
    prompt, at = first_prompt(times, monkeypatch)
    assert prompt == f"[ranks 0-5, 7-{N - 1}] (Pdb) ", prompt
    assert at == pytest.approx(0.2 + GATHER_S, abs=2 * STEP), at


def test_ranks_that_keep_trickling_in_are_asked_within_the_cap(monkeypatch):
    """A rank stops every 0.4 s (never a quiet period): asked at ``GATHER_MAX_S``."""
    times = {r: 0.4 * r for r in range(N)}
    prompt, at = first_prompt(times, monkeypatch)
    assert at == pytest.approx(GATHER_MAX_S, abs=2 * STEP), at
    stopped = int(GATHER_MAX_S / 0.4) + 1
    assert prompt == f"[ranks 0-{stopped - 1}] (Pdb) ", prompt
