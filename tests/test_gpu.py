"""The real NCCL path. Runs only where CUDA GPUs are visible (marked gpu); each test says
why it skips when there is too little hardware.

One GPU: NCCL at world size 1, CUDA tensors gathered to the kernel's CPU, DDP and FSDP2 on
CUDA, an NCCL group aborted and rebuilt with the namespace kept, a rank in a long kernel
diagnosed as busy on the GPU and interrupted, Gloo ranks sharing the GPU with CUDA
tensors, the CUDA memory the dashboard and %dist_status show, a profile with the GPU's
exposed communication, and %dist_bench on NCCL. Two or more: the
conditional-collective hang on NCCL, diagnosed at its line and released with state kept.

For a lent GPU machine (no network, no Jupyter stack), pack from the project's root with
``GPU_PACK_EXTRA=hypothesis bash ../shared/tools/gpu-pack.sh`` (two test modules import
hypothesis, and collection should not fail on them) and run the command it prints.
"""

from __future__ import annotations

import pytest
from conftest import until_verdict, wait_until

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: the NCCL path cannot run on CPU"
    ),
]

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 GPUs: NCCL refuses two ranks on one GPU, and a hang needs two ranks",
)


@pytest.fixture(scope="module")
def one_gpu():
    """One rank on GPU 0 with NCCL (world size 1)."""
    from notebook_dist import DistCluster

    with DistCluster(gpus="0") as cluster:
        assert cluster.backend == "nccl" and cluster.world_size == 1
        yield cluster


