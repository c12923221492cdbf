"""The doctor as a pure function, on synthetic snapshots (3+ ranks, two process groups)."""

import pytest

from notebook_dist.doctor import RankReport, diagnose, format_stacks, rank_condition
from notebook_dist.doctor.source import rank_loop
from notebook_dist.doctor.words import shape_text

CELL = "Cell In[4]"
NOW = 1000.0


def rec(
    seq,
    op,
    line,
    shapes=((4,),),
    dtypes=("float32",),
    group="default",
    group_ranks=None,
    t0=990.0,
    args=None,
):
    out = {
        "seq": seq,
        "op": op,
        "group": group,
        "group_ranks": group_ranks,
        "shapes": [tuple(s) for s in shapes],
        "dtypes": list(dtypes),
        "where": (CELL, line),
        "t0": t0,
    }
    if args is not None:
        out["args"] = dict(args)
    return out


def running(current=None, history=(), stack=None):
    return RankReport(
        "running", {"collective": current, "history": list(history), "stack": stack or []}
    )


def done(history=()):
    return RankReport("done", {"collective": None, "history": list(history), "stack": []})


def raised(ename="ValueError", evalue="x", line=None):
    return RankReport("error", {}, error=(ename, evalue, line))


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
        "The ranks disagree at collective #3: ranks 0, 1 called all_gather at line 9; rank 2 called barrier at line 7."
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
        1: raised("ValueError", "bad", 4),
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
        1: RankReport(
            "dead",
            {},
            "was killed by SIGABRT",
            fault={"op": "all_reduce", "line": 3, "file": CELL},
        ),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "dead" and d.culprits == [1] and d.line == 3
    assert d.verdict.startswith(
        "rank 1 was killed by SIGABRT in all_reduce at line 3. Rank 0 waits in all_reduce #1 at line 3."
    )
    assert "differ in shape or dtype" in d.verdict and d.verdict.endswith(
        "Run %dist_heal for a fresh rank in its place while the others keep their variables "
        "(--copy NAMES gives it yours), or %dist_restart (add --replay to re-run your setup "
        "cells)."
    )
    # ranks on ssh hosts, in an MPI or Slurm job: no fresh rank can take its place
    d = diagnose(ranks, now=NOW, cell_file=CELL, healable=False)
    assert "%dist_heal" not in d.verdict and d.verdict.endswith(
        "Run %dist_restart for fresh ranks (add --replay to re-run your setup cells)."
    )


def test_dead_rank_names_what_each_survivor_did():
    """After a death the others are interrupted: the verdict says who stopped where, who
    raised, and who still runs (code that ignores the interrupt), not the dead alone."""
    dead = RankReport("dead", {}, "exited with code 1", fault={"line": 4, "file": CELL})
    ranks = {
        0: raised("KeyboardInterrupt", "", 3),
        1: dead,
        2: raised("ValueError", "bad", 2),
        3: running(None, stack=[frame(5)]),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "dead" and d.culprits == [1]
    assert d.verdict.startswith(
        "rank 1 exited with code 1 at line 4. Rank 0 was interrupted at line 3 and keeps its "
        "variables. Rank 2 raised ValueError at line 2 and keeps its variables. Rank 3 still "
        "runs Python code at line 5, which the interrupt did not stop (code that ignores "
        "interrupts). Run %dist_restart for fresh ranks"
    ), d.verdict
    ranks[3] = raised("KeyboardInterrupt", "", None)
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert "Rank 3 was interrupted and keeps its variables. Run %dist_heal" in d.verdict, d.verdict


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
    text = format_stacks({r: v.snap for r, v in ranks.items()}, CELL)
    assert text.splitlines()[:2] == ["rank 0: in broadcast #1", "  line 4, in <module>"]


def test_at_sixteen_ranks_the_table_and_the_stacks_say_the_ranks_that_are_alike_once():
    """Rank 5 skips the all_reduce the 15 others wait in: the table has a row for the 15 (their
    waits a range) and one for rank 5, the stacks one copy for the 15; every rank's row on
    asking (DistConfig.dashboard_full_table)."""
    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    stack = [frame(4), frame(3252, "all_reduce", c10d)]
    ranks = {
        r: running(rec(1, "all_reduce", 4, t0=990.0 - r / 10), stack=stack)
        for r in range(16)
        if r != 5
    }
    ranks[5] = RankReport("done", {"collective": None, "stack": [], "cell_state": "done"})
    source = "%%distributed\nt = torch.ones(1)\nif nd.rank != 5:\n    dist.all_reduce(t)\n"
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=source)
    assert d.kind == "conditional", d.verdict
    lines = d.text().splitlines()
    assert len(lines) == 4, lines  # the header, two rows, the verdict
    assert lines[1].split()[:4] == ["0-4,", "6-15", "in", "collective"], lines
    assert lines[1].endswith("10.0-11.5 s"), lines
    assert lines[2].split() == ["5", "finished", "the", "cell"], lines
    assert len(d.text(full=True).splitlines()) == 18
    text = format_stacks({r: v.snap for r, v in ranks.items()}, CELL)
    assert text.splitlines()[0] == "ranks 0-4, 6-15: in all_reduce #1", text
    assert text.count("in all_reduce #1") == 1 and text.count("line 4, in <module>") == 1, text
    assert text.splitlines()[-1] == "rank 5: finished the cell", text
    # an installed package's frame from the package, not the whole site-packages path
    assert "  torch/distributed/distributed_c10d.py, line 3252, in all_reduce" in text, text
    ended = {0: {"cell_state": "error"}, 1: {"cell_state": "error"}, 2: {}, 3: {"stack": []}}
    assert format_stacks(ended, CELL).splitlines() == [
        "ranks 0, 1: ended the cell with an error",
        "ranks 2, 3",
        "  (no stack reported)",
    ]
    # as a hang shows it in the cell: grouped, or every rank's row when the config asks
    import io

    from notebook_dist.config import DistConfig
    from notebook_dist.watch.report import Reporter

    snaps = {r: v.snap for r, v in ranks.items()}
    for full, rows in ((False, 2), (True, 16)):
        out = io.StringIO()
        Reporter(out, CELL, DistConfig(dashboard_full_table=full)).hang(d, 3.0, None, snaps)
        shown = out.getvalue()
        assert len(shown[: shown.index("Diagnosis:")].strip().splitlines()) == 2 + rows, shown
        assert shown.count("line 4, in <module>") == 1, shown


