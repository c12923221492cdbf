"""The code people bring runs unchanged in a %%distributed cell, as it runs under torchrun:
Lightning's Trainer and Fabric, Accelerate, a Transformers Trainer, DTensor tensor
parallelism, 2-D parallelism, distributed checkpoints and torch.compile on DDP.

Each test trains a few steps on CPU ranks and checks that the replicas agree (or that the
sharded state is right), that the framework used the cluster's ranks (world size 2, no
process of its own), and that nothing of ours shows in the cell's output.
"""

from __future__ import annotations

import io
import re

import pytest
from conftest import torchrun

from notebook_dist import DistCluster

pytestmark = pytest.mark.slow

# every rank's copy of these parameters is gathered and compared on every rank
REPLICAS_EQUAL = """
def replicas_equal(params):
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    copies = [torch.zeros_like(flat) for _ in range(nd.world_size)]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0], c) for c in copies)


def children():
    import psutil

    return len(psutil.Process().children(recursive=True))
"""


@pytest.fixture(scope="module")
def cluster():
    with DistCluster(n=2) as c:
        c.run(REPLICAS_EQUAL).raise_for_errors()
        yield c


def run(cluster, code: str):
    """Run a cell; its value per rank and everything the ranks printed."""
    out, err = io.StringIO(), io.StringIO()
    r = cluster.run(code, filename="Cell In[3]", header="%%distributed", out=out, err=err)
    r.raise_for_errors()
    return dict(r.values), out.getvalue() + err.getvalue()


def test_ranks_look_like_torchrun_workers(cluster):
    values, _ = run(
        cluster,
        "import os, sys\n"
        "({k: os.environ.get(k) for k in ('TORCHELASTIC_RUN_ID', 'GROUP_RANK', 'ROLE_RANK', "
        "'ROLE_WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'ACCELERATE_USE_CPU')}, "
        "dist.is_torchelastic_launched(), hasattr(sys, 'ps1'))",
    )
    env0, launched, ps1 = values[0]
    env1 = values[1][0]
    assert (
        env0["TORCHELASTIC_RUN_ID"] and env0["TORCHELASTIC_RUN_ID"] == env1["TORCHELASTIC_RUN_ID"]
    )
    assert (env0["ROLE_RANK"], env1["ROLE_RANK"]) == ("0", "1")
    assert env0["GROUP_RANK"] == "0" and env0["ROLE_WORLD_SIZE"] == env0["LOCAL_WORLD_SIZE"] == "2"
    assert env0["ACCELERATE_USE_CPU"] == "true"  # the ranks are CPU processes
    assert launched is True and ps1 is False  # not an interactive prompt to a framework


LIGHTNING = """
import lightning as L


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
model = Tiny()
before = model.layer.weight.detach().clone()
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False,
    enable_checkpointing=False, enable_model_summary=False,
)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
(
    trainer.world_size, trainer.global_rank, type(trainer.strategy.cluster_environment).__name__,
    trainer.global_step, replicas_equal(model.parameters()),
    not torch.equal(before, model.layer.weight), children(),
)
"""


def test_lightning_trainer_with_ddp(cluster):
    values, said = run(cluster, LIGHTNING)
    for rank, (world, rank_seen, env, steps, equal, moved, kids) in values.items():
        assert (world, rank_seen, steps) == (2, rank, 5)
        assert env == "TorchElasticEnvironment"  # it used our ranks: no processes of its own
        assert equal and moved and kids == 0
    assert "notebook_dist:" not in said, said  # no note of ours (the group was not touched)
    # Lightning's own bar (Rich's), shown on rank 0 as Lightning does, at its last state
    bars = [line for line in said.splitlines() if "Epoch" in line and "━" in line]
    assert len(bars) == 1 and bars[0].startswith("[rank 0] Epoch"), said
    assert "\x1b[2K" not in said and "\x1b[?25h" not in said  # no terminal controls


