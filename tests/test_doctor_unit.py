"""The doctor as a pure function, on synthetic snapshots (3+ ranks, two process groups)."""

from notebook_dist.doctor import diagnose, format_stacks, rank_condition

CELL = "Cell In[4]"
NOW = 1000.0


def rec(
    seq, op, line, shapes=((4,),), dtypes=("float32",), group="default", group_ranks=None, t0=990.0
):
    return {
        "seq": seq,
        "op": op,
        "group": group,
        "group_ranks": group_ranks,
        "shapes": [tuple(s) for s in shapes],
        "dtypes": list(dtypes),
        "where": (CELL, line),
        "t0": t0,
    }


def running(current=None, history=(), stack=None):
    return {
        "status": "running",
        "snap": {"collective": current, "history": list(history), "stack": stack or []},
    }


def done(history=()):
    return {"status": "done", "snap": {"collective": None, "history": list(history), "stack": []}}


def frame(line, func="<module>", file=CELL):
    return {"file": file, "line": line, "func": func, "code": ""}


SOURCE = "%%distributed\nx = torch.ones(4)\nif dist.get_rank() == 0:\n    dist.broadcast(x, 0)\ndist.all_reduce(x)\n"


def test_conditional_collective_names_the_first_divergence_on_three_ranks():
    ranks = {
        0: running(rec(1, "broadcast", 4)),
        1: running(rec(1, "all_reduce", 5)),
        2: running(rec(1, "all_reduce", 5)),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=SOURCE)
    assert d.kind == "conditional" and d.culprits == [0] and d.line == 4
    assert "Line 4 is inside `if dist.get_rank() == 0:` (line 3)" in d.verdict
    assert [r["state"] for r in d.rows] == ["in collective #1"] * 3
    assert (
        d.rows[0]["waiting"] == "10.0 s"
        and d.rows[0]["op"] == "broadcast"
        and d.rows[0]["where"] == "line 4"
    )