def test_the_words_of_many_ranks_that_do_the_same_are_said_once():
    from notebook_dist.phrases import each_rank

    said = [(0, "was killed by SIGKILL"), (1, "exited with code 1"), (2, "was killed by SIGKILL")]
    assert each_rank(said) == "ranks 0, 2 were killed by SIGKILL; rank 1 exited with code 1"
    assert each_rank([(3, "is in pdb", "sit in pdb"), (4, "is in pdb", "sit in pdb")]) == (
        "ranks 3, 4 sit in pdb"
    )
    assert each_rank([(0, "(4,) float32")], between=": ", one="Rank") == "Rank 0: (4,) float32"
    assert each_rank([]) == ""


# ---- point-to-point -------------------------------------------------------------------


def p2p(op, peer, line, tag=0, t0=990.0):
    return {
        "kind": "p2p",
        "op": op,
        "direction": "send" if "send" in op else "recv",
        "peer": peer,
        "tag": tag,
        "group": "default",
        "group_ranks": None,
        "shapes": [(4,)],
        "dtypes": ["float32"],
        "where": (CELL, line),
        "t0": t0,
    }


def test_ranks_that_both_send_first_are_a_point_to_point_deadlock():
    ranks = {0: running(p2p("send", 1, 4)), 1: running(p2p("send", 0, 6))}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-deadlock" and d.culprits == [0, 1] and d.line == 4
    assert d.verdict.startswith(
        "Ranks 0, 1 are in a point-to-point deadlock: rank 0 waits in send to rank 1 at line 4; "
        "rank 1 waits in send to rank 0 at line 6. Each sends before it receives"
    )
    assert "rank parity" in d.verdict and "batch_isend_irecv" in d.verdict
    assert "network" not in d.verdict
    assert [r["state"] for r in d.rows] == ["in send to rank 1", "in send to rank 0"]


