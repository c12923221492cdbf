"""The real NCCL path. Runs only where CUDA GPUs are visible (marked gpu)."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: the NCCL path cannot run on CPU"
    ),
]


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


def test_two_ranks_sharing_one_gpu_use_gloo_with_cuda_tensors():
    from notebook_dist import DistCluster

    with DistCluster(n=torch.cuda.device_count() + 1) as cluster:
        assert cluster.backend == "gloo"
        r = cluster.run("t = torch.ones(2, device=nd.device)\ndist.all_reduce(t)\nt")
        r.raise_for_errors()
        assert all(
            torch.equal(v, torch.full((2,), float(cluster.world_size))) for v in r.values.values()
        )
