"""%dist_export: the notebook's distributed cells become a torchrun script that trains the same."""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

from notebook_dist.export import ExportCell, select_cells, to_script

pytestmark = pytest.mark.slow


def test_script_shape():
    cells = [
        ExportCell(3, "distributed", "x = torch.ones(2)\n%time y = 1\nx"),
        ExportCell(4, "kernel", "print('in the kernel')"),
        ExportCell(5, "distributed", "print(x)", ranks="0"),
        ExportCell(6, "distributed", "z = 1", ranks="0-1"),
    ]
    text = to_script(cells, 2, "train.py")
    compile(text, "train.py", "exec")
    assert "torchrun --nproc_per_node=2 train.py" in text
    assert (
        "# ---- In [3] ----\nx = torch.ones(2)\n# (IPython, not exported) %time y = 1\nx\n" in text
    )
    assert (
        "# ---- In [4]: ran in the notebook kernel, not on the ranks ----\n# print('in the kernel')\n"
        in text
    )
    assert "# ---- In [5]: %%rank 0 ----\nif dist.get_rank() in (0,):\n    print(x)\n" in text
    assert "# ---- In [6] ----\nz = 1\n" in text  # 0-1 is every rank of 2
    assert [c.number for c in select_cells(cells, "3,5-6")] == [3, 5, 6]
    assert [c.number for c in select_cells(cells, "last")] == [6]  # the last distributed one
    assert [c.number for c in select_cells(cells, "3,last")] == [3, 6]
    with pytest.raises(ValueError, match="bad --cells"):
        select_cells(cells, "x")
    assert text.count("dist.init_process_group(") == 2  # nccl or gloo, made by the script


def test_a_pasted_script_makes_its_own_group_when_exported():
    pasted = "def main():\n    dist.init_process_group('gloo')\n    dist.destroy_process_group()\n"
    text = to_script([ExportCell(7, "distributed", pasted + "main()\n")], 2, "pasted.py")
    compile(text, "pasted.py", "exec")
    assert text.count("dist.init_process_group(") == 1  # the script's own, not a second one
    assert "if dist.is_initialized():" in text  # the end does not use a group it destroyed


def test_exported_ddp_notebook_trains_the_same_under_torchrun(live, run, ip, tmp_path):
    notebook_out = tmp_path / "notebook.pt"
    script_out = tmp_path / "script.pt"
    first = ip.execution_count
    cells = [
        "%%distributed\nimport os\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n"
        "ddp = DDP(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)",
        "lr_note = 'kernel-only cell'",
        "%%distributed\ng = torch.Generator().manual_seed(nd.rank)\nX, Y = torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g)\n"
        "for step in range(15):\n    opt.zero_grad()\n    torch.nn.functional.mse_loss(ddp(X), Y).backward()\n    opt.step()\n"
        "    nd.report(step=step)",
        f"%%rank 0\ntorch.save(model.state_dict(), os.environ.get('ND_EXPORT_OUT', {str(notebook_out)!r}))",
    ]
    for c in cells:
        out = run(c)
        assert out.error is None, out.output
    last = ip.execution_count - 1
    script = tmp_path / "train.py"
    out = run(f"%dist_export {script} --cells {first}-{last}")
    assert out.error is None, out.output
    assert (
        out.stdout.strip()
        == f"wrote {script}: 3 distributed cells. Run it with: torchrun --nproc_per_node=2 {script}"
    )
    text = script.read_text()
    assert "# lr_note = 'kernel-only cell'" in text and "if dist.get_rank() in (0,):" in text
    proc = torchrun(script, env={"ND_EXPORT_OUT": str(script_out)}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(notebook_out), torch.load(script_out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    out = run("%dist_export nothing.py --cells 1-1")
    assert type(out.error).__name__ == "UsageError"