def test_a_ring_of_receives_is_a_deadlock_too():
    ranks = {r: running(p2p("recv", (r - 1) % 3, 5)) for r in range(3)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-deadlock" and d.culprits == [0, 1, 2]
    assert "Each receives before it sends" in d.verdict


def test_posted_irecvs_that_are_never_matched_deadlock_at_the_wait():
    # both post an irecv, then wait on it: the stack says where they wait
    def waiting_on_irecv(peer):
        snap = running(None, stack=[frame(6)])
        snap.snap["p2p_pending"] = [p2p("irecv", peer, 4)]
        return snap

    d = diagnose({0: waiting_on_irecv(1), 1: waiting_on_irecv(0)}, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-deadlock"
    assert "rank 0 waits in irecv from rank 1 at line 6 (posted at line 4)" in d.verdict
    assert d.rows[0]["state"] == "in irecv from rank 1"


def test_a_matched_pair_is_not_blamed():
    ranks = {0: running(p2p("send", 1, 4)), 1: running(p2p("recv", 0, 5))}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert not d.kind.startswith("p2p") and d.culprits == []


def test_mismatched_tags():
    ranks = {0: running(p2p("send", 1, 4, tag=0)), 1: running(p2p("recv", 0, 5, tag=1))}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-tag" and d.culprits == [0, 1] and d.line == 4
    assert d.verdict.startswith(
        "Rank 0 waits in send to rank 1 at line 4, and rank 1 waits in recv from rank 0 (tag 1) at "
        "line 5: the tags differ (0 and 1)"
    )


def test_mismatched_peer():
    ranks = {
        0: running(p2p("send", 2, 4)),
        1: running(p2p("recv", 0, 5)),
        2: running(rec(1, "all_reduce", 9)),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-peer" and d.culprits == [0, 1]
    assert (
        "Rank 1 waits in recv from rank 0 at line 5, but rank 0 waits in send to rank 2"
        in d.verdict
    )


SOURCE_P2P = "%%distributed\nt = torch.ones(4)\nif nd.rank == 1:\n    dist.recv(t, src=0)\n"


def test_a_receive_from_a_rank_that_finished_names_it_and_the_branch():
    ranks = {0: done(), 1: running(p2p("recv", 0, 4))}
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=SOURCE_P2P)
    assert d.kind == "p2p-missing" and d.culprits == [0] and d.line == 4
    assert d.verdict.startswith(
        "Rank 1 waits in recv from rank 0 at line 4, but rank 0 finished the cell without sending "
        "to it. Line 4 is inside `if nd.rank == 1:` (line 3)"
    )


def test_a_receive_from_a_rank_that_went_into_a_collective():
    ranks = {0: running(rec(1, "all_reduce", 7)), 1: running(p2p("recv", 0, 4))}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "p2p-missing" and d.culprits == [0]
    assert (
        "but rank 0 went on without sending to it: it waits in all_reduce #1 at line 7" in d.verdict
    )


def test_a_receive_from_a_rank_that_raised_is_the_raise():
    ranks = {0: raised("ValueError", "x", 3)}
    ranks[1] = running(p2p("recv", 0, 4))
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "raised" and d.culprits == [0]
    assert "rank 1 waits in recv from rank 0 at line 4 that will never come" in d.verdict


# ---- collectives torch issues inside a library call ------------------------------------

LIB = "/venv/lib/python3.11/site-packages/torch/distributed/tensor/_api.py"
SOURCE_LIB = (
    "%%distributed\nw = model.weight\nfull = None\nx = 1\ny = 2\nz = 3\n"
    "if nd.rank == 0:\n    full = w.full_tensor()\n"
)


def in_library(op="all_gather", func="full_tensor", line=8, file=LIB):
    snap = running(None, stack=[frame(line), frame(350, func, file), frame(90, "wait", file)])
    snap.snap["internal"] = {"op": op, "seq": 3, "sizes": [[4, 4]], "group": "default"}
    snap.snap["stack"][0]["code"] = "full = w.full_tensor()"
    return snap


def test_a_library_collective_on_some_ranks_names_the_call_the_branch_and_the_fix():
    d = diagnose({0: in_library(), 1: done()}, now=NOW, cell_file=CELL, source=SOURCE_LIB)
    assert d.kind == "library" and d.culprits == [0] and d.line == 8
    assert d.verdict.startswith(
        "Rank 0 waits in all_gather, a collective torch issued inside full_tensor() "
        "(torch/distributed/tensor/_api.py), called at line 8 (`full = w.full_tensor()`), while "
        "rank 1 finished the cell without calling it. Line 8 is inside `if nd.rank == 0:` (line 7)"
    )
    assert "Call it on every rank (it gathers the shards)" in d.verdict
    assert "No rank is in a collective" not in d.verdict
    assert (
        d.rows[0]["state"] == "in an internal collective"
        and d.rows[0]["op"] == "all_gather (torch)"
    )


def test_a_state_dict_gathered_on_rank_0_only_gets_the_rank_0_idiom():
    d = diagnose({0: in_library(func="get_model_state_dict"), 1: done()}, now=NOW, cell_file=CELL)
    assert d.kind == "library" and d.culprits == [1]
    assert "then save on rank 0 only" in d.verdict and "torch.save(sd, path)" in d.verdict


def test_every_rank_in_the_same_library_collective_is_stalled_not_python():
    d = diagnose({0: in_library(), 1: in_library()}, now=NOW, cell_file=CELL)
    assert d.kind == "stalled" and "Every rank waits in all_gather" in d.verdict


SITE = "/venv/lib/python3.11/site-packages/torch"


def library_stack(line=8, func="full_tensor", inner=None):
    """A rank blocked under a library call, as its main thread's stack reads: the cell's
    line, the library's frames, then what it waits in (default: a functional collective's
    wait_tensor, inside torch's op dispatch)."""
    inner = inner or [
        frame(141, "wait_tensor", f"{SITE}/distributed/_functional_collectives.py"),
        frame(1123, "__call__", f"{SITE}/_ops.py"),
    ]
    stack = [frame(line), frame(572, func, LIB), frame(281, "redistribute_local_tensor", LIB)]
    stack[0]["code"] = "full = w.full_tensor()"
    return running(None, stack=stack + inner)


def test_a_library_collective_is_seen_in_the_stack_where_the_flight_recorder_is_blind():
    # torch before 2.8 records no Gloo collective, nor does TORCH_FR_BUFFER_SIZE=0: no
    # "internal" entry, yet the rank is not "running Python"
    d = diagnose({0: library_stack(), 1: done()}, now=NOW, cell_file=CELL, source=SOURCE_LIB)
    assert d.kind == "library" and d.culprits == [0] and d.line == 8
    assert d.verdict.startswith(
        "Rank 0 waits in a collective torch issued inside full_tensor() "
        "(torch/distributed/tensor/_api.py), called at line 8 (`full = w.full_tensor()`), while "
        "rank 1 finished the cell without calling it. Line 8 is inside `if nd.rank == 0:` (line 7)"
    )
    assert d.rows[0]["state"] == "in an internal collective"
    assert d.rows[0]["op"] == "collective (torch)"


def test_a_c10d_call_the_tracker_did_not_see_is_named_from_the_stack():
    c10d = frame(4321, "_store_based_barrier", f"{SITE}/distributed/distributed_c10d.py")
    d = diagnose(
        {0: library_stack(func="new_group", inner=[c10d]), 1: done()}, now=NOW, cell_file=CELL
    )
    assert d.kind == "library"
    assert d.verdict.startswith("Rank 0 waits in store_based_barrier, a collective torch issued")
    assert d.rows[0]["op"] == "store_based_barrier (torch)"


def test_python_inside_torch_distributed_is_still_python():
    # DTensor's sharding propagation is Python: a rank busy there waits for no peer
    busy = frame(200, "propagate_op_sharding", f"{SITE}/distributed/tensor/_sharding_prop.py")
    for snap in (library_stack(inner=[busy]), running(None, stack=[busy])):
        d = diagnose({0: snap, 1: done()}, now=NOW, cell_file=CELL)
        assert d.rows[0]["state"] == "running Python", d.text()


# ---- the GPU ----------------------------------------------------------------------------


def on_gpu(nccl=None, line=5):
    snap = running(None, stack=[frame(line)])
    snap.snap["gpu_wait"] = {"nccl": nccl, "since": 995.0}
    return snap


def test_a_rank_in_a_long_kernel_is_busy_on_the_gpu_not_running_python():
    ranks = {0: running(rec(1, "all_reduce", 6)), 1: on_gpu(line=5)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "gpu-busy" and d.culprits == [1]
    assert d.verdict.startswith("Rank 1 is busy on the GPU (a kernel still running")
    assert d.rows[1]["state"] == "busy on the GPU" and d.rows[1]["waiting"] == "5.0 s"


def test_nccl_conditional_collective_reads_as_on_gloo():
    # NCCL returns from the call at once: the divergence is in the ranks' history, and the
    # host threads wait for the GPU behind the collective that never completes
    b = dict(rec(1, "broadcast", 4), t1=991.0)
    a = dict(rec(1, "all_reduce", 5), t1=991.0)
    nccl = {"op": "broadcast", "seq": 1, "sizes": [[4]]}
    ranks = {0: on_gpu(nccl, line=6), 1: on_gpu(dict(nccl, op="all_reduce"), line=6)}
    ranks[0].snap["history"] = [b]
    ranks[1].snap["history"] = [a]
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=SOURCE)
    assert d.kind == "conditional" and d.culprits == [0] and d.line == 4
    assert "Line 4 is inside `if dist.get_rank() == 0:` (line 3)" in d.verdict
    assert d.rows[0]["state"] == "waiting on the GPU" and d.rows[0]["op"] == "broadcast (NCCL)"


# ---- a verdict agrees with its table -------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

IN_A_COLLECTIVE = (
    "in collective",
    "in an internal",
    "in backward",
    "in send",
    "in recv",
    "in isend",
    "in irecv",
    "waiting on the GPU",
)


#: what a tracked collective's record holds that every rank must pass alike, each with two
#: or more values: op, shapes, dtypes, root, reduce op, group; and the async flag (said, but
#: it need not agree: it changes when the rank waits, not what goes on the wire)
COMPARED_OPS = ["all_reduce", "broadcast", "reduce", "scatter", "gather", "all_gather"]
VARIANTS = {
    "op": COMPARED_OPS,
    "shapes": [((4,),), ((2, 3),)],
    "dtypes": [("float32",), ("float64",)],
    "root": [0, 1],
    "reduce_op": ["SUM", "MAX"],
    "group": ["default", "pg-1"],
    "async_op": [False, True],
}


def collective(op, shapes, dtypes, root, reduce_op, group, async_op, seq=1, line=3, n=2):
    """A record as the tracker makes it (its own ``agreeing_args``) for this call."""
    from notebook_dist.runtime.tracker import agreeing_args

    bound = {"src": root, "dst": root, "op": reduce_op, "async_op": async_op}
    group_ranks = None if group == "default" else tuple(range(n))
    args = agreeing_args(op, bound, group_ranks)
    return rec(seq, op, line, shapes, dtypes, group, group_ranks, args=args)


def compared(record: dict) -> dict:
    """Every argument of a record the ranks must pass alike (all but the async flag)."""
    out = {k: repr(record[k]) for k in ("op", "shapes", "dtypes", "group")}
    out.update({k: repr(v) for k, v in (record.get("args") or {}).items() if k != "async_op"})
    return out


@st.composite
def snapshots(draw):
    n = draw(st.integers(2, 4))
    ranks = {}
    for r in range(n):
        kind = draw(
            st.sampled_from(
                [
                    *("coll", "p2p", "pending", "internal", "blind", "backward"),
                    *("python", "done", "gpu", "error"),
                ]
            )
        )
        peer = draw(st.sampled_from([x for x in range(n) if x != r] + [None]))
        to = peer if peer is not None else (r + 1) % n  # a send always names its peer
        op = draw(st.sampled_from(["all_reduce", "broadcast", "all_gather"]))
        seq = draw(st.integers(1, 3))
        line = draw(st.integers(2, 9))
        if kind == "coll":
            ranks[r] = running(
                collective(
                    draw(st.sampled_from(COMPARED_OPS)),
                    **{k: draw(st.sampled_from(v)) for k, v in VARIANTS.items() if k != "op"},
                    seq=seq,
                    line=line,
                    n=n,
                )
            )
        elif kind == "p2p":
            ranks[r] = running(
                p2p(
                    draw(st.sampled_from(["send", "recv"])), peer, line, tag=draw(st.integers(0, 1))
                )
            )
        elif kind == "pending":
            ranks[r] = running(None, stack=[frame(line)])
            op = draw(st.sampled_from(["isend", "irecv"]))
            ranks[r].snap["p2p_pending"] = [p2p(op, to if op == "isend" else peer, line)]
        elif kind == "internal":
            ranks[r] = in_library(op=op, line=line)
        elif kind == "blind":  # the same, seen in the stack alone
            ranks[r] = library_stack(line=line)
        elif kind == "backward":
            ranks[r] = running(None, stack=[frame(line), frame(600, "backward", "/t/_tensor.py")])
        elif kind == "python":
            ranks[r] = running(None, stack=[frame(line)])
        elif kind == "gpu":
            ranks[r] = on_gpu(draw(st.sampled_from([None, {"op": op, "seq": seq}])), line)
        elif kind == "error":
            ranks[r] = raised("ValueError", "x", line)
        else:
            ranks[r] = done([rec(s, op, line) for s in range(1, seq)])
    return ranks


@settings(max_examples=400, deadline=None)
@given(snapshots(), st.sampled_from([None, SOURCE, SOURCE_P2P, SOURCE_LIB]))
def test_a_verdict_never_contradicts_its_table(ranks, source):
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=source)
    states = [row["state"] for row in d.rows]
    if any(s.startswith(IN_A_COLLECTIVE) for s in states):
        assert "No rank is in a collective" not in d.verdict, (states, d.verdict)
        assert d.kind != "none", (states, d.verdict)
    if "network" in d.verdict:  # blamed only when every rank is in the same kind of collective
        kinds = {s.split(" #")[0].split(" (")[0] for s in states}
        assert len(kinds) == 1 and kinds <= {
            "in collective",
            "in an internal collective",
            "in backward",
            "waiting on the GPU",
        }, (states, d.verdict)
    if any(s.startswith(("in send", "in recv", "in isend", "in irecv")) for s in states):
        assert "network" not in d.verdict, (states, d.verdict)
    if "with matching arguments" in d.verdict:  # said only when every compared one matches
        recs = [v.snap["collective"] for v in ranks.values()]
        assert len({repr(compared(x)) for x in recs}) == 1, (recs, d.verdict)
    for r in d.culprits:  # every rank a verdict blames is a rank of the table
        assert r in ranks
    assert d.verdict and d.rule


@st.composite
def one_collective(draw):
    """Every rank in the same collective, some of its arguments drawn per rank."""
    n = draw(st.integers(2, 4))
    base = {k: draw(st.sampled_from(v)) for k, v in VARIANTS.items()}
    varied = draw(st.sets(st.sampled_from(sorted(VARIANTS)), max_size=2))
    return {
        r: running(
            collective(**dict(base, **{k: draw(st.sampled_from(VARIANTS[k])) for k in varied}), n=n)
        )
        for r in range(n)
    }


#: how a verdict shows each rank's value of a differing argument
SHOWN = {
    "op": lambda x: f"called {x['op']}",
    "shapes": lambda x: shape_text(x["shapes"]),
    "dtypes": lambda x: "/".join(x["dtypes"]),
    "group": lambda x: x["group"],
    "src": lambda x: f"src={x['args']['src']}",
    "dst": lambda x: f"dst={x['args']['dst']}",
    "reduce_op": lambda x: f"op={x['args']['reduce_op']}",
}


@settings(max_examples=300, deadline=None)
@given(one_collective())
def test_matching_is_said_only_when_every_compared_argument_matches(ranks):
    recs = {r: v.snap["collective"] for r, v in ranks.items()}
    seen = [compared(x) for x in recs.values()]
    differ = [k for k in seen[0] if len({repr(c.get(k)) for c in seen}) > 1]
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert ("with matching arguments" in d.verdict) == (not differ), (differ, d.verdict)
    if not differ:
        return
    assert "network" not in d.verdict, (differ, d.verdict)
    if "group" in differ:
        return  # named in the table alone so far: see the test below
    # the verdict names the argument the ranks disagree on first (op, then the tensors,
    # then the others), with each rank's value
    first = next(k for k in ("op", "shapes", "dtypes", "src", "dst", "reduce_op") if k in differ)
    for x in recs.values():
        assert SHOWN[first](x) in d.verdict, (first, recs, d.verdict)


def test_ranks_in_one_collective_on_different_groups_are_told_which_group_each_uses():
    ranks = {
        0: running(collective("all_reduce", ((4,),), ("float32",), 0, "SUM", "default", False)),
        1: running(collective("all_reduce", ((4,),), ("float32",), 0, "SUM", "pg-1", False)),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert "matching" not in d.verdict and "network" not in d.verdict
    assert "default" in d.verdict and "pg-1" in d.verdict, d.verdict
    assert d.kind == "groups" and d.culprits == [0, 1]
    assert (
        "rank 0 waits in all_reduce #1 on the default group" in d.verdict
        and "rank 1 waits in all_reduce #1 on process group pg-1" in d.verdict
    ), d.verdict


SOURCE_LOOP = "%%distributed\nt = torch.ones(1)\nfor step in range(3 if nd.rank == 0 else 2):\n    dist.all_reduce(t)\n"


def test_a_loop_whose_length_depends_on_the_rank_is_named():
    hist = [dict(rec(1, "all_reduce", 4), t1=1.0), dict(rec(2, "all_reduce", 4), t1=1.0)]
    ranks = {0: running(rec(3, "all_reduce", 4), hist), 1: done(hist)}
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=SOURCE_LOOP)
    assert d.kind == "finished" and d.culprits == [1] and d.line == 4
    assert (
        "Line 4 is inside `for step in range(3 if nd.rank == 0 else 2):` (line 3), which runs a "
        "different number of times on different ranks" in d.verdict
    )
    assert rank_loop("while nd.rank < n:\n    x()\n", 2) == (1, "while nd.rank < n")
    assert rank_loop("for i in range(3):\n    x()\n", 2) is None  # not about the rank


# ---- every argument compared; helpers named ------------------------------------------------

ROOTED = [
    ("broadcast", "src", "rank 0 broadcasts from src=0 and rank 1 from src=1"),
    ("reduce", "dst", "rank 0 reduces to dst=0 and rank 1 to dst=1"),
    ("scatter", "src", "rank 0 scatters from src=0 and rank 1 from src=1"),
    ("gather", "dst", "rank 0 gathers to dst=0 and rank 1 to dst=1"),
]


@pytest.mark.parametrize("op, root, said", ROOTED)
def test_ranks_that_disagree_on_the_root_are_named_with_each_value(op, root, said):
    ranks = {r: running(rec(1, op, 3, args={root: r, "async_op": False})) for r in (0, 1)}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "argument" and d.culprits == [0, 1] and d.line == 3
    assert d.verdict.startswith(f"At {op} #1 (line 3) the ranks pass different {root}: {said}. ")
    assert f"Every rank must pass the same {root}" in d.verdict
    assert "matching" not in d.verdict and "network" not in d.verdict


def test_the_same_root_on_every_rank_and_only_async_differing_is_matching():
    ranks = {
        0: running(rec(1, "broadcast", 3, args={"src": 0, "async_op": True})),
        1: running(rec(1, "broadcast", 3, args={"src": 0, "async_op": False})),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "stalled" and "with matching arguments" in d.verdict


def test_three_ranks_two_roots_and_the_reduce_op():
    ranks = {
        0: running(rec(1, "broadcast", 3, args={"src": 0})),
        1: running(rec(1, "broadcast", 3, args={"src": 0})),
        2: running(rec(1, "broadcast", 3, args={"src": 2})),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert "ranks 0, 1 broadcast from src=0 and rank 2 from src=2" in d.verdict
    ops = {
        r: running(rec(1, "all_reduce", 4, args={"reduce_op": o}))
        for r, o in enumerate("SUM MAX".split())
    }
    d = diagnose(ops, now=NOW, cell_file=CELL)
    assert d.verdict.startswith(
        "At all_reduce #1 (line 4) the ranks pass different op: rank 0 passes op=SUM and rank 1 "
        "passes op=MAX. Every rank must reduce with the same op."
    )


HELPER_CELL = "%%distributed\nt = torch.ones(2)\nif nd.rank == 0:\n    evaluate(t)\n"


def test_a_collective_in_a_helper_from_an_earlier_cell_names_the_helper_and_the_call():
    helper = dict(rec(1, "all_reduce", 4), where=("Cell In[2]", 4), func="evaluate", site=(CELL, 4))
    ranks = {0: running(helper), 1: done()}
    d = diagnose(ranks, now=NOW, cell_file=CELL, source=HELPER_CELL)
    assert d.kind == "conditional" and d.line == 4 and d.culprits == [0]
    assert d.verdict.startswith(
        "Rank 0 called all_reduce #1 at line 4 of evaluate() in Cell In[2], called from line 4 of "
        "this cell, but rank 1 finished the cell without calling it. The call at line 4 is inside "
        "`if nd.rank == 0:` (line 3)"
    )
    assert (
        d.rows[0]["where"] == "line 4 of evaluate() in Cell In[2], called from line 4 of this cell"
    )


def test_a_helper_defined_in_the_same_cell_is_named_with_its_call_site():
    source = "%%distributed\ndef step(t):\n    dist.all_reduce(t)\nt = torch.ones(2)\nif nd.rank == 0:\n    step(t)\n"
    inner = dict(rec(1, "all_reduce", 3), func="step", site=(CELL, 6))
    d = diagnose({0: running(inner), 1: done()}, now=NOW, cell_file=CELL, source=source)
    assert "all_reduce #1 at line 3 in step() (called at line 6)" in d.verdict
    assert "The call at line 6 is inside `if nd.rank == 0:` (line 5)" in d.verdict


# ---- a Gloo abort names what each rank passed (ended.abort_hint) -----------------------------


def aborted(record=None, line=3):
    fault = {"op": "all_reduce", "line": line, "file": CELL}
    if record is not None:
        fault["record"] = record
    return RankReport("dead", {}, "was killed by SIGABRT", fault=fault)


def test_an_abort_names_each_ranks_tensors_from_the_records():
    ranks = {
        0: aborted(rec(1, "all_reduce", 3)),
        1: running(rec(1, "all_reduce", 3, dtypes=("float64",))),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "dead" and d.culprits == [0]
    assert (
        " Gloo aborted rank 0 in all_reduce #1 at line 3, where the ranks passed: rank 0 (4,) "
        "float32; rank 1 (4,) float64. Every rank must pass tensors of the same shape and dtype "
        "to one collective (%%distributed --check-collectives compares them first, with every "
        "rank kept alive)." in d.verdict
    ), d.verdict
    assert "the others' arguments were not seen" not in d.verdict
    assert "Gloo aborts a rank when" not in d.verdict  # the general sentence gives way


def test_an_abort_reads_the_same_collective_only_and_names_another_op():
    # rank 1's earlier collective (#1) and one of another group with the same number are
    # not the one rank 0 died in; its #2 is, and it is another op
    ranks = {
        0: aborted(rec(2, "all_reduce", 5, shapes=((2, 3),))),
        1: running(
            rec(2, "broadcast", 5, shapes=((6,),)),
            [
                dict(rec(1, "all_reduce", 4, shapes=((9,),)), t1=991.0),
                dict(rec(2, "all_gather", 4, group="pg-1", group_ranks=(0, 1)), t1=991.0),
            ],
        ),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert (
        "Gloo aborted rank 0 in all_reduce #2 at line 5, where the ranks passed: rank 0 (2, 3) "
        "float32; rank 1 broadcast of (6,) float32." in d.verdict
    ), d.verdict
    assert "(9,)" not in d.verdict and "all_gather" not in d.verdict


def test_an_abort_whose_peers_were_not_seen_says_so_and_without_a_record_falls_back():
    ranks = {0: aborted(rec(1, "all_reduce", 3)), 1: done()}
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert (
        "where the ranks passed: rank 0 (4,) float32 (the others' arguments were not seen)."
        in d.verdict
    ), d.verdict
    d = diagnose({0: aborted(), 1: done()}, now=NOW, cell_file=CELL)
    assert "Gloo aborted rank" not in d.verdict
    assert (
        "Gloo aborts a rank when the tensors of one collective differ in shape or dtype across "
        "ranks: check what each rank passes there." in d.verdict
    ), d.verdict


# ---- a broken group: torch's timeout or a closed pair (runtime.group, the tracker, the watch) --

#: torch's own words, as Gloo and NCCL raise them
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms "
    "for recv operation to complete"
)
GLOO_PAIR_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure"
)
GLOO_PEER_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
    "[127.0.0.1]:8086\nException raised from recvBytes ... GLHF!"
)
NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=8000) ran for 8003 milliseconds "
    "before timing out."
)
NCCL_ABORTED = "NCCL communicator was aborted on rank 1."


