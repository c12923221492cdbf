"""Code pasted from PyTorch's own distributed examples runs as written on 2 CPU ranks, or
ends with one sentence that says what to change.

The scripts below are this project's own, written in the manner of the official ones
(pytorch/tutorials ``intermediate_source/ddp_tutorial.rst`` and ``dist_tuto.rst``;
pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` with its
``datautils.py``, ``distributed/tensor_parallelism``, ``distributed/FSDP2/example.py``;
both repositories BSD-3-Clause): the same structure and the same GPU-first lines, none of
their code. They run through a real kernel started in a folder of their own, with the
helper modules they import (datautils, log_utils, FSDP2's checkpoint, model and utils)
beside the notebook, as a user pastes them.
"""

from __future__ import annotations

import os
import textwrap

import pytest

pytestmark = pytest.mark.slow

DATAUTILS = """
import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]

VERSION = 1
"""

# ddp_tutorial's shape: setup()/cleanup(), a toy model, demo_basic(rank, world_size), and
# mp.spawn under __main__; the CPU variant the tutorial's readers write (gloo, no .to(rank))
DDP_TUTORIAL_CPU = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    loss_fn(outputs, torch.randn(20, 5)).backward()
    optimizer.step()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)


if __name__ == "__main__":
    world_size = 2
    run_demo(demo_basic, world_size)
"""

# demo_basic as the tutorial writes it for GPUs: the model on the rank's GPU by number
DDP_TUTORIAL_AS_WRITTEN = DDP_TUTORIAL_CPU.replace(
    "    model = ToyModel()\n    ddp_model = DDP(model)\n",
    "    model = ToyModel().to(rank)\n    ddp_model = DDP(model, device_ids=[rank])\n",
)
assert DDP_TUTORIAL_AS_WRITTEN != DDP_TUTORIAL_CPU

# a worker process from a module beside the notebook, as run.py-style scripts start them
WORKER = """
import sys


def work(rank):
    print(f"worker of rank {rank} fails", file=sys.stderr)
    raise RuntimeError("the worker failed")
"""

# the same tutorial as written for GPUs: it checks the GPU count first
DDP_TUTORIAL_GPU = """
import torch
n_gpus = torch.cuda.device_count()
assert n_gpus >= 2, f"Requires at least 2 GPUs to run, but got {n_gpus}"
"""

# dist_tuto's run.py: spawn-started processes, each calling init_process(rank, size, fn)
DIST_TUTO = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    print("Rank", rank, "has", tensor[0])


def init_process(rank, size, fn, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(size):
        p = mp.Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
"""

# multigpu_torchrun's shape: a Trainer on LOCAL_RANK's GPU, ddp_setup() with set_device,
# datautils beside the script, and argparse with two positional arguments
MULTIGPU_TORCHRUN = """
import argparse
import os
import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datautils import MyTrainDataset


def ddp_setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl")


def main(save_every, total_epochs, batch_size):
    ddp_setup()
    data = DataLoader(MyTrainDataset(64), batch_size=batch_size, sampler=DistributedSampler(MyTrainDataset(64)))
    model = DDP(torch.nn.Linear(20, 1).to(int(os.environ["LOCAL_RANK"])))
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
"""

# the tensor-parallel examples' log_utils beside the notebook (rank_log, get_logger)
LOG_UTILS = """
import logging

import torch


def get_logger():
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    return logging.getLogger(__name__)


def rank_log(_rank, logger, msg):
    if _rank == 0:
        logger.info(f" {msg}")


def verify_min_gpu_count(min_gpus: int = 2) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= min_gpus
"""

# the tensor-parallel example's opening: its helper module, then the device type from the
# accelerator
TENSOR_PARALLEL = """
import os
import torch
from torch.distributed.device_mesh import init_device_mesh

from log_utils import rank_log, get_logger

logger = get_logger()
_rank = int(os.environ["RANK"])
rank_log(_rank, logger, "Device Mesh created")
device_type = torch.accelerator.current_accelerator().type
tp_mesh = init_device_mesh(device_type, (2,))
"""

# FSDP2's example.py imports its three helper modules beside it (stand-ins here, with the
# names the example imports)
FSDP2_HELPERS = {
    "checkpoint.py": "class Checkpointer:\n    def __init__(self, folder, dcp_api):\n"
    "        self.folder, self.dcp_api = folder, dcp_api\n",
    "model.py": "import torch\n\n\nclass ModelArgs:\n    n_layers = 2\n\n\n"
    "class Transformer(torch.nn.Module):\n    def __init__(self, args):\n"
    "        super().__init__()\n        self.layers = torch.nn.ModuleList("
    "torch.nn.Linear(8, 8) for _ in range(args.n_layers))\n",
    "utils.py": "def inspect_model(model):\n    return model\n\n\n"
    "def inspect_mixed_precision(model):\n    return model\n",
}

