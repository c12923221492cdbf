"""Cross-rank inspection on a real 2-rank cluster: compare, post-mortem debug, inspect."""

from __future__ import annotations

import torch

from notebook_dist.values import RankValues


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def test_ddp_replicas_compare_equal(live, run):
    out = run(
        "%%distributed\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "ddp = DDP(net)\nopt = torch.optim.Adam(ddp.parameters())\n"
        "for _ in range(3):\n    opt.zero_grad()\n    ddp(torch.randn(16, 4, generator=torch.Generator().manual_seed(nd.rank))).sum().backward()\n    opt.step()"
    )
    assert out.error is None, out.output
    out = run("%dist_compare net")
    assert out.error is None, out.output
    cmp = out.result.result
    assert cmp.agree and cmp.num_entries == 4  # 2 Linear x (weight, bias)
    assert repr(cmp).startswith("all 2 ranks agree (exactly): 4 entries")
    assert run("%dist_compare opt").result.result.agree  # optimizer state too


def test_replicas_trained_without_ddp_differ_by_name(live, run):
    run(
        "%%distributed\ntorch.manual_seed(0)\nplain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))\n"
        "popt = torch.optim.SGD(plain.parameters(), lr=0.1)\n"
        "plain(torch.randn(16, 4, generator=torch.Generator().manual_seed(nd.rank))).sum().backward()\npopt.step()"
    )
    cmp = run("%dist_compare plain").result.result
    assert not cmp.agree
    names = {d.name for d in cmp.differences}
    assert {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.running_mean",
        "1.running_var",
        "2.weight",
    } <= names
    assert all(d.ranks == [1] and d.what == "values" and d.max_abs > 0 for d in cmp.differences)
    text = repr(cmp)
    assert text.startswith(f"{len(cmp.differences)} of 9 entries differ from rank 0 (exactly):")
    assert "  0.weight " in text and "  rank 1: max abs diff" in text  # one rank: "rank 1"


def test_buffer_changed_on_one_rank_is_found(live, run):
    run("%%distributed\ntorch.manual_seed(0)\nbn = torch.nn.BatchNorm1d(3)")
    assert run("%dist_compare bn").result.result.agree
    run("%%rank 1\nbn.running_mean += 0.5")
    cmp = run("%dist_compare bn").result.result
    assert [(d.name, d.ranks) for d in cmp.differences] == [("running_mean", [1])]
    assert abs(cmp.differences[0].max_abs - 0.5) < 1e-6


def test_tolerances(live, run):
    run("%%distributed\nw = torch.ones(100) + (1e-7 if nd.rank == 1 else 0.0)")
    assert not run("%dist_compare w").result.result.agree
    assert run("%dist_compare w --atol 1e-5").result.result.agree
    assert run("%dist_compare w --rtol 1e-5").result.result.agree
    assert not run("%dist_compare w --atol 1e-9").result.result.agree
    run("%%distributed\nshapes = torch.zeros(3 + nd.rank)")
    d = run("%dist_compare shapes").result.result.differences[0]
    assert d.what == "shape" and d.detail == "((3,) vs (4,))"


def test_large_tensor_is_compared_on_the_ranks(live, run):
    run(
        "%%distributed\nbig = torch.zeros(64 * 2**20)\nif nd.rank == 1:\n    big[12345] = 2.0"
    )  # 256 MB
    run("%dist_compare w")  # warm up every code path first
    before = _rchar()
    cmp = live.compare("big")
    received = _rchar() - before
    assert [(d.name, d.max_abs) for d in cmp.differences] == [("value", 2.0)]
    assert received < 2**20, f"{received} bytes reached the notebook"
    run("%%distributed\ndel big")


def test_rank_values_compare_in_the_notebook():
    a = RankValues(
        {0: {"w": torch.ones(3)}, 1: {"w": torch.ones(3)}, 2: {"w": torch.tensor([1.0, 1.0, 1.5])}}
    )
    cmp = a.compare()
    assert [(d.name, d.ranks, d.max_abs) for d in cmp.differences] == [("w", [2], 0.5)]
    assert a.compare(atol=1.0).agree


def test_post_mortem_of_a_failed_rank(live, run):
    out = run("%dist_debug")
    assert out.error is None or "no rank raised" in str(out.error)
    out = run(
        "%%distributed\ndef inner(v):\n    x = v * 10\n    return 1 / (x - 20)\n\ndef outer(k):\n    y = k + 1\n    return inner(y)\n\nouter(nd.rank)"
    )
    assert type(out.error).__name__ == "RankError" and list(out.error.errors) == [1]
    n = out.result.execution_count
    out = run("%dist_debug --rank 1 x")
    assert out.error is None, out.output
    view = out.result.result
    assert (
        view.rank == 1 and view.func == "inner" and view.line == 4 and view.file == f"Cell In[{n}]"
    )
    assert view.locals == {"v": "2", "x": "20"} and view.value == "20"
    text = repr(view)
    assert text.splitlines()[:2] == [
        "rank 1 raised ZeroDivisionError: division by zero",
        f"frame 0 of 3 (0 = where it raised): Cell In[{n}], line 4, in inner",
    ]
    up = run("%dist_debug --rank 1 --frame 1 y * 2").result.result
    assert up.func == "outer" and up.line == 8 and up.locals["k"] == "1" and up.value == "4"
    top = run("%dist_debug --frame 2").result.result  # default: the first rank that raised
    assert top.func == "<module>" and top.line == 10
    out = run("%dist_debug --rank 0 x")
    assert type(out.error).__name__ == "UsageError"
    assert (
        str(out.error) == "rank 0 did not raise in the last cell; rank that did: 1 (use --rank 1)"
    )
    out = run("%dist_debug --rank 1 --frame 7")
    assert str(out.error) == "--frame 7: rank 1's traceback has frames 0-2"
    out = run("%dist_debug --rank 1 (")
    assert str(out.error).startswith("'(' is not a Python expression")
    run("%%distributed\n1")
    out = run("%dist_debug --rank 1 x")
    assert str(out.error) == "no rank raised in the last cell: there is nothing to debug"


def test_inspect_without_running_a_cell(live, run):
    run("%%distributed\nscore = nd.rank * 2.5")
    n_hist = len(live.history)
    out = run("%dist_inspect score + 1")
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: 1.0, 1: 3.5}
    assert len(live.history) == n_hist  # not a cell: nothing to replay
    assert dict(run("%dist_inspect score --ranks 1").result.result) == {1: 2.5}