@pytest.fixture
def group_state(monkeypatch):
    """A rank's state with its group whole, as each test finds it."""
    from notebook_dist.runtime.state import STATE

    monkeypatch.setattr(STATE, "group_broken", None)
    return STATE


def raised_from(text: str, filename: str) -> BaseException:
    """``RuntimeError(text)`` raised in a frame of ``filename``: where it came from."""
    code = compile("raise RuntimeError(text)", filename, "exec")
    try:
        exec(code, {"text": text})
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


TORCH_FILE = "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize(
    "text, kind, why",
    [
        (GLOO_TIMEOUT, "timeout", "Timed out waiting 8000ms for recv operation to complete"),
        (GLOO_PAIR_CLOSED, "closed", "Application timeout caused pair closure"),
        (GLOO_PEER_CLOSED, "closed", "Connection closed by peer [127.0.0.1]:8086"),
        (NCCL_TIMEOUT, "timeout", NCCL_TIMEOUT.removeprefix("[Rank 0] ")),
        (NCCL_ABORTED, "closed", NCCL_ABORTED),
    ],
)
def test_torchs_own_words_break_the_group(group_state, text, kind, why):
    from notebook_dist.runtime.group import note_failure

    said = note_failure(raised_from(text, TORCH_FILE), in_collective=False)
    assert said == {"kind": kind, "why": why} and group_state.group_broken == said


