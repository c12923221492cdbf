"""The tutorials, executed end to end with nbclient on a real 2-rank Gloo cluster.

Cells tagged ``raises-exception`` are the ones that demonstrate an error; any other
error fails the test. Each notebook's key claims are checked on its outputs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _texts(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append(o["data"].get("text/plain", ""))
            out.append(o["data"].get("text/html", ""))
            out.append(o["data"].get("image/svg+xml", ""))
        elif o["output_type"] == "error":
            out.append(f"{o['ename']}: {o['evalue']}")
    return "\n".join(out)


def _errors(cell) -> list[tuple[str, str]]:
    return [
        (o["ename"], o["evalue"]) for o in cell.get("outputs", []) if o["output_type"] == "error"
    ]


@pytest.fixture(scope="module")
def run_notebook(tmp_path_factory):
    def _run(name: str):
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        workdir = tmp_path_factory.mktemp(name)
        env_ipy = str(workdir / "ipython")
        os.environ["IPYTHONDIR"] = env_ipy
        client = NotebookClient(
            nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
        )
        client.execute()
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            tagged = "raises-exception" in cell.metadata.get("tags", [])
            errs = _errors(cell)
            assert bool(errs) == tagged, (
                f"cell {cell.id}: errors {errs}, tagged {tagged}:\n{cell.source}"
            )
        return nb

    return _run


def _cell(nb, startswith: str):
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(startswith):
            return cell
    raise KeyError(startswith)


def test_01_quickstart(run_notebook):
    nb = run_notebook("01_quickstart")
    text = "\n".join(_texts(c) for c in nb.cells if c.cell_type == "code")
    assert "[rank 1] I am rank 1 of 2" in text
    assert "tensor([3., 3., 3., 3.])" in _texts(_cell(nb, "%%distributed\nt = torch.ones(4)"))
    assert "{0: 45.0, 1: 145.0}" in text
    assert (
        "[rank 0] only rank 0 says this; world size is 2" in text
        and "[rank 1] only rank 0" not in text
    )


def test_02_collectives(run_notebook):
    nb = run_notebook("02_collectives")
    pictures = [
        c for c in nb.cells if c.cell_type == "code" and c.source.startswith("collective_picture")
    ]
    assert len(pictures) == 6
    for c in pictures:
        assert "<svg" in _texts(c) and "class='nd-collective'" in _texts(c)
    assert "rank 1: [10 11 12 13]  ->  [0 1 2 3]" in _texts(pictures[0])  # broadcast from rank 0
    assert "rank 0: [0 1 2 3]  ->  [10 12 14 16]" in _texts(pictures[1])  # all_reduce sum


def test_03_ddp(run_notebook):
    nb = run_notebook("03_ddp")
    text = "\n".join(_texts(c) for c in nb.cells if c.cell_type == "code")
    assert "replicas identical: True" in text
    assert "matches one process on the whole batch: True" in text
    assert "[rank 1] epoch 3: last loss" in text
    acc = _texts(_cell(nb, "%%distributed --gather final"))
    assert "RankValues" in acc


def test_04_sharding(run_notebook):
    nb = run_notebook("04_sharding")
    table = _texts(_cell(nb, "rows = "))
    assert "FSDP2" in table and "ZeRO-1" in table


def test_05_pipeline(run_notebook):
    nb = run_notebook("05_pipeline_parallel")
    text = _texts(_cell(nb, "out = _"))
    assert "loss" in text and "bubble" in text


def test_06_debugging(run_notebook):
    nb = run_notebook("06_debugging_hangs")
    bug1 = _errors(_cell(nb, "%%distributed --hang-after 3 --on-hang stop\nweights"))
    assert bug1[0][0] == "HangError"
    assert "rank 0 called broadcast at line 5; rank 1 called all_reduce at line 6" in bug1[0][1]
    assert "Line 5 is inside `if nd.rank == 0:` (line 3)" in bug1[0][1]
    bug2 = _errors(_cell(nb, "%%distributed\ndata = "))
    assert bug2[0] == ("RankError", "rank 1 raised KeyError: 'y'")
    assert "tensor([2.])" in _texts(
        _cell(nb, "%%distributed\nt = torch.ones(1)  ")
    )  # the group works again
    bug3 = _errors(_cell(nb, "%%distributed --hang-after 3 --on-hang stop\nfrom torch.nn.parallel"))
    assert bug3[0][0] == "HangError" and "uneven data per rank" in bug3[0][1]
    assert "rank 0" in _texts(_cell(nb, "%dist_stacks"))
    bug4 = _errors(_cell(nb, "%%distributed\nt = torch.ones(4, dtype=torch.float32 if"))
    assert bug4[0][0] == "ClusterError"
    assert re.match(r"rank [01] was killed by SIGABRT in all_reduce at line 3\.", bug4[0][1]), bug4
    assert "replayed" in _texts(_cell(nb, "%dist_restart --replay"))
    assert "torch.Size([4])" in _texts(
        _cell(nb, "%%distributed\nt = torch.ones(4, dtype=torch.float32)\n")
    )
    busy = _errors(_cell(nb, "%%distributed --hang-after 3 --on-hang stop\nnd.faults.busy"))
    assert busy[0][0] == "HangError" and busy[0][1].startswith("Rank 1 is busy in Python")


def test_notebooks_are_stored_clean():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, (
                    f"stale output in {path.name}"
                )


def test_07_beyond(run_notebook):
    nb = run_notebook("07_beyond_the_notebook")
    text = "\n".join(_texts(c) for c in nb.cells if c.cell_type == "code")
    assert "'LOCAL_WORLD_SIZE': '2'" in text
    assert "wrote train.py: 4 distributed cells" in text and "if dist.get_rank() in (0,):" in text
    assert "the torchrun script trained the same model: True" in text