FABRIC = """
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
g = torch.Generator().manual_seed(fabric.global_rank)  # different data on each rank
for _ in range(5):
    opt.zero_grad()
    fabric.backward(model(torch.randn(8, 4, generator=g)).pow(2).mean())
    opt.step()
(fabric.world_size, fabric.global_rank, replicas_equal(model.parameters()), children())
"""


def test_lightning_fabric_with_ddp(cluster):
    values, said = run(cluster, FABRIC)
    assert values == {0: (2, 0, True, 0), 1: (2, 1, True, 0)}
    assert "notebook_dist:" not in said, said


ACCELERATE = """
from accelerate import Accelerator

accelerator = Accelerator()  # as under `accelerate launch --cpu`: the ranks are CPU processes
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8
)
model, opt, data = accelerator.prepare(model, opt, data)
for x, y in data:
    opt.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
equal = replicas_equal(model.parameters())
accelerator.end_training()  # frameworks end with destroy_process_group(): the group stays
t = torch.ones(1)
dist.all_reduce(t)
(str(accelerator.distributed_type), accelerator.num_processes, accelerator.process_index, equal, float(t))
"""


def test_accelerate(cluster):
    values, said = run(cluster, ACCELERATE)
    assert values == {
        0: ("DistributedType.MULTI_CPU", 2, 0, True, 2.0),
        1: ("DistributedType.MULTI_CPU", 2, 1, True, 2.0),
    }
    # the one note a rank prints when a framework destroys the cluster's group
    assert said.count("destroy_process_group() of the default group is skipped") <= 2, said


TRANSFORMERS = """
import tempfile

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=4, report_to=[],
    save_strategy="no", logging_strategy="no",
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
(args.world_size, args.process_index, str(args.parallel_mode), trainer.state.global_step,
 replicas_equal(model.parameters()))
"""


def test_transformers_trainer_on_a_tiny_gpt2(cluster):
    values, said = run(cluster, TRANSFORMERS)
    assert values == {
        0: (2, 0, "ParallelMode.DISTRIBUTED", 3, True),
        1: (2, 1, "ParallelMode.DISTRIBUTED", 3, True),
    }
    assert "HTML object>" not in said  # its bar has no text to show outside a notebook


def test_the_transformers_trainers_own_bar_shows_and_advances_in_the_notebook(kernel):
    messages: list = []
    kernel("%%distributed\n" + REPLICAS_EQUAL)
    out, _, error = kernel("%%distributed\n" + TRANSFORMERS, messages=messages, timeout=240)
    assert error is None, out
    bars = {}  # the Trainer's HTML bar, on the main process, by display id: its states
    for kind, display_id, _, data in messages:
        if "<progress" in data.get("text/html", ""):
            bars.setdefault(display_id, []).append((kind, data["text/html"]))
    # one bar per rank (the Trainer draws one on each process), each under its rank's label
    assert sorted(k.split("-")[0] for k in bars) == ["rank0", "rank1"], bars
    labels = [data.get("text/plain") for _, _, _, data in messages if "nd-rank-label" in str(data)]
    assert sorted(labels) == ["[rank 0]", "[rank 1]"], labels
    for states in bars.values():  # shown once, then updated in place to its last step
        assert [kind for kind, _ in states][:2] == ["display_data", "update_display_data"]
        assert "value='3' max='3'" in states[-1][1], states[-1]


TENSOR_PARALLEL = """
import copy

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (nd.world_size,))
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
reference = copy.deepcopy(mlp)
tp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
(torch.allclose(tp(x), reference(x), atol=1e-6), tuple(tp[0].weight.to_local().shape),
 tuple(tp[2].weight.to_local().shape))
"""


def test_tensor_parallel_mlp_equals_the_unsharded_one(cluster):
    values, _ = run(cluster, TENSOR_PARALLEL)
    # column sharding splits the first layer's output rows, row sharding the second's inputs
    assert values == {r: (True, (8, 8), (8, 8)) for r in (0, 1)}


