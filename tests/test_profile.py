"""Where the time goes: %%distributed --profile and %dist_bench on real Gloo ranks, and the
analysis on synthetic profiles (arrival skew, bandwidth formulas, the straggler rule)."""

from __future__ import annotations

import json

import pytest

from notebook_dist.bench import BenchError, parse_sizes
from notebook_dist.profile import _minus, analyze

MS = 1_000_000


def _rank(rank, arrivals, transfer=1 * MS, busy=(), start=0, end=None, op="all_reduce", line=5):
    colls = [
        {
            "op": op,
            "group": "0",
            "seq": i + 1,
            "bytes": 4096,
            "arrive": a,
            "start": a,
            "end": max(arrivals_all[i]) + transfer,
            "line": line,
        }
        for i, a in enumerate(arrivals)
    ]
    return {
        "rank": rank,
        "start": start,
        "end": end or (max(max(x) for x in arrivals_all) + 2 * MS),
        "collectives": colls,
        "busy": list(busy),
        "trace": [],
        "cuda": False,
    }


arrivals_all: list = []


def test_the_last_rank_to_arrive_is_named_with_its_line():
    global arrivals_all
    # rank 1 arrives 50 ms after rank 0 at each of 20 all_reduces
    arrivals_all = [(i * 60 * MS, i * 60 * MS + 50 * MS) for i in range(20)]
    profiles = {
        0: _rank(0, [a for a, _ in arrivals_all]),
        1: _rank(1, [b for _, b in arrivals_all], line=7),
    }
    p = analyze(profiles, {0: 0, 1: 0}, "Cell In[4]")
    assert p.verdict.startswith(
        "rank 1 arrived last at 20 of 20 all_reduces, 50 ms late on average: rank 0 waited 1.0 s"
    )
    assert p.verdict.endswith("Look at what rank 1 does before line 7.")
    assert p.ranks[0].waiting_s == pytest.approx(1.0) and p.ranks[1].waiting_s == 0
    assert p.ranks[0].collectives_s == pytest.approx(20 * 0.051)
    (op,) = p.ops
    assert (op.op, op.count, op.bytes) == ("all_reduce", 20, 4096)
    assert op.mean_s == pytest.approx(0.001)  # from the last arrival to completion
    assert op.busbw == pytest.approx(op.algbw * 2 * (2 - 1) / 2)  # nccl-tests: 2(n-1)/n


def test_clock_offsets_align_the_ranks():
    global arrivals_all
    arrivals_all = [(i * 10 * MS, i * 10 * MS) for i in range(10)]
    skewed = _rank(1, [b + 500 * MS for _, b in arrivals_all])  # its clock runs 500 ms ahead
    for c in skewed["collectives"]:
        c["end"] += 500 * MS
    skewed["start"] += 500 * MS
    skewed["end"] += 500 * MS
    p = analyze({0: _rank(0, [a for a, _ in arrivals_all]), 1: skewed}, {0: 0, 1: 500 * MS})
    assert p.verdict is None and p.ranks[0].waiting_s == 0 == p.ranks[1].waiting_s