def test_a_users_own_socket_error_or_another_error_breaks_nothing(group_state):
    from notebook_dist.runtime.group import note_failure

    mine = raised_from("Connection reset by peer", "Cell In[3]")  # the user's own socket
    assert note_failure(mine, in_collective=False) is None
    assert note_failure(ConnectionResetError(104, "Connection reset by peer"), False) is None
    # torch's other errors leave the group whole, even from inside a collective
    assert note_failure(raised_from("Tensors must be contiguous", TORCH_FILE), True) is None
    assert group_state.group_broken is None


def test_the_first_break_is_kept_with_the_record_of_its_collective(group_state):
    from notebook_dist.runtime.group import note_failure

    first = rec(1, "all_reduce", 4)
    note_failure(RuntimeError(GLOO_TIMEOUT), in_collective=True, record=first)
    later = note_failure(RuntimeError(GLOO_PEER_CLOSED), in_collective=True)
    assert later is group_state.group_broken
    assert later["kind"] == "timeout" and later["record"] is first


def test_a_ddp_modules_rebuild_lends_its_new_group_as_the_default_to_its_own_thread():
    """A DDP module's reducer is made anew on its new group by DDP's own unpickling
    (``runtime.group._rebuild_reducer``), which takes torch's default group: for that time
    DDP sees the new group as the default in the rebuilding thread only. A thread of the
    user's that makes a DDP module meanwhile gets the real default, and after it every
    thread does."""
    import threading
    from types import SimpleNamespace

    from notebook_dist.runtime.group import _rebuild_reducer

    ddp = SimpleNamespace(_get_default_group=lambda: "default")  # (DDP's module, its one use)
    seen = {}

    class Module:
        process_group = "old"

        def __getstate__(self):
            return {}

        def __setstate__(self, state):
            seen["here"] = ddp._get_default_group()
            other = threading.Thread(target=lambda: seen.update(other=ddp._get_default_group()))
            other.start()
            other.join()

    module = Module()
    _rebuild_reducer(ddp, module, "new")
    assert seen == {"here": "new", "other": "default"}
    assert module.process_group == "new" and ddp._get_default_group() == "default"