DCP = """
import tempfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def sharded_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=init_device_mesh("cpu", (nd.world_size,)))
    return fully_shard(model, mesh=init_device_mesh("cpu", (nd.world_size,)))


saved = sharded_model(0)
where = [tempfile.mkdtemp() if nd.rank == 0 else None]
dist.broadcast_object_list(where, src=0)  # one checkpoint folder, every rank writes its shards
dcp.save(get_model_state_dict(saved), checkpoint_id=where[0])
fresh = sharded_model(1)
state = get_model_state_dict(fresh)
dcp.load(state, checkpoint_id=where[0])
set_model_state_dict(fresh, state)
pairs = list(zip(saved.parameters(), fresh.parameters()))
(all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs), sum(a.to_local().numel() for a, _ in pairs))
"""


def test_dcp_save_and_load_of_an_fsdp2_model(cluster):
    values, _ = run(cluster, DCP)
    n_params = 8 * 16 + 16 + 16 * 4 + 4
    assert values[0][0] and values[1][0]  # every shard equal after the load
    assert values[0][1] + values[1][1] == n_params  # and the shards cover the model once


COMPILE = """
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
compiled = torch.compile(model, backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(nd.rank)
for _ in range(3):
    opt.zero_grad()
    compiled(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
"""

# the same code under torchrun, for what torch itself prints there
TORCHRUN_COMPILE = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
nd = type("nd", (), {"rank": dist.get_rank()})
exec(CODE)
dist.barrier()
dist.destroy_process_group()
"""

_LOG_HEADER = re.compile(r"^(\[rank \d+\] )?(\[rank\d+\]:)?[WIE]\d{4} [\d:.]+ +\d+ \S+\] ")


def _messages(text: str) -> list[str]:
    """What was said, without the rank tag, the logging time stamp, pid and file."""
    return sorted(_LOG_HEADER.sub("", line) for line in text.splitlines() if line.strip())


def test_torch_compile_on_ddp_says_no_more_than_under_torchrun(cluster, tmp_path):
    """torch itself warns once per rank under torch.compile on DDP ("Profiler record
    function ... will be ignored": DDP's forward holds a record_function that dynamo
    skips). Under torchrun it says the same; nothing of ours may add to it."""
    values, said = run(cluster, COMPILE + "replicas_equal(model.parameters())")
    assert values == {0: True, 1: True}
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_COMPILE.replace("CODE", repr(COMPILE)))
    job = torchrun(script)
    assert job.returncode == 0, job.stderr[-2000:]
    torchrun_said = [m for m in _messages(job.stdout + job.stderr) if "OMP_NUM_THREADS" not in m]
    torchrun_said = [m for m in torchrun_said if not m.startswith("*****")]
    assert _messages(said) == torchrun_said, (said, job.stderr)


FSDP_TP_2D = """
import copy

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
reference = copy.deepcopy(model)
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))  # the global batch
dp = mesh["dp"].get_local_rank()
mine = x[4 * dp : 4 * dp + 4]  # each data-parallel replica takes its half
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(mine).pow(2).mean().backward()
opt.step()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
reference(x).pow(2).mean().backward()
ref_opt.step()
full = [p.full_tensor() for p in model.parameters()]
(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full, reference.parameters())),
 tuple(mesh.shape), dp, mesh["tp"].get_local_rank())
"""


def test_fsdp2_over_tensor_parallel_on_a_2x2_mesh():
    with DistCluster(n=4) as c:
        values, _ = run(c, FSDP_TP_2D)
    # after one step on the split batch, the 2-D model equals one trained on the whole batch
    assert values == {
        0: (True, (2, 2), 0, 0),
        1: (True, (2, 2), 0, 1),
        2: (True, (2, 2), 1, 0),
        3: (True, (2, 2), 1, 1),
    }
