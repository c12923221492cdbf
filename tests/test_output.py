"""The ranks' output as the notebook shows it (notebook_dist.output), on synthetic streams:
carriage-return lines end at their last state, identical lines of many ranks fold into one,
one rank's lines keep their order. A 4-rank cluster checks the folding end to end."""

from __future__ import annotations

import io
import time

import pytest

from notebook_dist.output import OutputStreamer, last_state
from notebook_dist.phrases import rank_span


def streamer(n: int, **kw):
    mds = [{"stdout": "", "stderr": ""} for _ in range(n)]
    out = io.StringIO()
    return OutputStreamer(list(zip(range(n), mds)), out, io.StringIO(), **kw), mds, out


def test_a_line_rewritten_with_carriage_returns_ends_at_its_last_state():
    s, mds, out = streamer(2)
    mds[0]["stdout"] = "".join(f"\rstep {i}" for i in range(5))  # print(..., end="")
    mds[1]["stdout"] = "\rstep 0\rstep 1\n"
    s.poll()
    assert out.getvalue() == "[rank 1] step 1\n"
    s.finish()
    assert out.getvalue() == "[rank 1] step 1\n[rank 0] step 4\n"
    assert last_state("done\r") == "done" and last_state("a\rb\r") == "b"  # Windows ends


def test_fewer_ranks_than_fold_from_stream_as_they_are():
    s, mds, out = streamer(2, fold_from=4)
    for md in mds:
        md["stdout"] = "epoch 1 done\n"
    s.poll()
    assert out.getvalue() == "[rank 0] epoch 1 done\n[rank 1] epoch 1 done\n"


def test_a_line_every_rank_prints_alike_is_shown_once_with_its_ranks():
    s, mds, out = streamer(8, fold_from=4, fold_window_s=0.1)
    for r, md in enumerate(mds):
        md["stdout"] = f"loss on rank {r}\nepoch 1 done\n"
    s.poll()
    time.sleep(0.15)  # each rank's own line waited its moment for a copy that never came
    s.poll()
    lines = out.getvalue().splitlines()
    assert lines[-1] == "[ranks 0-7] epoch 1 done" and len(lines) == 9, lines
    assert sorted(lines[:-1]) == sorted(f"[rank {r}] loss on rank {r}" for r in range(8))


def test_folding_waits_a_bounded_moment_and_never_reorders_a_ranks_lines():
    s, mds, out = streamer(4, fold_from=4, fold_window_s=0.2)
    mds[0]["stdout"] = "a\nb\n"
    mds[1]["stdout"] = "b\n"
    s.poll()
    assert out.getvalue() == ""  # "a" waits for the others' "a"
    time.sleep(0.25)
    s.poll()
    said = out.getvalue().splitlines()
    assert said[0] == "[rank 0] a"  # rank 0's first line first
    assert "[ranks 0, 1] b" in said  # then the line ranks 0 and 1 printed alike
    mds[2]["stdout"] = mds[3]["stdout"] = "b\n"
    s.finish()
    assert out.getvalue().splitlines()[-1] == "[ranks 2, 3] b"


def test_rank_spans_read_as_ranges():
    assert rank_span([3]) == "rank 3"
    assert rank_span(range(8)) == "ranks 0-7"
    assert rank_span([0, 2, 5]) == "ranks 0, 2, 5"
    assert rank_span([0, 1, 2, 3, 6]) == "ranks 0-3, 6"
    assert rank_span([4, 5]) == "ranks 4, 5"


@pytest.mark.slow
def test_four_ranks_fold_their_identical_lines_and_keep_the_rest(no_current):
    from notebook_dist import DistCluster

    with DistCluster(n=4) as c:
        out = io.StringIO()
        c.run(
            "for epoch in range(2):\n"
            "    print(f'epoch {epoch} on rank {nd.rank}')\n"
            "    dist.barrier()\n"
            "    print(f'epoch {epoch} done')\n",
            out=out,
        ).raise_for_errors()
        said = out.getvalue().splitlines()
        assert said.count("[ranks 0-3] epoch 0 done") == 1
        assert said.count("[ranks 0-3] epoch 1 done") == 1
        for r in range(4):
            mine = [ln for ln in said if ln.startswith(f"[rank {r}] ")]
            assert mine == [f"[rank {r}] epoch 0 on rank {r}", f"[rank {r}] epoch 1 on rank {r}"]
            # each rank's own order holds: its epoch 0 line before the folded "epoch 0 done"
            assert said.index(mine[0]) < said.index("[ranks 0-3] epoch 0 done")
        raw = io.StringIO()
        c.run("print('same')", out=raw, raw_output=True).raise_for_errors()
        assert sorted(raw.getvalue().splitlines()) == [f"[rank {r}] same" for r in range(4)]
