"""Where the time goes: %%distributed --profile and %dist_bench on real Gloo ranks, and the
analysis on synthetic profiles (arrival skew, bandwidth formulas, the straggler rule)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from notebook_dist.bench import BenchError, parse_sizes
from notebook_dist.profile import analyze, minus

MS = 1_000_000


def _rank(
    rank,
    every,
    arrivals=None,
    transfer=1 * MS,
    busy=(),
    start=0,
    end=None,
    op="all_reduce",
    line=5,
):
    """A rank's profile of the collectives ``every`` (per collective, each rank's arrival);
    ``arrivals``: this rank's own, where they are not its column of ``every``."""
    arrivals = [x[rank] for x in every] if arrivals is None else arrivals
    colls = [
        {
            "op": op,
            "group": "0",
            "seq": i + 1,
            "bytes": 4096,
            "arrive": a,
            "start": a,
            "end": max(every[i]) + transfer,
            "line": line,
        }
        for i, a in enumerate(arrivals)
    ]
    return {
        "rank": rank,
        "start": start,
        "end": end or (max(max(x) for x in every) + 2 * MS),
        "collectives": colls,
        "busy": list(busy),
        "trace": [],
        "cuda": False,
    }


def test_the_last_rank_to_arrive_is_named_with_its_line():
    # rank 1 arrives 50 ms after rank 0 at each of 20 all_reduces
    every = [(i * 60 * MS, i * 60 * MS + 50 * MS) for i in range(20)]
    profiles = {
        0: _rank(0, every),
        1: _rank(1, every, line=7),
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


def _late_by(ms: int, cpu_wait: tuple, off_cpu: tuple = (0.0, 0.0)) -> dict:
    """Rank 1 arrives ``ms`` late at each of 20 all_reduces; each rank's cell thread waited
    ``cpu_wait`` seconds for a CPU and was ``off_cpu`` seconds off it (asleep) outside the
    collectives, and computed the rest of that time, as Linux's schedstat adds up."""
    every = [(i * 60 * MS, i * 60 * MS + ms * MS) for i in range(20)]
    profiles = {
        0: _rank(0, every),
        1: _rank(1, every, line=7),
    }
    plain = analyze(profiles, {}).ranks
    for r, (wait, off) in enumerate(zip(cpu_wait, off_cpu)):
        if wait is not None:
            busy = plain[r].wall_s - plain[r].exposed_s - wait - off
            profiles[r] |= {"cpu_wait": int(wait * 1e9), "cpu_busy": int(busy * 1e9)}
    return profiles


def test_a_rank_the_machine_held_back_gets_no_verdict_on_its_code():
    # rank 1 was last by 10 ms each time, and sat 0.18 s waiting for a CPU: rank 0 waited 0.2 s
    p = analyze(_late_by(10, (0.005, 0.18)), {0: 0, 1: 0}, "Cell In[4]")
    assert p.verdict is None and p.ranks[1].cpu_wait_s == pytest.approx(0.18)
    assert p.machine == (
        "Rank 1 arrived last at 20 of 20 all_reduces, 10 ms late on average: rank 0 waited 0.2 s "
        "(17% of the cell). But rank 1 itself waited 0.18 s for a CPU (rank 0: 0.01 s), and "
        "computed no more than the others: the machine runs more busy processes than it has "
        "cores, and that, not the code, held it back. Profile again on a quieter machine, or "
        "with fewer ranks per machine."
    )
    assert "No rank's code holds the others back. Rank 1 arrived last" in p.text()
    assert "Verdict" not in p.text() and "No rank&#x27;s code holds" in p._repr_html_()


@pytest.mark.parametrize(
    "cpu_wait, off_cpu",
    [
        ((0.001, 0.002), (0.0, 0.2)),  # it slept or read data: not runnable while it did
        ((0.15, 0.17), (0.0, 0.0)),  # both ranks waited for a CPU alike: not why rank 1 was last
        ((0.005, 0.06), (0.0, 0.0)),  # it waited a little, and computed 0.14 s more: its code
        ((None, None), (None, None)),  # no schedstat (not Linux): the verdict is as before
    ],
)
def test_the_verdict_stands_when_the_machine_does_not_explain_the_lateness(cpu_wait, off_cpu):
    p = analyze(_late_by(10, cpu_wait, off_cpu), {0: 0, 1: 0})
    assert p.machine is None
    assert p.verdict.startswith("rank 1 arrived last at 20 of 20 all_reduces, 10 ms late")
    slept = (
        "Rank 1's cell thread spent 0.20 s more than the others' off the CPU outside "
        "collectives, neither computing nor waiting for a CPU: it slept, read data or waited "
        "on a lock. Look at what rank 1 waits for before line 7."
    )
    assert p.verdict.endswith(slept if any(off_cpu) else "rank 1 does before line 7.")


def _on_a_busy_machine(ms: int, process_wait: tuple, off_cpu: tuple = (0.0, 0.0)) -> dict:
    """Rank 1 ``ms`` late at each of 20 all_reduces, its cell thread waiting for a CPU no
    more than rank 0's; each rank's threads waited ``process_wait`` seconds for one."""
    profiles = _late_by(ms, (0.03, 0.04), off_cpu)
    for r, wait in enumerate(process_wait):
        profiles[r]["process_wait"] = int(wait * 1e9)
    return profiles


def test_a_straggler_within_the_machines_own_delays_is_not_blamed_on_its_code():
    # measured beside two CPU burners on 2 cores: a balanced DDP loop, rank 1 last at 37 of
    # 44 all_reduces, 4 ms late; its cell thread computed 0.045 s more (a busy core's
    # slower CPU time), and each rank's threads waited 0.19 s for a CPU on average
    p = analyze(_on_a_busy_machine(7, (0.16, 0.22)), {0: 0, 1: 0})
    assert p.verdict is None
    assert p.machine == (
        "Rank 1 arrived last at 20 of 20 all_reduces, 7 ms late on average: rank 0 waited "
        "0.1 s (12% of the cell). But each rank's threads waited 0.19 s for a CPU on average, "
        "about as long: the machine runs more busy processes than it has cores, and it alone "
        "can keep one rank last by this much, so rank 1's code is not blamed. Profile again "
        "on a quieter machine, or with fewer ranks per machine."
    )


@pytest.mark.parametrize("process_wait", [(0.08, 0.1), (0.0, 0.0)])
def test_a_straggler_well_beyond_the_machines_delays_is_named(process_wait):
    # rank 1 computes 30 ms more a step (rank 0 waited 0.6 s) on a machine where the ranks'
    # threads waited 0.09 s for a CPU, or on an idle one
    p = analyze(_on_a_busy_machine(30, process_wait), {0: 0, 1: 0})
    assert p.machine is None and p.verdict.startswith("rank 1 arrived last at 20 of 20")
    assert p.verdict.endswith("Look at what rank 1 does before line 7.")


def test_a_rank_that_slept_is_named_however_busy_the_machine():
    # CI, beside two burners: rank 1 slept 30 ms a step and rank 0 waited 0.6 s for it, but
    # each rank's threads had waited 0.5 s for a CPU. Its cell thread was off the CPU 0.6 s
    # longer than rank 0's: not runnable, so no machine held it back
    p = analyze(_on_a_busy_machine(30, (0.45, 0.55), off_cpu=(0.01, 0.6)), {0: 0, 1: 0})
    assert p.machine is None and p.verdict.startswith("rank 1 arrived last at 20 of 20")
    assert "cell thread spent 0.59 s more than the others' off the CPU" in p.verdict
    assert (p.ranks[0].off_cpu_s, p.ranks[1].off_cpu_s) == pytest.approx((0.01, 0.6))
    # the same lateness with the thread runnable throughout is the machine's
    assert analyze(_on_a_busy_machine(30, (0.45, 0.55)), {0: 0, 1: 0}).verdict is None


def _together(ahead: int = 0) -> dict:
    """Two ranks arriving together at 20 all_reduces, rank 1's clock ``ahead`` ns ahead."""
    every = [(i * 10 * MS, i * 10 * MS) for i in range(20)]
    skewed = _rank(1, every, arrivals=[b + ahead for _, b in every])
    for c in skewed["collectives"]:
        c["end"] += ahead
    skewed["start"] += ahead
    skewed["end"] += ahead
    return {0: _rank(0, every), 1: skewed}


def test_clock_offsets_align_the_ranks():
    p = analyze(_together(ahead=500 * MS), {0: 0, 1: 500 * MS})  # its clock runs 500 ms ahead
    assert p.verdict is None and p.ranks[0].waiting_s == 0 == p.ranks[1].waiting_s


def test_ranks_on_one_machine_share_its_clock():
    # an estimate off by 3 ms (half a round trip through the controller) made rank 1 "late"
    # at every collective; on one machine there is nothing to estimate
    profiles = _together()
    assert analyze(profiles, {0: 0, 1: -3 * MS}).verdict.startswith("rank 1 arrived last")
    for p in profiles.values():
        p["clock"] = "boot-a"
    p = analyze(profiles, {0: 0, 1: -3 * MS})
    assert p.verdict is None and p.ranks[0].waiting_s == 0 == p.ranks[1].waiting_s


def test_machines_meet_on_one_clock_at_the_barrier_the_cell_began_with():
    profiles = _together(ahead=500 * MS)  # rank 1, on another machine, runs 500 ms ahead
    profiles[0] |= {"clock": "boot-a", "aligned": 5}
    profiles[1] |= {"clock": "boot-b", "aligned": 500 * MS + 5}
    p = analyze(profiles, {0: 0, 1: 497 * MS})  # the round trip's estimate, 3 ms off
    assert p.verdict is None and p.ranks[0].waiting_s == 0 == p.ranks[1].waiting_s
    profiles[1]["aligned"] = None  # a cell on some ranks only: no barrier, the estimate serves
    assert analyze(profiles, {0: 0, 1: 497 * MS}).verdict.startswith("rank 1 arrived last")


def test_balanced_ranks_get_no_verdict_and_small_skew_is_not_a_straggler():
    # rank 1 is last every time, but by 0.2 ms: not worth a verdict
    every = [(i * 10 * MS, i * 10 * MS + MS // 5) for i in range(20)]
    p = analyze({0: _rank(0, every), 1: _rank(1, every)}, {})
    assert p.verdict is None
    assert "No rank holds the others back." in p.text()


def test_compute_is_the_wall_less_exposed_communication():
    assert minus([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    every = [(0, 0)]
    busy = [(0, 5 * MS)]  # the main thread computed through the first half of the collective
    prof = _rank(0, every, transfer=10 * MS, busy=busy, end=20 * MS)
    p = analyze({0: prof, 1: _rank(1, every, transfer=10 * MS, end=20 * MS)}, {})
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


def _times(p) -> str:
    """A profile's finding, every rank's times (schedstat's included) and the kernel that
    counted them: what a failure on another machine needs to be understood."""
    kernel = f"kernel {platform.release()}, {os.cpu_count()} CPUs"
    return "\n".join([p.finding(), *map(repr, p.ranks.values()), kernel])


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
    # it slept there: off the CPU, not computing
    assert p.verdict.endswith("Look at what rank 1 waits for before line 7."), _times(p)
    assert "it slept, read data or waited on a lock." in p.verdict
    assert p.ranks[1].off_cpu_s > 0.5 > p.ranks[0].off_cpu_s
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
    assert live.clock_offsets([0, 1]) == {0: 0, 1: 0}  # one machine: one clock, nothing to guess
    # on some ranks only there is no barrier to start at: the kernel's clock places them
    alone = run("%%distributed --profile --ranks 1\nt = sum(range(100_000))")
    assert alone.error is None, alone.output
    assert session.last_profile.world == [1] and session.last_profile.verdict is None
    result = live.run("t = torch.ones(4)\ndist.all_reduce(t)")
    assert result.profile is None
    assert all("profile" not in v.result for v in live.last_watch.views.values())


def _pin(pid: int, cpu: int) -> dict[int, set[int]]:
    """Every thread of ``pid`` onto one CPU; what each allowed before."""
    before = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        before[tid] = os.sched_getaffinity(tid)
        os.sched_setaffinity(tid, {cpu})
    return before


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to give each rank its own, and Linux to pin them",
)
def test_a_rank_starved_of_cpu_is_put_down_to_the_machine(live, run):
    # each rank computes 10 ms of CPU time a step; rank 1 shares its CPU with three busy
    # loops, so it gets a small share of it and is last, its code no slower than rank 0's
    cpu = sorted(os.sched_getaffinity(0))[:2]
    loop = "print('spinning', flush=True)\nwhile True:\n    pass"
    busy = [
        subprocess.Popen(
            [sys.executable, "-c", loop], stdout=subprocess.PIPE, start_new_session=True
        )
        for _ in range(3)
    ]
    saved: dict[int, set[int]] = {}
    try:
        for spinning in busy:
            saved |= _pin(spinning.pid, cpu[1])
            assert spinning.stdout.readline() == b"spinning\n"
        for rank, c in zip(live.ranks, cpu):
            saved |= _pin(rank.pid, c)
        # a first cell under the busy loops: the scheduler has settled before the profile
        spin = "end = time.thread_time() + 0.1\nwhile time.thread_time() < end:\n    pass"
        assert run(f"%%distributed\nimport time\n{spin}").error is None
        out = run(
            "%%distributed --profile\nimport time\nt = torch.ones(1024)\nfor step in range(10):\n"
            "    end = time.thread_time() + 0.01\n    while time.thread_time() < end:\n"
            "        pass\n    dist.all_reduce(t)\n"
        )
    finally:
        for spinning in busy:
            spinning.kill()
            spinning.wait()
            spinning.stdout.close()
        for tid, cpus in saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass  # a busy loop's, or a thread that ended
    assert out.error is None, out.output
    from notebook_dist import session

    p = session.last_profile
    assert p.verdict is None, p.verdict
    assert p.machine and p.machine.startswith("Rank 1 arrived last at"), p.text()
    assert "But rank 1 itself waited" in p.machine
    assert p.ranks[1].cpu_wait_s > p.ranks[0].cpu_wait_s
    assert "No rank's code holds the others back." in p.text()


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
    every = [(0, 0)]
    gpu = _rank(0, every, transfer=10 * MS, busy=[(0, 5 * MS)], end=20 * MS)
    gpu["cuda"] = True
    p = analyze({0: gpu, 1: _rank(1, every, transfer=10 * MS, end=20 * MS)}, {})
    assert "exposed" in p.text().splitlines()[1].split()
    assert "<th style='padding:1px 8px;text-align:left'>exposed</th>" in p._repr_html_()
    cpu = analyze({0: _rank(0, every, end=20 * MS), 1: _rank(1, every, end=20 * MS)}, {})
    assert "exposed" not in cpu.text()


def test_at_sixteen_ranks_the_table_names_the_ranks_at_either_end_and_one_row_the_rest():
    """Rank 5 arrives 50 ms late at each all_reduce of 16 ranks: the table names it (most
    compute, waits least) and the rank that waits most, and gives the 14 others one row of
    ranges; the timeline draws their two lanes. full=True gives every rank its row."""
    n = 16
    every = [
        tuple(i * 60 * MS + (50 * MS if r == 5 else r * MS // 10) for r in range(n))
        for i in range(20)
    ]
    p = analyze({r: _rank(r, every) for r in range(n)}, {}, "Cell In[4]")
    lines = p.text().splitlines()
    table = lines[1 : lines.index("")]
    assert [row.split()[0] for row in table] == ["rank", "0", "5", "1-4,", "(every"], table
    assert table[2].endswith("most compute, waits least") and table[1].endswith("waits most")
    assert table[3].endswith("the others") and "0.970-0.998 s" in table[3], table
    full = p.text(full=True).splitlines()
    assert len(full[1 : full.index("")]) == n + 1
    svg = p.timeline_svg()
    assert [f">rank {r}<" in svg for r in (0, 5, 1)] == [True, True, False], svg
    assert "the other 14 ranks' lanes: in the trace" in svg
    assert p._repr_html_().count("<tr>") == 3 + 1 + 2  # the ranks' rows, the op's, heads


def test_a_profile_without_the_flight_recorder_gives_no_verdict():
    every = [(i * 60 * MS, i * 60 * MS + 50 * MS) for i in range(5)]
    blind = {
        r: dict(_rank(r, every, arrivals=[]), unrecorded=5) for r in (0, 1)
    }  # 5 ran, none recorded
    p = analyze(blind, {0: 0, 1: 0}, "Cell In[4]")
    assert p.verdict is None and p.machine is None and p.unrecorded == [0, 1]
    assert p.finding().startswith(
        "No verdict: torch's Flight Recorder, by which the profile matches each collective "
        "across the ranks, recorded none of this cell's collectives on ranks 0, 1"
    )
    assert "No rank holds the others back" not in p.text()
    from notebook_dist.profile.view import rank_cells

    assert rank_cells(p, p.ranks[0])[2:] == ("?", "?", "?")
    # at 16 ranks, nothing known to name a rank by: one row of every rank's wall
    many = analyze({r: dict(_rank(r, every, arrivals=[]), unrecorded=5) for r in range(16)}, {})
    table = many.text().splitlines()[1:3]
    assert table[1].split()[3:] == ["?", "?", "?", "every", "rank"], table
    assert table[1].split()[0] == "0-15", table


@pytest.mark.slow
def test_a_straggler_is_not_called_balanced_when_the_flight_recorder_is_off():
    """torch before 2.8 records no Gloo collective; with the recorder off here the profile
    cannot match the ranks' collectives, and says so rather than 'No rank holds the
    others back' while rank 1 sleeps before each all_reduce."""
    from notebook_dist import DistCluster, DistConfig

    config = DistConfig(extra_env={"TORCH_FR_BUFFER_SIZE": "0"})
    with DistCluster(n=2, config=config) as blind:
        code = STRAGGLER_CELL.split("\n", 1)[1]
        r = blind.run(code, profile=True)
        r.raise_for_errors()
        assert r.profile.unrecorded == [0, 1], r.profile.text()
        assert r.profile.verdict is None and "No verdict" in r.profile.text()


BALANCED_DDP = """
import time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
g = torch.Generator().manual_seed(nd.rank)
for step in range(20):
    if nd.rank == SLOW:
        time.sleep(0.03)
    opt.zero_grad()
    net(torch.randn(64, 256, generator=g)).pow(2).mean().backward()
    opt.step()
"""


@pytest.mark.slow
def test_on_a_busy_machine_no_balanced_rank_is_blamed_and_a_slow_one_still_is(live):
    """Two processes keep both CPUs busy beside the ranks (a student's laptop, CI's 2 cores):
    in every try a balanced DDP loop gets no verdict on its code (the machine may be named,
    or no rank), and a rank that sleeps 30 ms a step is named."""
    from conftest import cpu_burners

    live.run(BALANCED_DDP.replace("SLOW", "None").replace("range(20)", "range(2)"))
    with cpu_burners(2):
        for _ in range(3):
            even = live.run(BALANCED_DDP.replace("SLOW", "None"), profile=True)
            even.raise_for_errors()
            assert even.profile.verdict is None, _times(even.profile)
            assert even.profile.finding().startswith(("No rank holds", "No rank's code holds"))
            slow = live.run(BALANCED_DDP.replace("SLOW", "1"), profile=True)
            slow.raise_for_errors()
            assert slow.profile.verdict, _times(slow.profile)
            assert slow.profile.verdict.startswith("rank 1 arrived last at"), _times(slow.profile)