def tracked_all_reduce(monkeypatch, error: BaseException):
    """The tracker's wrapper around an all_reduce that raises ``error``, on a fresh tracker."""
    import torch  # noqa: F401  (the tracker reads tensors through sys.modules)

    from notebook_dist.runtime import tracker

    monkeypatch.setattr(tracker, "TRACKER", tracker.Tracker())

    def all_reduce(tensor, op=None, group=None, async_op=False):
        raise error

    return tracker._wrap_collective("all_reduce", all_reduce)


def test_a_timeout_caught_in_another_thread_still_marks_the_group_broken(group_state, monkeypatch):
    import threading

    import torch

    all_reduce = tracked_all_reduce(monkeypatch, RuntimeError(GLOO_TIMEOUT))
    caught = []

    def user_code():  # a thread that catches torch's error and goes on
        try:
            all_reduce(torch.ones(2))
        except RuntimeError as exc:
            caught.append(str(exc))

    thread = threading.Thread(target=user_code, name="saver")
    thread.start()
    thread.join()
    assert caught == [GLOO_TIMEOUT]
    broken = group_state.group_broken
    assert broken["kind"] == "timeout" and broken["why"].startswith("Timed out waiting 8000ms")
    assert broken["record"]["op"] == "all_reduce" and broken["record"]["seq"] == 1
    assert broken["record"]["thread"] == "saver" and broken["record"]["failed"]
    assert broken["record"]["t1"] >= broken["record"]["t0"]  # how long it waited is known


def test_a_tracked_collective_that_raises_something_else_breaks_nothing(group_state, monkeypatch):
    import torch

    all_reduce = tracked_all_reduce(monkeypatch, ValueError("bad"))
    with pytest.raises(ValueError):
        all_reduce(torch.ones(2))
    assert group_state.group_broken is None


