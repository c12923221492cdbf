"""The watch's release policy, a pure function, on synthetic timelines; and the sizes the
kernel side keeps to (a class or a function that grows past them is asking to be split)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from notebook_dist.watch.policy import Decision, Situation, decide

AFTER, ABANDON = 2.0, 5.0


def at(now, *, failed=(), dead=(), running=(), in_collective=(), released=(), since=0.0, **kw):
    return Situation(
        now=now,
        last_progress=kw.pop("last_progress", now),
        error_since=since if (failed or dead) and running else None,
        failed=frozenset(failed) | frozenset(dead),
        dead=frozenset(dead),
        running=frozenset(running),
        in_collective=frozenset(in_collective),
        released=frozenset(released),
        **kw,
    )


def test_nothing_failed_nothing_to_do():
    assert decide(at(10.0, running=(0, 1), in_collective=(0, 1)), AFTER, ABANDON) == Decision()


def test_a_rank_that_raised_gets_the_ranks_waiting_in_collectives_released_at_once():
    s = at(0.1, failed=(1,), running=(0, 2), in_collective=(0,), since=0.0)
    assert decide(s, AFTER, ABANDON) == Decision(release=(0,))


def test_ranks_still_in_python_are_released_only_after_a_while_without_progress():
    early = at(1.0, failed=(1,), running=(0,), since=0.0, last_progress=0.5)
    assert decide(early, AFTER, ABANDON) == Decision()
    late = at(3.0, failed=(1,), running=(0,), since=0.0, last_progress=0.5)
    assert decide(late, AFTER, ABANDON) == Decision(release=(0,))


def test_a_released_rank_is_not_released_again():
    s = at(0.5, failed=(1,), running=(0,), in_collective=(0,), released=(0,), since=0.0)
    assert decide(s, AFTER, ABANDON) == Decision()


def test_a_dead_ranks_peers_are_interrupted_once_then_given_up_on():
    timeline = [
        (0.5, Decision(release=(0,))),
        (AFTER + 0.1, Decision(release=(0,), interrupt=(0,))),
        (AFTER + ABANDON + 0.1, Decision(release=(0,), abandon=True)),
    ]
    interrupted = False
    for now, want in timeline:
        s = at(
            now,
            dead=(1,),
            running=(0,),
            in_collective=(0,),
            since=0.0,
            interrupted_for_death=interrupted,
        )
        got = decide(s, AFTER, ABANDON)
        assert got == want, (now, got)
        interrupted = interrupted or bool(got.interrupt)


def test_when_no_rank_runs_any_more_nothing_is_released():
    assert decide(at(9.0, failed=(1,), dead=(2,)), AFTER, ABANDON) == Decision()


def test_a_stuck_cell_is_stopped_only_when_torch_has_no_timeout_of_the_users():
    from notebook_dist.config import DistConfig
    from notebook_dist.watch.policy import STUCK, on_hang

    config = DistConfig(stuck_after_s=300.0)
    assert on_hang(299.0, "show", config, False).stop is None  # the verdict shows, it goes on
    stuck = on_hang(300.0, "show", config, False)
    assert stuck.stuck and stuck.stop == STUCK and stuck.said.startswith("The cell was stopped")
    assert not on_hang(300.0, "show", config, True).stuck  # not again while stopping
    assert on_hang(10.0, "stop", config, False).stop == "--on-hang stop"
    timed = DistConfig(timeout_s=60.0, stuck_after_s=300.0)  # torch's own ends it
    assert not on_hang(900.0, "show", timed, False).stuck


ROOT = Path(__file__).resolve().parents[1] / "notebook_dist"


def test_no_class_past_about_250_lines_and_no_function_past_about_80():
    big = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            size = node.end_lineno - node.lineno + 1
            if isinstance(node, ast.ClassDef) and size > 250:
                big.append(f"{path.relative_to(ROOT)}: class {node.name}, {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                big.append(f"{path.relative_to(ROOT)}: {node.name}(), {size} lines")
    assert big == []


def test_the_watch_is_a_small_coordinator():
    from notebook_dist.watch import CellWatch

    source = inspect.getsource(CellWatch)
    assert len(source.splitlines()) <= 150, len(source.splitlines())


def _progress(*futures):
    from notebook_dist.watch.progress import Progress

    ranks = list(range(len(futures)))
    return Progress(ranks, [{} for _ in ranks], list(futures), token="t")


def _answered(status="ok"):
    from concurrent.futures import Future

    from notebook_dist.values import pack

    fut = Future()
    fut.set_result(pack({"status": status, "final": {"line": 3}}))
    return fut


def test_ranks_that_all_answered_are_not_looked_for_among_the_dead():
    asked = []
    progress = _progress(_answered(), _answered("error"))
    ended = progress.poll(lambda: asked.append(1) or {1: "killed by signal 9"})
    assert ended == [0, 1] and asked == []  # (each answered: each finished the cell)
    assert [v.status for v in progress.views.values()] == ["done", "error"]


def test_a_rank_not_answered_or_failed_to_reach_is_named_dead_by_its_process():
    from concurrent.futures import Future

    failed, waiting = Future(), Future()
    failed.set_exception(RuntimeError("the engine died"))  # (what the queue says of it)
    asked = []
    dead = {1: "killed by signal 9", 2: "exited with code 3"}
    progress = _progress(_answered(), failed, waiting, Future())
    ended = progress.poll(lambda: asked.append(1) or dead)
    assert ended == [0] and len(asked) == 1  # (asked once a poll, whatever the ranks)
    assert [v.status for v in progress.views.values()] == ["done", "dead", "dead", "running"]
    assert [v.exit for v in progress.views.values()] == [None, *dead.values(), None]
    failed_alive = Future()
    failed_alive.set_exception(RuntimeError("unreachable"))
    progress = _progress(failed_alive)
    assert progress.poll(dict) == [0]  # (its process lives: the failure is the cell's error)
    assert progress.views[0].status == "error"
