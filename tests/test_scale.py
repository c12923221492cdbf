"""Many ranks from one notebook (2 cores here): 16 and 32 CPU ranks start, the doctor names
the one rank that skipped a collective, the one with fewer batches and the one that died,
and every rank's output reaches the notebook whole and in order. How soon is a benchmark
(benchmarks/cases.py scale), not a test."""

from __future__ import annotations

import io
import re

import pytest
from conftest import until_verdict, wait_until

from notebook_dist import DistCluster
from notebook_dist.config import DistConfig
from notebook_dist.errors import ClusterError, RankError

pytestmark = pytest.mark.slow

HANG_AFTER = 3.0


@pytest.fixture(scope="module", params=[16, 32])
def big(request):
    c = DistCluster(n=request.param, config=DistConfig(spare_engines=0)).start()
    yield c
    c.shutdown()


#: how long a cell may take to its verdict here: with every rank loading what a first DDP
#: module needs itself, the first DDP cell on 32 ranks sharing 2 cores took about 52 s to
#: its hang; the fork server now loads it once when ranks outnumber cores
#: (DistConfig.preload_ranks): 6 s
GIVE_UP_S = 60


def verdict(cluster, code: str):
    """The doctor's verdict on the cell, and the hang it printed (its table and stacks)."""
    diag, out, _, _ = until_verdict(cluster, code, HANG_AFTER, give_up_s=GIVE_UP_S)
    assert diag is not None, f"no verdict within {GIVE_UP_S} s:\n{out[-3000:]}"
    return diag, out[out.index("no rank has made progress") :]


def test_the_rank_table_of_many_ranks_is_a_row_a_host(big):
    """%dist_init's table at 16 and 32 ranks: the ranks on this host in one row, and where
    each rank's own row is; %dist_status keeps every rank's."""
    n = big.world_size
    lines = big.table().splitlines()
    assert len(lines) == 3 and lines[1].split() == [f"0-{n - 1}", big.ranks[0].host, "cpu", "gloo"]
    assert lines[2] == "(every rank's pid and state: %dist_status)", lines
    assert len(big.table(big.status()).splitlines()) == n + 1


def test_the_one_rank_that_skips_a_collective_is_named(big):
    n = big.world_size
    odd = n // 3
    diag, shown = verdict(big, f"t = torch.ones(1)\nif nd.rank != {odd}:\n    dist.all_reduce(t)\n")
    others = [r for r in range(n) if r != odd]
    assert diag.kind == "conditional" and diag.culprits == others, diag.verdict
    assert diag.verdict.startswith(
        f"Ranks 0-{odd - 1}, {odd + 1}-{n - 1} called all_reduce #1 at line 4, but rank {odd} "
        "finished the cell without calling it."
    ), diag.verdict
    # readable on one screen: one row and one stack for the ranks that wait alike
    table = shown[: shown.index("Diagnosis:")].splitlines()[1:]
    assert len(table) == 3, table  # the header, the waiting ranks, the one that skipped
    assert shown.count("in all_reduce #1\n") == 1 and f"rank {odd}: finished the cell" in shown
    r = big.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
    assert set(r.values.values()) == {float(n)}  # released, the group rebuilt


def test_the_rank_with_fewer_batches_is_named(big):
    short = big.world_size - 2
    code = (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(torch.nn.Linear(4, 1))\n"
        f"batches = [torch.randn(8, 4) for _ in range(2 if nd.rank == {short} else 4)]\n"
        "for xb in batches:\n    model(xb).sum().backward()\n"
    )
    diag, shown = verdict(big, code)
    table = shown[: shown.index("Diagnosis:")].splitlines()[1:]
    assert len(table) <= 4, table  # the ranks grouped by what they do
    assert diag.kind == "uneven" and diag.culprits == [short], diag.verdict
    assert f"rank {short} finished the cell" in diag.verdict, diag.verdict


def test_every_ranks_thousand_lines_arrive_whole_and_in_order(big):
    out = io.StringIO()
    r = big.run(
        "for i in range(1000):\n    print(f'r{nd.rank} line {i}')\n", out=out, raw_output=True
    )
    assert not r.errors
    lines = out.getvalue().splitlines()
    for rank in range(big.world_size):
        mine = [ln.split("] ", 1)[1] for ln in lines if ln.startswith(f"[rank {rank}] ")]
        assert mine == [f"r{rank} line {i}" for i in range(1000)], (rank, len(mine))