# FSDP2's example.py: argparse with defaults, and a GPU check that calls exit()
FSDP2 = """
import argparse
import torch
from checkpoint import Checkpointer
from model import ModelArgs, Transformer
from utils import inspect_mixed_precision, inspect_model


def verify_min_gpu_count(min_gpus: int = 2) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= min_gpus


def main(args):
    _min_gpu_count = 2
    if not verify_min_gpu_count(min_gpus=_min_gpu_count):
        print(f"Unable to locate sufficient {_min_gpu_count} gpus to run this example. Exiting.")
        exit()
    print("training would start here")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--explicit-prefetching", action="store_true", default=False)
    parser.add_argument("--mixed-precision", action="store_true", default=False)
    parser.add_argument("--dcp-api", action="store_true", default=False)
    args = parser.parse_args()
    main(args)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A real kernel started in an empty folder with datautils.py beside the notebook,
    and 2 CPU ranks; ``run(code)`` gives what the cell printed and its error line."""
    from jupyter_client.manager import start_new_kernel

    folder = tmp_path_factory.mktemp("pasted")
    (folder / "datautils.py").write_text(DATAUTILS)
    (folder / "worker.py").write_text(WORKER)
    (folder / "log_utils.py").write_text(LOG_UTILS)
    for name, text in FSDP2_HELPERS.items():
        (folder / name).write_text(text)
    (folder / "src").mkdir()
    (folder / "src" / "helpers_of_mine.py").write_text("ANSWER = 42\n")
    env = dict(os.environ, IPYTHONDIR=str(folder / "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(folder))

    def run(code: str, timeout: float = 180) -> str:
        texts: list[str] = []

        def hook(msg):
            c = msg["content"]
            if msg["msg_type"] == "stream":
                texts.append(c["text"])
            elif msg["msg_type"] == "error":
                texts.append(f"ERROR {c['ename']}: {c['evalue']}\n")
                texts.append("\n".join(c.get("traceback", [])))
            elif msg["msg_type"] in ("execute_result", "display_data"):
                texts.append(c["data"].get("text/plain", "") + "\n")

        kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        return "".join(texts)

    said = run("%load_ext notebook_dist\n%dist_init -n 2")
    assert "2 ranks, gloo" in said, said
    yield run, folder
    run("%dist_shutdown")
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def cell(code: str, line: str = "") -> str:
    return f"%%distributed {line}".rstrip() + "\n" + textwrap.dedent(code).strip() + "\n"


def test_mp_spawn_of_the_ranks_runs_in_place_with_one_note(kernel):
    run, _ = kernel
    said = run(cell(DDP_TUTORIAL_CPU))
    assert "ERROR" not in said, said
    for r in (0, 1):
        assert f"[rank {r}] Running basic DDP example on rank {r}." in said
        assert f"[rank {r}] Finished running basic DDP example on rank {r}." in said
    assert said.count("mp.spawn(demo_basic, nprocs=2) runs it on each of the 2 ranks in place") == 2
    # the tutorial's setup() sets MASTER_ADDR/PORT: said once, and the cluster keeps its own
    assert (
        "this cell set MASTER_ADDR=localhost, MASTER_PORT=12355; the cluster keeps its own" in said
    )
    assert "'gloo' was asked for" not in said  # asked what it has: no second sentence
    again = run(cell("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)"))
    assert "[rank 0] 2.0" in again and "[rank 1] 2.0" in again, again
    # a rebuild uses the cluster's rendezvous, not the tutorial's 12355
    run("from notebook_dist import session\nsession.current().rebuild_process_group()")
    env = run(cell("import os\nos.environ['MASTER_PORT'] != '12355'"))
    assert "[rank 0] True" in env and "[rank 1] True" in env, env


def test_mp_spawn_with_another_count_is_refused_before_any_child(kernel):
    run, _ = kernel
    said = run(cell(DDP_TUTORIAL_CPU.replace("world_size = 2", "world_size = 4")))
    assert "AlreadyTheRanks" in said and "nprocs=4" in said, said
    assert "the ranks already are the processes" in said


def test_the_gpu_count_check_ends_with_the_hint(kernel):
    run, _ = kernel
    said = run(cell(DDP_TUTORIAL_GPU))
    assert "AssertionError" in said and "Requires at least 2 GPUs" in said, said
    assert "notebook_dist: this rank has no GPU: torch.cuda.device_count() is 0" in said
    assert "at line 4 (`assert n_gpus >= 2, " in said


def test_the_tutorial_as_written_for_gpus_names_the_line_and_the_change(kernel):
    run, _ = kernel
    said = run(cell(DDP_TUTORIAL_AS_WRITTEN))
    assert "ERROR" in said, said
    assert "notebook_dist: this rank has no GPU (a CPU rank, on Gloo): use `nd.device` in " in said
    assert "in place of `rank` at line " in said and "(`model = ToyModel().to(rank)`)" in said


def test_ddp_device_ids_and_a_gpu_count_modulo_get_their_hints(kernel):
    run, _ = kernel
    said = run(
        cell(
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "ddp = DDP(torch.nn.Linear(2, 2), device_ids=[nd.rank])"
        )
    )
    assert "ValueError" in said, said
    assert "this rank has no GPU: leave out device_ids at line 3" in said
    said = run(cell("local = nd.rank % torch.cuda.device_count()"))
    assert "ZeroDivisionError" in said, said
    assert "this rank has no GPU: torch.cuda.device_count() is 0" in said
    assert "at line 2 (`local = nd.rank % torch.cuda.device_count()`)" in said


def test_a_cell_whose_child_process_failed_does_not_end_green(kernel):
    run, _ = kernel
    said = run(
        cell(
            """
            import multiprocessing, worker
            p = multiprocessing.get_context("fork").Process(target=worker.work, args=(nd.rank,))
            p.start()
            p.join()
            "joined"
            """
        )
    )
    assert "ERROR" in said and "ChildProcessFailed" in said, said[-3000:]
    assert "target work) exited with code 1: a process this cell started failed" in said
    assert "[rank 0] 'joined'" not in said
    assert "[rank 0] 0\n[rank 1] 1" in run(cell("nd.rank")), "the ranks stay"


def test_mp_process_targets_from_a_cell_are_refused_and_a_rerun_says_the_same(kernel):
    run, _ = kernel
    for _ in range(2):  # the second run must not be "context has already been set"
        said = run(cell(DIST_TUTO))
        assert "AlreadyTheRanks: multiprocessing.Process(target=init_process)" in said, said
        assert "call init_process(nd.rank, nd.world_size, ...) in the cell" in said
        assert "context has already been set" not in said


def test_argparse_reads_a_script_command_line_and_a_gpu_line_gets_its_hint(kernel):
    run, _ = kernel
    said = run(cell(MULTIGPU_TORCHRUN))  # no arguments: argparse says what it needs, once
    assert "the following arguments are required: total_epochs, save_every" in said, said
    assert "--IPEngine" not in said
    assert "called sys.exit() at line" in said and "(exit code 2)" in said
    said = run(cell(MULTIGPU_TORCHRUN, '--args "2 1"'))
    assert "AttributeError" in said and "_cuda_setDevice" in said, said
    assert "notebook_dist: this rank has no GPU: torch.cuda.set_device cannot run at line " in said
    assert 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))' in said