def test_nccl_one_rank_per_gpu_all_reduce():
    from notebook_dist import DistCluster

    n = torch.cuda.device_count()
    with DistCluster() as cluster:
        assert cluster.backend == "nccl" and cluster.world_size == n
        r = cluster.run(
            "t = torch.ones(4, device=nd.device) * (nd.rank + 1)\ndist.all_reduce(t)\n(t, t.device.index, str(nd.device))"
        )
        r.raise_for_errors()
        for rank, (t, index, device) in r.values.items():
            assert t.device.type == "cpu"  # values arrive on the CPU
            assert torch.equal(t, torch.full((4,), float(n * (n + 1) // 2)))
            assert index == rank and device == f"cuda:{rank}"


def test_cuda_tensors_gather_to_the_kernels_cpu(one_gpu):
    r = one_gpu.run(
        "big = torch.arange(1 << 20, device=nd.device, dtype=torch.float32)", gather=["big"]
    )
    r.raise_for_errors()
    big = r.gathered["big"][0]
    assert big.device.type == "cpu" and torch.equal(big, torch.arange(1 << 20, dtype=torch.float32))


def test_ddp_and_fsdp2_train_on_cuda(one_gpu):
    r = one_gpu.run(
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "ddp = DDP(torch.nn.Linear(8, 1).to(nd.device))\n"
        "ddp(torch.randn(4, 8, device=nd.device)).sum().backward()\n"
        "fsdp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)).to(nd.device)\n"
        "fully_shard(fsdp, mesh=init_device_mesh('cuda', (nd.world_size,)))\n"
        "opt = torch.optim.Adam(fsdp.parameters())\n"
        "fsdp(torch.randn(4, 8, device=nd.device)).sum().backward()\n"
        "opt.step()\n"
        "(ddp.module.weight.grad is not None, str(fsdp[0].weight.to_local().device))"
    )
    r.raise_for_errors()
    assert r.values[0] == (True, "cuda:0")


def test_an_nccl_group_is_aborted_and_rebuilt_with_the_namespace_kept(one_gpu):
    from notebook_dist.runtime import recover

    one_gpu.run(
        "kept = 41\nt = torch.ones(1, device=nd.device)\ndist.all_reduce(t)"
    ).raise_for_errors()
    aborted = one_gpu.apply(recover.abort_nccl)  # what a release does on the agent's thread
    assert aborted[0] >= 1
    assert dict(one_gpu.run("dist.is_initialized()").values) == {0: False}
    one_gpu.rebuild_process_group()
    r = one_gpu.run(
        "t = torch.full((3,), 2.0, device=nd.device)\ndist.all_reduce(t)\n(t.tolist(), kept + 1)"
    )
    r.raise_for_errors()
    assert r.values[0] == ([2.0, 2.0, 2.0], 42)


SLEEP_ON_GPU = """
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(1_000_000)
end.record()
torch.cuda.synchronize()
cycles_per_ms = 1_000_000 / start.elapsed_time(end)
kept = "still here"
torch.cuda._sleep(int(SECONDS * 1000 * cycles_per_ms))  # one kernel, busy that long
torch.cuda.synchronize()  # the host thread waits for it here, line 10
"""


def _until_verdict(cluster, code: str, hang_after: float = 3.0):
    """The diagnosis, what the cell printed, and the seconds to the end of the interrupt."""
    diag, out, _, end = until_verdict(cluster, code, hang_after)
    return diag, out, end


def test_a_rank_in_a_long_kernel_is_busy_on_the_gpu_and_is_interrupted(one_gpu):
    diag, out, took = _until_verdict(one_gpu, SLEEP_ON_GPU.replace("SECONDS", "8"))
    assert diag is not None, out
    assert diag.rows[0]["state"] == "busy on the GPU", diag.text()
    assert diag.verdict.startswith("No rank is in a collective; all are busy on the GPU"), (
        diag.verdict
    )
    print(f"\nlong kernel: verdict and interrupt after {took:.1f} s")
    # the kernel cannot be stopped; once it ends the rank is idle and kept its variables
    kept = {}

    def idle() -> bool:
        try:
            kept["r"] = one_gpu.run("kept")
            return True
        except Exception:
            return False

    assert wait_until(idle, 30, every_s=1)
    assert dict(kept["r"].values) == {0: "still here"}
    if not one_gpu.run("dist.is_initialized()").values[0]:  # released while it ran: rebuild
        one_gpu.rebuild_process_group()
    r = one_gpu.run("t = torch.ones(1, device=nd.device)\ndist.all_reduce(t)\nt.item()")
    assert dict(r.values) == {0: 1.0}


def test_gloo_ranks_sharing_one_gpu_use_cuda_tensors():
    from notebook_dist import DistCluster

    with DistCluster(n=torch.cuda.device_count() + 1) as cluster:
        assert cluster.backend == "gloo"
        r = cluster.run("t = torch.ones(2, device=nd.device)\ndist.all_reduce(t)\nt")
        r.raise_for_errors()
        assert all(
            torch.equal(v, torch.full((2,), float(cluster.world_size))) for v in r.values.values()
        )


def test_a_profile_on_cuda_records_the_gpu_and_exposed_communication(one_gpu):
    r = one_gpu.run(
        "x = torch.randn(512, 512, device=nd.device)\n"
        "for _ in range(10):\n"
        "    y = x @ x\n"
        "    dist.all_reduce(y)\n"
        "y.sum().item()",
        profile=True,
    )
    r.raise_for_errors()
    p = r.profile
    assert p.cuda and "exposed" in p.text()
    assert {o.op: o.count for o in p.ops}.get("all_reduce") == 10, p.text()
    rank = p.ranks[0]
    assert rank.wall_s > 0 and 0 <= rank.exposed_s <= rank.collectives_s + 1e-9


def test_dist_bench_runs_on_nccl(one_gpu):
    from notebook_dist.bench import bench

    result = bench(one_gpu, ["all_reduce", "broadcast"], sizes="1M-4M")
    assert result.backend == "nccl"
    assert {(row.op, row.bytes) for row in result.rows} == {
        (op, size) for op in ("all_reduce", "broadcast") for size in (1 << 20, 1 << 21, 1 << 22)
    }
    assert all(row.seconds > 0 and row.algbw > 0 for row in result.rows)


def test_the_dashboard_and_status_show_the_gpu_and_its_memory(one_gpu):
    from notebook_dist.ui.state import build

    one_gpu.run(
        "block = torch.empty(64 << 20, dtype=torch.uint8, device=nd.device)\nnd.report(step=1)"
    ).raise_for_errors()
    row = build(one_gpu.last_watch).rows[0]
    assert row.gpu.startswith("cuda:0 ") and len(row.gpu) > len("cuda:0 ")  # with its name
    assert row.gpu_allocated >= 64 << 20 and row.gpu_reserved >= row.gpu_allocated
    assert row.gpu_peak >= row.gpu_allocated
    status = one_gpu.status()[0]
    assert status["gpu"].startswith("cuda:0 ") and "peak" in status["gpu"]


@two_gpus
def test_a_conditional_collective_on_nccl_is_diagnosed_and_released_with_state_kept():
    from notebook_dist import DistCluster

    with DistCluster(gpus="0,1") as cluster:
        assert cluster.backend == "nccl"
        cluster.run("kept = nd.rank * 10").raise_for_errors()
        code = (
            "x = torch.ones(4, device=nd.device)\nif nd.rank == 0:\n    dist.broadcast(x, 0)\n"
            "dist.all_reduce(x)\nx.sum().item()\n"
        )
        diag, out, took = _until_verdict(cluster, code)
        assert diag is not None, out
        assert diag.kind == "conditional" and diag.culprits == [0] and diag.line == 4, diag.text()
        assert "Line 4 is inside `if nd.rank == 0:` (line 3)" in diag.verdict
        assert "released ranks 0, 1" in out, out
        print(f"\nNCCL conditional collective: verdict, release and rebuild in {took:.1f} s")
        assert dict(cluster.run("kept").values) == {0: 0, 1: 10}
        r = cluster.run(
            "t = torch.ones(2, device=nd.device) * (nd.rank + 1)\ndist.all_reduce(t)\nt.tolist()"
        )
        r.raise_for_errors()
        assert dict(r.values) == {0: [3.0, 3.0], 1: [3.0, 3.0]}


HEAL_DDP = (
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "ddp = DDP(torch.nn.Linear(8, 2).to(nd.device))\n"
    "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
    "ddp(torch.randn(4, 8, device=nd.device)).sum().backward()\n"
    "opt.step()\n"
)
HEALED_CHECK = (
    "ddp(torch.randn(4, 8, device=nd.device)).sum().backward()\nopt.step()\n"
    "(str(ddp.module.weight.device), opt.param_groups[0]['params'][0] is ddp.module.weight)"
)


def _kill_heal_and_train(cluster, devices: dict[int, str]) -> None:
    from notebook_dist.errors import ClusterError

    cluster.run(HEAL_DDP).raise_for_errors()
    with pytest.raises(ClusterError):
        cluster.run("import os\nif nd.rank == 1:\n    os._exit(3)\ndist.barrier()")
    healed = cluster.heal(["ddp", "opt"])
    assert healed.ranks == [1] and healed.copied == ["ddp", "opt"], healed.text()
    r = cluster.run(HEALED_CHECK)
    r.raise_for_errors()
    assert dict(r.values) == {rank: (device, True) for rank, device in devices.items()}
    assert cluster.compare("ddp.module").agree


def test_heal_of_gloo_ranks_sharing_one_gpu_puts_the_copy_on_the_gpu():
    from notebook_dist import DistCluster

    with DistCluster(n=torch.cuda.device_count() + 1) as cluster:
        assert cluster.backend == "gloo"
        devices = {r.rank: r.device for r in cluster.ranks}
        assert devices[1].startswith("cuda")
        _kill_heal_and_train(cluster, devices)


@two_gpus
def test_heal_on_nccl_aborts_the_survivors_communicators_and_gives_the_new_rank_its_gpu():
    from notebook_dist import DistCluster

    with DistCluster(gpus="0,1") as cluster:
        assert cluster.backend == "nccl" and cluster.world_size == 2
        _kill_heal_and_train(cluster, {0: "cuda:0", 1: "cuda:1"})