def view(rank, status="done", broken=None, error=None, history=()):
    from notebook_dist.watch.progress import RankView

    result = {"status": status, "group_broken": broken}
    if error is not None:
        result["error"] = error
    snap = {"collective": None, "history": list(history), "stack": []}
    return RankView(rank, status=status, snap=snap, result=result)


def test_the_watch_reads_a_timeout_whether_the_cell_raised_or_caught_it():
    from notebook_dist.watch.inputs import broken, doctor_input, timed_out

    waited = dict(rec(1, "all_reduce", 5), t1=998.0, failed=True)
    caught = {"kind": "timeout", "why": "Timed out waiting 8000ms", "record": waited}
    views = {0: view(0, broken=caught, history=[waited]), 1: view(1)}
    assert broken(views) == {0: caught} and timed_out(views) == {0: waited}
    # as it was while it waited: in that collective, not past it
    report = doctor_input(views, CELL, fault_report=None, before_release=True)
    assert report[0].status == "running" and report[1].status == "done"
    assert report[0].snap["collective"] == rec(1, "all_reduce", 5)
    assert report[0].snap["history"] == []
    d = diagnose(report, now=NOW, cell_file=CELL, source=TIMED_CELL)
    assert d.kind == "conditional" and d.culprits == [0] and d.line == 5
    # a raised one: its record travels with the error
    raised_views = {
        0: view(0, "error", {"kind": "timeout", "why": "x"}, {"record": waited}),
        1: view(1),
    }
    assert timed_out(raised_views) == {0: waited}
    # closed pairs broke it, no timeout: nobody is said to have waited out torch's timeout
    closed = {1: view(1, broken={"kind": "closed", "why": "Connection closed by peer"})}
    assert timed_out({**closed, 0: view(0)}) == {}


def test_a_rank_released_in_python_and_interrupted_reads_as_interrupted():
    """A dead rank's peer is released and interrupted in one poll when the kernel polls
    late (a busy machine): released from a collective, it reads as it waited there; in
    Python code, the release freed it from nothing and the interrupt is what it did (the
    verdict said it "still runs Python code, which the interrupt did not stop")."""
    from notebook_dist.watch.inputs import doctor_input

    interrupted = {"ename": "KeyboardInterrupt", "evalue": "", "traceback": ""}
    python, waiting = view(0, "error", error=interrupted), view(1, "error", error=interrupted)
    python.released, python.before_release = True, {"collective": None, "stack": []}
    waiting.released = True
    waiting.before_release = {"collective": rec(1, "all_reduce", 5), "stack": []}
    report = doctor_input({0: python, 1: waiting}, CELL, fault_report=None, before_release=True)
    assert report[0].status == "error" and report[0].error[0] == "KeyboardInterrupt"
    assert report[1].status == "running" and report[1].snap["collective"]["op"] == "all_reduce"


FAULT_FILE = """Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "Cell In[4]", line 4 in <module>
  File "/x/notebook_dist/runtime/cell.py", line 210 in run_cell
"""


def test_a_rank_found_dead_after_its_release_reads_as_dead_with_the_signal_its_fault_names():
    """A rank on another host that died of a fatal signal is found dead only when the
    controller's heartbeat misses it, seconds after its peers raised and it was released
    with them: it reads as dead (not as waiting where it was released), and as killed by
    the signal its fault file names (the notebook cannot see its exit status)."""
    from notebook_dist.cluster.reports import _from_stacks
    from notebook_dist.phrases import HEARTBEAT_GONE, UNSEEN_EXITS
    from notebook_dist.runtime.witness import ENDED_NOTE
    from notebook_dist.watch.inputs import doctor_input

    fault: dict = {}
    _from_stacks(FAULT_FILE, fault)
    assert fault == {"signal": "SIGSEGV", "file": "Cell In[4]", "line": 4}
    closed = {"ename": "RuntimeError", "evalue": "Connection closed by peer", "traceback": ""}
    waiting, dead = view(0, "error", error=closed), view(1, "dead")
    waiting.released = dead.released = True
    for v in (waiting, dead):
        v.before_release = {"collective": rec(1, "all_reduce", 5), "stack": []}
    dead.exit, dead.result = HEARTBEAT_GONE, None
    views = {0: waiting, 1: dead}
    report = doctor_input(views, "Cell In[4]", {1: fault}.get, before_release=True)
    assert report[1].status == "dead" and report[1].exit == "was killed by SIGSEGV"
    assert report[0].status == "running"  # as it waited when it was released
    d = diagnose(report, now=NOW, cell_file="Cell In[4]", source=TIMED_CELL)
    assert d.kind == "dead" and d.culprits == [1], d.verdict
    assert d.verdict.startswith("rank 1 was killed by SIGSEGV at line 4."), d.verdict
    # a rank whose exit was seen keeps it
    dead.exit = "was killed by SIGABRT"
    assert doctor_input(views, "Cell In[4]", {1: fault}.get)[1].exit == "was killed by SIGABRT"
    # a cell's os._exit() leaves its code above its stack
    from notebook_dist.runtime.state import EXIT_NOTE

    ended: dict = {}
    _from_stacks(f"{EXIT_NOTE}3\n" + FAULT_FILE.split("\n\n", 1)[1], ended)
    assert ended == {"exit_code": 3, "file": "Cell In[4]", "line": 4}
    dead.exit = HEARTBEAT_GONE
    assert doctor_input(views, "Cell In[4]", {1: ended}.get)[1].exit == "exited with code 3"
    # a rank killed from outside (the OOM killer's SIGKILL) leaves no stack: its witness
    # wrote its exit status (runtime.witness), which is said before what the stacks say
    killed: dict = {}
    _from_stacks(f"{ENDED_NOTE}-9\n", killed)
    assert killed == {"status": -9}
    assert doctor_input(views, "Cell In[4]", {1: killed}.get)[1].exit == "was killed by SIGKILL"
    both: dict = {}
    _from_stacks(FAULT_FILE + f"\n{ENDED_NOTE}-11\n", both)
    assert doctor_input(views, "Cell In[4]", {1: both}.get)[1].exit == "was killed by SIGSEGV"
    # every way of finding a rank gone without its exit status is read so
    for unseen in UNSEEN_EXITS:
        dead.exit = unseen
        assert doctor_input(views, "Cell In[4]", {1: killed}.get)[1].exit == "was killed by SIGKILL"


TIMED_CELL = (
    "%%distributed\nt = torch.ones(2)\nif nd.rank == 0:\n    try:\n        dist.all_reduce(t)\n"
    "    except RuntimeError:\n        pass\n"
)


