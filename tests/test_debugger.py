"""A debugger on any rank, and input(), in the notebook: through a real kernel whose front
end answers input requests as JupyterLab's input box does (jupyter_client's stdin
channel), on 2 CPU ranks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_breakpoint_on_one_rank_asks_the_notebook_while_the_other_waits(kernel):
    out, prompts, error = kernel(
        "%%distributed\nx = nd.rank + 41\nif nd.rank == 1:\n    breakpoint()\ndist.barrier()\nx",
        answers=["p x", "c"],
    )
    assert error is None, out
    assert prompts == ["[rank 1] (Pdb) ", "[rank 1] (Pdb) "], prompts
    assert "[rank 1] 42" in out  # p x, in rank 1's frame
    assert "[rank 0] 41" in out and "[rank 1] 42" in out.split("RankValues")[-1]


def test_what_a_rank_printed_before_it_asked_shows_before_the_prompt_when_lines_fold(kernel):
    """Folded lines (from DistConfig.fold_from_ranks ranks, as at 16 ranks; 2 here) wait a
    moment for the other ranks' copies; the debugger's where-line, and what a p printed,
    still come before the prompt that follows them, as a person reads them."""
    config = "import notebook_dist.session as s\ns.current().config.fold_from_ranks = {}"
    kernel(config.format(2))
    messages = []
    try:
        out, prompts, error = kernel(
            "%%distributed\nx = nd.rank + 41\nif nd.rank == 1:\n    breakpoint()\n"
            "dist.barrier()\nx",
            answers=["p x", "c"],
            messages=messages,
        )
    finally:
        kernel(config.format(4))
    assert error is None and prompts == ["[rank 1] (Pdb) "] * 2, (out, prompts)
    seen = [(kind, text) for kind, _, text, _ in messages if kind in ("stream", "input_request")]
    asked = [i for i, (kind, _) in enumerate(seen) if kind == "input_request"]
    before = "".join(text for _, text in seen[: asked[0]])
    assert "[rank 1] > " in before and "<module>()" in before, seen
    assert "[rank 1] 42" in "".join(text for _, text in seen[asked[0] : asked[1]]), seen


def test_two_ranks_stopped_listed_switched_and_sent_one_command(kernel):
    out, prompts, error = kernel(
        "%%distributed\nx = nd.rank * 10\nbreakpoint()\ndist.barrier()",
        answers=[":ranks", ":all p x + 1", ":rank 1", "c", "c"],
    )
    assert error is None, out
    assert prompts[0] == "[rank 0] (Pdb) " and "[rank 1] (Pdb) " in prompts[2:], prompts
    # the ranks stopped at one line are said once
    assert "notebook_dist: stopped: ranks 0, 1: (Pdb) at Cell In[" in out, out
    assert "[rank 0] 1\n" in out and "[rank 1] 11\n" in out, out  # :all p x + 1
    assert "sent 'p x + 1' to ranks 0, 1." in out
    assert out.count("notebook_dist: ranks 0, 1 wait for a line; asking rank ") == 1, out
    assert out.count(":all LINE answers every one, :ranks lists them.") == 1, out


def test_nine_ranks_at_one_breakpoint_get_one_prompt_in_the_input_box(kernel):
    """From 9 ranks, the ranks stopped at one line are one prompt in the front end's input
    box, each answer run on every one of them; q quits them all, variables kept."""
    out, _, error = kernel("%dist_shutdown\n%dist_init -n 9")
    assert error is None, out
    try:
        out, prompts, error = kernel(
            "%%distributed\nx = nd.rank * 10\nbreakpoint()\ny = x + 1",
            answers=["p x", "n", "p y", "q"],
        )
        assert error == "CellInterrupted", out
        assert prompts == ["[ranks 0-8] (Pdb) "] * 4, prompts
        # where they stopped, with the cell's line (the cell's name as it is, not a path)
        assert "[ranks 0-8] -> y = x + 1\n" in out and "[ranks 0-8] > Cell In[" in out, out
        assert "the debugger was quit on rank 0; every rank kept its variables" in out, out
        assert all(f"[rank {r}] {10 * r}\n" in out for r in range(9)), out
        assert all(f"[rank {r}] {10 * r + 1}\n" in out for r in range(9)), out
        out, _, error = kernel("%%distributed\nx")
        assert error is None and "[rank 8] 80" in out, out
    finally:
        kernel("%dist_shutdown\n%dist_init -n 2")


def test_q_ends_the_cell_as_an_interrupt_does_and_every_rank_keeps_its_variables(kernel):
    out, prompts, error = kernel(
        "%%distributed\nkept = nd.rank + 5\nif nd.rank == 1:\n    breakpoint()\ndist.barrier()",
        answers=["q"],
    )
    assert error == "CellInterrupted", out
    assert "the debugger was quit on rank 1; every rank kept its variables" in out
    out, _, error = kernel("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\n(kept, float(t))")
    assert error is None and "[rank 0] (5, 2.0)" in out and "[rank 1] (6, 2.0)" in out, out


def test_pdb_on_opens_the_debugger_where_the_rank_raised_never_in_the_tool(kernel):
    kernel("%pdb on")
    try:
        out, prompts, error = kernel(
            "%%distributed\ny = 10 + nd.rank\nif nd.rank == 0:\n    y / 0\n", answers=["p y", "c"]
        )
    finally:
        kernel("%pdb off")
    assert error == "RankError" and "ZeroDivisionError" in out, out
    assert prompts[0] == "[rank 0] (Pdb) ", prompts
    assert "[rank 0] 10" in out  # the rank's own local, in its raising frame
    assert not [p for p in prompts if "ipdb" in p], prompts  # not the kernel's, in our frames


def test_an_error_the_tool_raises_opens_the_debugger_in_the_users_frame(kernel):
    # --check-collectives raises its mismatch inside the tool's wrapper: the debugger lands
    # on the cell's line that called the collective, with the cell's locals
    out, prompts, error = kernel(
        "%%distributed --check-collectives --pdb\nn = 2 + nd.rank\nt = torch.ones(n)\n"
        "dist.all_reduce(t)\n",
        answers=["p n", "c", "p n", "c"],
    )
    assert error == "RankError" and "CollectiveMismatch" in out, out
    assert prompts and all(p.endswith("(Pdb) ") for p in prompts), prompts
    assert "[rank 0] 2" in out or "[rank 1] 3" in out, out  # n, in the cell's frame
    assert "argcheck.py(" not in out and "tracker.py(" not in out, out  # never the tool's


def test_debug_after_a_failed_cell_debugs_the_rank_that_raised(kernel):
    out, _, error = kernel(
        "%%distributed\nz = 7 * (nd.rank + 1)\nif nd.rank == 1:\n    raise ValueError(z)"
    )
    assert error == "RankError", out
    out, prompts, error = kernel("%debug", answers=["p z", "c"])
    assert error is None, out
    assert prompts and prompts[0] == "[rank 1] (Pdb) ", prompts
    assert "[rank 1] 14" in out, out


def test_input_on_a_rank_asks_the_notebook_with_the_rank_in_the_prompt(kernel):
    out, prompts, error = kernel(
        "%%distributed --ranks 1\nname = input('your name? ')\nname.upper()", answers=["ada"]
    )
    assert error is None, out
    assert prompts == ["[rank 1] your name? "], prompts
    assert "ADA" in out, out


def test_answers_given_in_advance_drive_the_debugger(kernel):
    out, prompts, error = kernel(
        '%%distributed --answers "p nd.rank * 100" c "p nd.rank * 100" c\nbreakpoint()\nnd.rank'
    )
    assert error is None and prompts == [], (out, prompts)
    assert "[rank 0] 0\n" in out and "[rank 1] 100\n" in out, out


def test_set_trace_and_torch_distributed_breakpoint_stop_the_rank_that_calls_them(kernel):
    out, prompts, error = kernel(
        "%%distributed\nimport pdb\ny = nd.rank + 7\nif nd.rank == 0:\n    pdb.set_trace()\ny",
        answers=["p y * 2", "c"],
    )
    assert error is None, out
    assert prompts == ["[rank 0] (Pdb) "] * 2, prompts
    assert "[rank 0] 14" in out, out
    # torch's own: rank 1 stops, rank 0 waits in its barrier; skip=1 passes the first time
    code = (
        "%%distributed\nhits = []\nfor i in range(2):\n"
        "    hits.append(i)\n    torch.distributed.breakpoint(rank=1, skip=1)\nlen(hits)"
    )
    out, prompts, error = kernel(code, answers=["p i", "c"])
    assert error is None, out
    assert prompts == ["[rank 1] (Pdb) "] * 2, prompts  # once: the second time round
    assert "[rank 1] 1\n" in out and "[rank 0] 2" in out, out


def test_a_command_sent_to_a_set_of_ranks(kernel):
    out, prompts, error = kernel(
        "%%distributed\nx = nd.rank * 10\nbreakpoint()\ndist.barrier()",
        answers=[":on 1 p x + 2", "c", "c"],
    )
    assert error is None, out
    assert "[rank 1] 12\n" in out and "[rank 0] 2\n" not in out, out
    assert "sent 'p x + 2' to rank 1." in out, out


@pytest.fixture
def stuck_after(kernel):
    """The notebook stops a stuck cell after 2 s here (5 min by default)."""
    kernel("from notebook_dist import session\nsession.current().config.stuck_after_s = 2.0")
    yield
    kernel("session.current().config.stuck_after_s = 300.0")


def test_a_debugger_session_longer_than_a_stuck_cell_ends_nothing(kernel, stuck_after):
    out, _, error = kernel(
        "%%distributed\nfrom notebook_dist.runtime.state import STATE\nSTATE.timeout_s"
    )
    assert error is None and "[rank 0] 86400.0" in out, out  # torch is told to wait a day
    out, prompts, error = kernel(
        "%%distributed\nx = nd.rank\nif nd.rank == 1:\n    breakpoint()\ndist.barrier()\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t) + x",
        answers=["c"],
        answer_after_s=5.0,  # longer than the 2 s after which a stuck cell is stopped
    )
    assert error is None, out
    assert prompts == ["[rank 1] (Pdb) "], prompts
    assert "[rank 0] 2.0" in out and "[rank 1] 3.0" in out, out
    assert "stopping the cell" not in out and "released" not in out, out


def test_a_stuck_cell_nobody_stops_is_stopped_with_its_verdict_and_variables_kept(
    kernel, stuck_after
):
    out, _, error = kernel(
        "%%distributed --hang-after 1\nkept = nd.rank + 3\nt = torch.ones(1)\n"
        "if nd.rank == 0:\n    dist.all_reduce(t)"
    )
    assert error == "HangError", out
    assert "The cell was stopped: no rank made progress for DistConfig.stuck_after_s" in out
    assert "Rank 0 called all_reduce #1" in out, out
    out, _, error = kernel("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\n(kept, float(t))")
    assert error is None and "[rank 0] (3, 2.0)" in out and "[rank 1] (4, 2.0)" in out, out
