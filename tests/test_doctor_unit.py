"""The doctor as a pure function, on synthetic snapshots (3+ ranks, two process groups)."""

import pytest

from notebook_dist.doctor import RankReport, diagnose, format_stacks, rank_condition
from notebook_dist.doctor.source import rank_loop

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
    text = format_stacks({r: v.snap for r, v in ranks.items()}, CELL)
    assert text.splitlines()[:2] == ["rank 0: in broadcast #1", "  line 4, in <module>"]


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
            args = draw(st.sampled_from([None, {"src": 0}, {"src": 1}, {"async_op": True}]))
            ranks[r] = running(rec(seq, op, line, args=args))
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
        agree = {
            repr({k: v for k, v in (x.get("args") or {}).items() if k != "async_op"}) for x in recs
        }
        assert len(agree) == 1, (recs, d.verdict)
    for r in d.culprits:  # every rank a verdict blames is a rank of the table
        assert r in ranks
    assert d.verdict and d.rule


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