def test_the_report_of_a_broken_group_says_who_waited_where_for_how_long():
    import io

    from notebook_dist.watch.report import Reporter

    reporter = Reporter(io.StringIO(), CELL)
    waited = dict(rec(1, "all_reduce", 5, t0=990.0), t1=998.04)
    said = reporter.broke({0: waited}, {0: {"kind": "timeout"}}, 8.0, "Rank 0 called it alone.")
    assert said == (
        "torch's collective timeout (8 s, %dist_init --timeout) ended all_reduce #1 at line 5 on "
        "rank 0, after 8.0 s of waiting. Why it waited: Rank 0 called it alone."
    )
    gone = {
        1: {"kind": "closed", "why": "Connection closed by peer [127.0.0.1]:8086"},
        0: {"kind": "closed", "why": "Application timeout caused pair closure"},
    }
    assert reporter.broke({}, gone, 8.0, None) == (
        "the process group broke in this cell (rank 0: Application timeout caused pair closure; "
        "rank 1: Connection closed by peer [127.0.0.1]:8086)."
    )


# ---- --check-collectives names what each rank passes (runtime.argcheck.mismatch_text) -------


def described(record: dict) -> dict:
    """A rank's description as the others read it: through JSON (tuples become lists)."""
    import json

    from notebook_dist.runtime.argcheck import describe

    return json.loads(json.dumps(describe(record)))


CHECK_TAIL = "(--check-collectives compared them first; every rank kept its variables)."


@pytest.mark.parametrize(
    "other, said",
    [
        (dict(dtypes=("float64",)), "different dtypes (rank 0: float32; rank 1: float64)"),
        (dict(shapes=((2, 3),)), "different shapes (rank 0: (4,); rank 1: (2, 3))"),
        (dict(args={"reduce_op": "MAX"}), "different op (rank 0: op=SUM; rank 1: op=MAX)"),
    ],
)
def test_a_mismatch_found_first_names_each_ranks_value(other, said):
    from notebook_dist.runtime.argcheck import mismatch_text

    mine = rec(1, "all_reduce", 3, args={"reduce_op": "SUM", "async_op": False})
    theirs = dict(mine, **other)
    text = mismatch_text(mine, {0: described(mine), 1: described(theirs)})
    noun = said.split()[1]
    assert text == (
        f"all_reduce #1 at line 3 was not issued: the ranks pass {said}. Every rank must pass "
        f"the same {noun} to one collective {CHECK_TAIL}"
    )


def test_a_mismatch_names_the_root_and_the_op_first_and_ignores_the_async_flag():
    from notebook_dist.runtime.argcheck import mismatch_text

    b = {r: rec(2, "broadcast", 6, args={"src": r, "async_op": bool(r)}) for r in (0, 1, 2)}
    b[2]["args"]["src"] = 0
    text = mismatch_text(b[0], {r: described(x) for r, x in b.items()})
    assert text.startswith(
        "broadcast #2 at line 6 was not issued: the ranks pass different src (rank 0: src=0; "
        "rank 1: src=1; rank 2: src=0). Every rank must pass the same src"
    ), text
    # another op and dtype at once: the op is named
    other = dict(rec(1, "all_gather", 3, dtypes=("int64",)), args={})
    text = mismatch_text(
        rec(1, "all_reduce", 3), {0: described(rec(1, "all_reduce", 3)), 1: described(other)}
    )
    assert "different op (rank 0: all_reduce; rank 1: all_gather)" in text, text
    # only the async flag differs: nothing to name
    same = {r: described(rec(1, "all_reduce", 3, args={"async_op": bool(r)})) for r in (0, 1)}
    assert len({repr(d) for d in same.values()}) == 1


def test_a_rank_in_the_debugger_is_its_users_turn_never_a_hang():
    asking = {"id": 1, "prompt": "(Pdb) ", "kind": "pdb", "where": [CELL, 4]}
    ranks = {
        0: running(rec(1, "barrier", 5)),
        1: RankReport("running", {"collective": None, "history": [], "asking": asking}),
    }
    d = diagnose(ranks, now=NOW, cell_file=CELL)
    assert d.kind == "debugger" and d.culprits == [1] and d.line == 4
    assert d.verdict.startswith(
        "Rank 1 is in the debugger at line 4, waiting for you. Meanwhile rank 0 waits in "
        "barrier #1 at line 5."
    ), d.verdict
    assert "This is not a hang" in d.verdict and "hang" not in d.verdict.split(".")[0]
    ranks[1] = RankReport("running", {"collective": None, "asking": dict(asking, kind="input")})
    assert "Rank 1 is in input() at line 4" in diagnose(ranks, now=NOW, cell_file=CELL).verdict


def test_the_dashboard_says_in_debugger_and_waiting_for_input():
    from types import SimpleNamespace

    from notebook_dist.ui.state import _state_of

    def view(kind):
        snap = {"asking": {"kind": kind}, "collective": None}
        return SimpleNamespace(released=False, status="running", snap=snap)

    assert _state_of(view("pdb"), hung=False) == "in debugger"
    assert _state_of(view("input"), hung=False) == "waiting for input"


def test_a_dead_ranks_report_is_read_again_only_until_its_witness_wrote_how_it_ended(tmp_path):
    """Each verdict of a cell reads a dead rank's report (over ssh for a rank on another
    host: about a second a call), as does each look at how it ended; once its witness
    wrote how it ended, its files change no more: it is kept, and not read again."""
    from types import SimpleNamespace

    from notebook_dist.cluster.reports import rank_report
    from notebook_dist.runtime.state import rank_file
    from notebook_dist.runtime.witness import ENDED_NOTE

    reads: list[str] = []

    def control_file(rank, kind, pid):
        reads.append(kind)
        return rank_file(str(tmp_path), kind, rank, pid)

    processes = SimpleNamespace(ended={}, host_launcher=lambda r: None, control_file=control_file)
    fault = tmp_path / "fault-rank-1-41"
    fault.write_text(FAULT_FILE)
    for _ in range(2):  # (faulthandler's stacks, no status yet: read each time)
        assert rank_report(processes, 1, 41)["signal"] == "SIGSEGV"
    fault.write_text(FAULT_FILE + f"\n{ENDED_NOTE}-11\n")
    for _ in range(3):
        report = rank_report(processes, 1, 41)
        assert report["status"] == -11 and report["line"] == 4
    assert reads.count("fault") == 3 and processes.ended == {(1, 41): report}