def test_first_divergence_beats_the_last_stuck_op():
    # all agree on #1 and #2; at #3 rank 2 did a barrier the others skipped; now all stuck at #4/#3
    common = [rec(1, "all_reduce", 2), rec(2, "all_reduce", 2)]
    ranks = {
        0: running(rec(3, "all_gather", 9), common),
        1: running(rec(3, "all_gather", 9), common),
        2: running(rec(4, "all_gather", 9), common + [rec(3, "barrier", 7)]),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "mismatch"
    assert d.verdict.startswith(
        "The ranks disagree at collective #3: rank 0 called all_gather at line 9; rank 1 called all_gather at line 9; rank 2 called barrier at line 7."
    )


def test_shapes_and_dtypes():
    ranks = {
        0: running(rec(1, "all_reduce", 3, shapes=[(4,)])),
        1: running(rec(1, "all_reduce", 3, shapes=[(5,)])),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "shapes" and d.line == 3
    assert "rank 0: all_reduce of (4,) float32; rank 1: all_reduce of (5,) float32" in d.verdict
    ranks = {
        0: running(rec(1, "all_reduce", 3)),
        1: running(rec(1, "all_reduce", 3, dtypes=["float64"])),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "dtypes" and "Every rank must pass tensors of the same dtype." in d.verdict


def test_two_process_groups_are_compared_separately():
    # group "even" = {0, 2} diverges; the default group is consistent so far
    g = dict(group="even", group_ranks=(0, 2))
    ranks = {
        0: running(rec(1, "broadcast", 6, **g), [rec(1, "all_reduce", 2)]),
        1: running(rec(2, "all_reduce", 8), [rec(1, "all_reduce", 2)]),
        2: running(rec(1, "all_reduce", 7, **g), [rec(1, "all_reduce", 2)]),
        3: running(rec(2, "all_reduce", 8), [rec(1, "all_reduce", 2)]),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "mismatch" and d.culprits == [0, 2]
    assert (
        "collective #1 in process group even: rank 0 called broadcast at line 6; rank 2 called all_reduce at line 7"
        in d.verdict
    )
    assert d.rows[0]["state"] == "in collective #1 (even)"


def test_raised_while_others_wait():
    ranks = {
        0: running(rec(2, "all_reduce", 6)),
        1: {"status": "error", "snap": {}, "error": ("ValueError", "bad", 4)},
        2: running(rec(2, "all_reduce", 6)),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "raised" and d.culprits == [1]
    assert d.verdict.startswith(
        "rank 1 raised ValueError at line 4; ranks 0, 2 wait in all_reduce #2 at line 6 that will never come."
    )
    assert d.rows[1]["state"] == "raised ValueError" and d.rows[1]["where"] == "line 4"


def test_dead_rank_with_signal_and_line():
    ranks = {
        0: running(rec(1, "all_reduce", 3)),
        1: {
            "status": "dead",
            "snap": {},
            "exit": "was killed by SIGABRT",
            "op": "all_reduce",
            "line": 3,
            "file": CELL,
        },
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "dead" and d.culprits == [1] and d.line == 3
    assert d.verdict.startswith(
        "rank 1 was killed by SIGABRT in all_reduce at line 3. rank 0 waits in all_reduce #1 at line 3."
    )
    assert "differ in shape or dtype" in d.verdict and d.verdict.endswith(
        "Run %dist_restart (add --replay to re-run your setup cells)."
    )


def test_busy_rank_shows_where_it_is():
    ranks = {
        0: running(rec(1, "all_reduce", 9)),
        1: running(None, stack=[frame(8), frame(5, "crunch")]),
        2: running(rec(1, "all_reduce", 9)),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "busy" and d.culprits == [1]
    assert d.verdict.startswith(
        "Rank 1 is busy in Python, not in a collective (rank 1 at line 5 in crunch (called at line 8)); ranks 0, 2 wait in all_reduce #1 at line 9."
    )


def test_finished_rank_and_missing_collective():
    hist = [rec(1, "all_reduce", 4), rec(2, "all_reduce", 4)]
    ranks = {0: running(rec(3, "all_reduce", 4), hist), 1: done(hist), 2: done(hist)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "finished" and d.culprits == [1, 2] and d.line == 4
    assert d.verdict.startswith(
        "Rank 0 called all_reduce #3 at line 4, but ranks 1, 2 finished the cell without calling it."
    )


def test_a_rank_that_has_not_got_there_yet_is_not_a_divergence():
    # rank 1 is still computing (no record of #1 yet): that is "busy", not "finished"
    ranks = {0: running(rec(1, "all_reduce", 4)), 1: running(None, stack=[frame(3)])}
    assert diagnose(ranks, now=NOW, cell_file=CELL).kind == "busy"


def test_uneven_ddp():
    backward = [
        frame(6),
        {"file": "/x/torch/_tensor.py", "line": 600, "func": "backward", "code": ""},
    ]
    ranks = {0: running(None, stack=backward), 1: done(), 2: running(None, stack=backward)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "uneven" and d.culprits == [1]
    assert d.verdict.startswith(
        "Ranks 0, 2 wait in the gradient all_reduce inside backward() at line 6"
    )
    assert d.rows[0]["state"] == "in backward (DDP/FSDP collectives)"


def test_all_ranks_in_matching_collective_is_stalled_not_blamed():
    ranks = {r: running(rec(1, "all_reduce", 4)) for r in range(3)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "stalled" and d.culprits == []


def test_pure_python_is_not_a_distributed_hang():
    ranks = {r: running(None, stack=[frame(3)]) for r in range(2)}
    assert diagnose(ranks, now=NOW, cell_file=CELL).kind == "python"


def test_rank_condition_parser():
    assert rank_condition(SOURCE, 4, first_line=2) == (3, "dist.get_rank() == 0")
    assert rank_condition(SOURCE, 5, first_line=2) is None
    assert rank_condition("if x > 1:\n    y()\n", 2) is None  # not about the rank
    assert rank_condition("x = (", 1) is None


def test_text_rendering_and_stacks():
    ranks = {
        0: running(rec(1, "broadcast", 4), stack=[frame(4)]),
        1: running(rec(1, "all_reduce", 5), stack=[frame(5)]),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=SOURCE)
    lines = d.text().splitlines()
    assert lines[0].split() == ["rank", "state", "op", "shapes", "where", "waiting"]
    assert lines[-1].startswith("Diagnosis: The ranks disagree at collective #1")
    text = format_stacks({r: v["snap"] for r, v in ranks.items()}, CELL)
    assert text.splitlines()[:2] == ["rank 0: in broadcast #1", "  line 4, in <module>"]