def test_the_tensor_parallel_opening_gets_the_accelerator_hint(kernel):
    run, _ = kernel
    said = run(cell(TENSOR_PARALLEL))
    assert "'NoneType' object has no attribute 'type'" in said, said
    assert (
        "notebook_dist: this rank has no accelerator: torch.accelerator.current_accelerator()"
        in said
    )


def test_fsdp2s_gpu_check_and_exit_end_the_cell_not_the_ranks(kernel):
    run, _ = kernel
    said = run(cell(FSDP2))
    assert "[rank 0] Unable to locate sufficient 2 gpus to run this example. Exiting." in said
    assert "training would start here" not in said, said
    assert "ranks 0, 1 called exit() at line " in said and "(exit code 0)" in said
    assert "[rank 0] 0\n[rank 1] 1" in run(cell("nd.rank")), "the ranks stay"


def test_modules_beside_the_notebook_and_its_import_paths_reach_the_ranks(kernel):
    run, folder = kernel
    said = run(cell("import datautils\nlen(datautils.MyTrainDataset(8)), datautils.VERSION"))
    assert "[rank 0] (8, 1)" in said and "[rank 1] (8, 1)" in said, said
    (folder / "datautils.py").write_text(DATAUTILS.replace("VERSION = 1", "VERSION = 2"))
    said = run(cell("import importlib\nimportlib.reload(datautils).VERSION"))
    assert "[rank 0] 2" in said and "[rank 1] 2" in said, said
    run("import sys\nsys.path.insert(0, 'src')")  # the notebook adds a folder of its own
    said = run(cell("import helpers_of_mine\nhelpers_of_mine.ANSWER"))
    assert "[rank 0] 42" in said and "[rank 1] 42" in said, said
    # a module sent as source, for ranks on hosts that do not share the folder
    (folder / "sent_module.py").write_text("WHERE = 'sent'\n")
    said = run("%dist_push --module sent_module")
    assert "ERROR" not in said, said
    said = run(cell("import sent_module\nsent_module.WHERE"))
    assert "[rank 0] 'sent'" in said, said


def test_init_process_group_arguments_torch_refuses_are_refused_alike(kernel):
    run, _ = kernel
    said = run(cell("dist.init_process_group('gloo', device_id=torch.device('cpu'))"))
    assert "device_id parameter must be an accelerator with an index" in said, said
    said = run(cell("dist.init_process_group('nccl')\ndist.init_process_group('nccl')"))
    assert said.count("'nccl' was asked for and 'gloo' is kept") == 2, said  # once per rank
    said = run(cell("dist.init_process_group('no-such-backend')"))
    assert "AssertionError: Unknown backend type no-such-backend" in said, said
