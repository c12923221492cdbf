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


def test_two_ranks_stopped_listed_switched_and_sent_one_command(kernel):
    out, prompts, error = kernel(
        "%%distributed\nx = nd.rank * 10\nbreakpoint()\ndist.barrier()",
        answers=[":ranks", ":all p x + 1", ":rank 1", "c", "c"],
    )
    assert error is None, out
    assert prompts[0] == "[rank 0] (Pdb) " and "[rank 1] (Pdb) " in prompts[2:], prompts
    assert "notebook_dist: stopped: rank 0: (Pdb) at Cell In[" in out, out
    assert "rank 1: (Pdb) at Cell In[" in out
    assert "[rank 0] 1\n" in out and "[rank 1] 11\n" in out, out  # :all p x + 1
    assert "sent 'p x + 1' to ranks 0, 1." in out


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