def test_the_ranks_tracebacks_that_are_alike_show_once(big):
    """Every rank raises: one traceback for all, not one a rank; a message that names the rank
    keeps a line for each, under the lines they share."""
    n = big.world_size
    same = big.run("x = 1\nraise ValueError('bad value')\n")
    with pytest.raises(RankError) as got:
        same.raise_for_errors()
    assert str(got.value) == f"ranks 0-{n - 1} raised ValueError: bad value"
    shown = "\n".join(got.value._render_traceback_())
    assert shown.count("Traceback (most recent call last)") == 1, shown
    assert f"[ranks 0-{n - 1}] ValueError: bad value" in shown, shown
    named = big.run("raise ValueError(f'bad value on rank {nd.rank}')\n")
    with pytest.raises(RankError) as got:
        named.raise_for_errors()
    assert str(got.value).startswith(f"ranks 0-{n - 1} raised ValueError ({n} different"), got
    shown = got.value._render_traceback_()
    assert shown[0] == f"[ranks 0-{n - 1}] Traceback (most recent call last):", shown
    assert [ln for ln in shown if "] ValueError" in ln] == [
        f"[rank {r}] ValueError: bad value on rank {r}" for r in range(n)
    ]
    raw = big.run("raise ValueError('bad value')\n", raw_output=True)
    with pytest.raises(RankError) as got:
        raw.raise_for_errors()
    shown = "\n".join(got.value._render_traceback_())
    assert shown.count("Traceback (most recent call last)") == n  # as they came, asked so


def test_the_ranks_progress_bars_are_one_line_for_the_ranks_alike(big):
    """tqdm's widget and text bars on every rank: one line for the ranks whose bars share a
    description, where they ended (outside a notebook: text, at the cell's end); each
    rank's text bar was a line of its own, never folded (its rate and time its own)."""
    n, short = big.world_size, big.world_size // 2
    out = io.StringIO()
    big.run(
        "from tqdm.notebook import tqdm\nfrom tqdm import tqdm as text_tqdm\n"
        "for _ in tqdm(range(5), desc='train'):\n    pass\n"
        f"bar = tqdm(total=4, desc='eval')\nbar.update(2 if nd.rank == {short} else 4)\n"
        "bar.close()\nfor _ in text_tqdm(range(3), desc='test'):\n    pass\n"
        # an epoch's inner bar, gone once done (leave=False): no line for it
        "for _ in text_tqdm(range(2), desc='epoch'):\n"
        "    for _ in tqdm(range(3), desc='batch', leave=False):\n        pass\n",
        out=out,
    ).raise_for_errors()
    others = ", ".join(f"{a}-{b}" for a, b in ((0, short - 1), (short + 1, n - 1)))
    assert out.getvalue().splitlines() == [
        f"[ranks 0-{n - 1}] train: 5/5",
        f"[ranks 0-{n - 1}] eval: 4/4 (ranks {others}), 2/4 (rank {short})",
        f"[ranks 0-{n - 1}] test: 3/3",
        f"[ranks 0-{n - 1}] epoch: 2/2",
    ], out.getvalue()


def test_ranks_stopped_alike_are_asked_once(big):
    """Every rank at one breakpoint, then at one input(): one prompt for all of them, each
    line to every rank (asked rank after rank, 16 ranks were 16 prompts); :rank N asks one
    rank alone until it runs on."""
    n = big.world_size
    out = io.StringIO()
    r = big.run(
        "x = nd.rank * 2\nbreakpoint()\ny = x + 1\nlr = input('lr? ')\nbreakpoint()\nlr",
        out=out,
        answers=[":ranks", "p x", "c", "0.1", ":rank 3", "p y", "c", "c"],
    )
    r.raise_for_errors()
    said = out.getvalue()
    stopped = rf"notebook_dist: stopped: ranks 0-{n - 1}: \(Pdb\) at Cell In\[run \d+\], line 3\n"
    assert re.search(stopped, said), said
    assert said.count("(Pdb) p x") == 1 and f"[ranks 0-{n - 1}] (Pdb) p x" in said, said
    assert all(f"[rank {k}] {2 * k}\n" in said for k in range(n)), said
    assert f"[ranks 0-{n - 1}] lr? 0.1" in said, said
    assert set(r.values.values()) == {"0.1"}
    assert "[rank 3] (Pdb) p y" in said and "[rank 3] 7\n" in said, said
    assert said.count("(Pdb) c") == 3, said  # the first stop, rank 3's, then the others'
    assert f"[ranks 0-2, 4-{n - 1}] (Pdb) c" in said, said


def test_a_dead_rank_is_named_among_many(big):
    dead = big.world_size // 2 + 1
    with pytest.raises(ClusterError) as got:
        big.run(f"import os\nif nd.rank == {dead}:\n    os._exit(3)\ndist.barrier()\n")
    said = str(got.value)
    assert said.startswith(f"rank {dead} exited with code 3"), said
    # what the others did, once for the ranks that did the same (not a sentence each)
    assert said.count("failed when the connections closed") <= 1, said
    assert said.count(" in barrier #1") <= 1, said
    assert wait_until(lambda: set(big.dead_ranks()) == {dead}, 10), big.dead_ranks()


def test_the_benchmarks_floor_answers_from_every_bare_process_and_ends_them():
    """The scale benchmark's floor (benchmarks/echo_floor.py): n plain processes each answer
    one frame per round; they end with it."""
    import psutil

    from benchmarks.echo_floor import echo_rounds

    before = {p.pid for p in psutil.Process().children()}
    got = echo_rounds(3, 20, warm=5)
    assert got["wall_s"] > 0 and got["cpu_s"] >= 0, got
    assert {p.pid for p in psutil.Process().children()} - before == set()