def test_balanced_ranks_get_no_verdict_and_small_skew_is_not_a_straggler():
    global arrivals_all
    # rank 1 is last every time, but by 0.2 ms: not worth a verdict
    arrivals_all = [(i * 10 * MS, i * 10 * MS + MS // 5) for i in range(20)]
    p = analyze(
        {0: _rank(0, [a for a, _ in arrivals_all]), 1: _rank(1, [b for _, b in arrivals_all])}, {}
    )
    assert p.verdict is None
    assert "No rank holds the others back." in p.text()


def test_compute_is_the_wall_less_exposed_communication():
    assert _minus([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    global arrivals_all
    arrivals_all = [(0, 0)]
    busy = [(0, 5 * MS)]  # the main thread computed through the first half of the collective
    prof = _rank(0, [0], transfer=10 * MS, busy=busy, end=20 * MS)
    p = analyze({0: prof, 1: _rank(1, [0], transfer=10 * MS, end=20 * MS)}, {})
    assert p.ranks[0].exposed_s == pytest.approx(0.005) and p.ranks[0].compute_s == pytest.approx(
        0.015
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1Q-4M", "'1Q' is not a size"),
        ("4M-1K", "the first size is larger than the last"),
        ("0", "out of range"),
        ("", "--sizes is empty"),
        ("16G", "out of range"),
    ],
)
def test_bench_refuses_bad_sizes_with_a_sentence(spec, message):
    with pytest.raises(BenchError, match=message):
        parse_sizes(spec)


def test_bench_sizes():
    assert parse_sizes("1K-8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("4K,1M") == [4096, 1 << 20]
    assert parse_sizes("1MiB") == [1 << 20]


# ---- on real ranks ----------------------------------------------------------------------

STRAGGLER_CELL = (
    "%%distributed --profile\nimport time\nt = torch.ones(1024)\nfor step in range(20):\n"
    "    if nd.rank == 1:\n        time.sleep(0.05)\n    dist.all_reduce(t)\n"
)


@pytest.mark.slow
def test_a_profiled_cell_names_the_straggler_and_its_line(live, run, ip):
    out = run(STRAGGLER_CELL)
    assert out.error is None, out.output
    from notebook_dist import session

    p = session.last_profile
    assert p is not None and p.world == [0, 1]
    assert p.verdict.startswith("rank 1 arrived last at 20 of 20 all_reduces"), p.verdict
    assert p.verdict.endswith("Look at what rank 1 does before line 7."), p.verdict
    assert p.ranks[0].waiting_s > p.ranks[1].waiting_s
    assert "USDT" not in out.output and "ERROR" not in out.output  # no profiler noise per rank
    # the merged trace: JSON, one process per rank, collectives on their lane
    trace = json.load(open(p.trace_path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in trace if e.get("ph") == "X" and e["name"].startswith("all_reduce #")]
    assert (
        len([e for e in spans if e["pid"] == 0]) == 20 == len([e for e in spans if e["pid"] == 1])
    )
    again = run("%dist_profile")
    assert again.result.result is p
    assert "<svg" in p._repr_html_() and "class='nd-timeline'" in p._repr_html_()


@pytest.mark.slow
def test_balanced_ranks_get_no_verdict_and_an_unprofiled_cell_carries_no_profile(live, run):
    out = run(
        "%%distributed --profile\nt = torch.ones(1024)\nfor _ in range(20):\n    dist.all_reduce(t)"
    )
    assert out.error is None, out.output
    from notebook_dist import session

    assert session.last_profile.verdict is None, session.last_profile.verdict
    result = live.run("t = torch.ones(4)\ndist.all_reduce(t)")
    assert result.profile is None
    assert all("profile" not in v.result for v in live.last_watch.views.values())


@pytest.mark.slow
def test_dist_bench_measures_and_refuses_bad_input(live, run):
    out = run("%dist_bench all_reduce all_gather --sizes 4K-16K")
    assert out.error is None, out.output
    result = out.result.result
    assert [(r.op, r.bytes) for r in result.rows] == [
        ("all_reduce", 4096),
        ("all_reduce", 8192),
        ("all_reduce", 16384),
        ("all_gather", 4096),
        ("all_gather", 8192),
        ("all_gather", 16384),
    ]
    for r in result.rows:
        assert r.seconds > 0 and r.iters >= 3
        factor = 2 * (2 - 1) / 2 if r.op == "all_reduce" else (2 - 1) / 2
        assert r.busbw == pytest.approx(r.algbw * factor)
    assert "class='nd-chart'" in result._repr_html_()
    bad = run("%dist_bench --sizes 4M-1K")
    assert type(bad.error).__name__ == "UsageError"
    assert "the first size is larger than the last" in str(bad.error)
    assert "unknown collective 'allreduce'" in str(run("%dist_bench allreduce").error)
    assert "--dtype 'float8'" in str(run("%dist_bench --dtype float8").error)


def test_gpu_ranks_also_show_exposed_communication():
    global arrivals_all
    arrivals_all = [(0, 0)]
    gpu = _rank(0, [0], transfer=10 * MS, busy=[(0, 5 * MS)], end=20 * MS)
    gpu["cuda"] = True
    p = analyze({0: gpu, 1: _rank(1, [0], transfer=10 * MS, end=20 * MS)}, {})
    assert "exposed" in p.text().splitlines()[1].split()
    assert "<th style='padding:1px 8px;text-align:left'>exposed</th>" in p._repr_html_()
    cpu = analyze({0: _rank(0, [0], end=20 * MS), 1: _rank(1, [0], end=20 * MS)}, {})
    assert "exposed" not in cpu.text()
