"""The GPU decisions, with the GPU count as input (no GPU needed)."""

import pytest

from notebook_dist.errors import PreflightError
from notebook_dist.plan import (
    assign_local_ranks,
    check_cuda_visible_devices,
    physical_gpus,
    plan_cluster,
    plan_on_engines,
    visible_gpus,
)


def test_no_gpu_defaults_to_two_gloo_ranks_on_cpu():
    plan = plan_cluster(gpu_ids=[])
    assert plan.world_size == 2 and plan.backend == "gloo"
    assert [r.device for r in plan.ranks] == ["cpu", "cpu"]
    assert "CUDA_VISIBLE_DEVICES" not in plan.ranks[0].env


def test_torchrun_environment():
    plan = plan_cluster(3, gpu_ids=[], master_port=29411)
    env = plan.ranks[2].env
    assert {
        k: env[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    } == {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29411",
    }


def test_one_rank_per_gpu_uses_nccl():
    plan = plan_cluster(gpu_ids=["0", "1", "2", "3"])
    assert plan.world_size == 4 and plan.backend == "nccl"
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan.cuda_visible_devices == "0,1,2,3"


def test_fewer_ranks_than_gpus():
    plan = plan_cluster(2, gpu_ids=["0", "1", "2", "3"])
    assert plan.backend == "nccl" and plan.cuda_visible_devices == "0,1"


def test_gpu_list_selects_physical_gpus_and_keeps_local_rank_device():
    plan = plan_cluster(gpus="2,3", gpu_ids=["0", "1", "2", "3"])
    assert plan.world_size == 2 and plan.backend == "nccl"
    # CUDA_VISIBLE_DEVICES narrows to the chosen GPUs, so cuda:LOCAL_RANK is right as under torchrun
    assert plan.cuda_visible_devices == "2,3"
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1"]


def test_gpu_list_respects_the_notebooks_own_cuda_visible_devices(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(8):  # a machine with 8 GPUs: their device files, no driver folder
        (dev / f"nvidia{i}").touch()
    (dev / "nvidiactl").touch()
    none = str(tmp_path / "no-proc")

    def visible(spec):
        return visible_gpus({"CUDA_VISIBLE_DEVICES": spec}, proc_root=none, dev_root=str(dev))

    assert visible_gpus({}, proc_root=none, dev_root=str(dev)) == [str(i) for i in range(8)]
    assert visible("4,5,6,7") == ["4", "5", "6", "7"]
    assert visible("6,2") == ["6", "2"]  # in the order given, as CUDA numbers them
    assert visible("5,9,6") == ["5"]  # CUDA stops at the first id that is not there
    assert visible("") == [] and visible("-1") == []
    assert visible("GPU-1f2e") == ["GPU-1f2e"]
    # no driver at all: nothing is visible, whatever the variable says
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}, proc_root=none, dev_root=none) == []


def test_more_ranks_than_gpus_falls_back_to_gloo_with_a_note():
    plan = plan_cluster(4, gpu_ids=["0", "1"])
    assert plan.backend == "gloo"
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert "4 ranks share 2 GPU(s), so the backend is Gloo" in plan.notes[0]


def test_gloo_on_gpus_when_asked():
    plan = plan_cluster(backend="gloo", gpu_ids=["0", "1"])
    assert plan.backend == "gloo" and plan.ranks[1].device == "cuda:1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(backend="nccl", gpu_ids=[]),
            "NCCL needs one GPU per rank, and no GPU is visible to this notebook. Use --backend gloo",
        ),
        (
            dict(n=4, backend="nccl", gpu_ids=["0", "1"]),
            "NCCL needs one GPU per rank: 4 ranks asked on one host, 2 GPU(s) available. Use -n 2, or --backend gloo",
        ),
        (dict(backend="mpi", gpu_ids=[]), "unknown backend 'mpi': use one of auto, gloo, nccl"),
        (
            dict(gpus="0,5", gpu_ids=["0", "1"]),
            "--gpus names GPU 5, but only 2 GPU(s) are visible (indices 0-1)",
        ),
        (dict(gpus="0,0", gpu_ids=["0", "1"]), "lists a GPU twice"),
        (dict(gpus="a,b", gpu_ids=["0", "1"]), "bad --gpus 'a,b': give GPU indices like '0,1'"),
        (dict(gpus="0", gpu_ids=[]), "--gpus '0' asked, but no GPU is visible"),
        (
            dict(n=3, gpus="0,1", gpu_ids=["0", "1"]),
            "-n 3 asks for 3 ranks but --gpus lists 2 GPUs",
        ),
        (dict(n=0, gpu_ids=[]), "-n 0: a cluster needs at least one rank"),
    ],
)
def test_preflight_errors(kwargs, message):
    with pytest.raises(PreflightError) as info:
        plan_cluster(**kwargs)
    assert message in str(info.value)


def test_visible_gpus_reads_the_driver_and_cuda_visible_devices(tmp_path):
    for i in range(4):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert visible_gpus({}, proc_root=str(tmp_path)) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, proc_root=str(tmp_path)) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,9,2"}, proc_root=str(tmp_path)) == ["1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, proc_root=str(tmp_path)) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, proc_root=str(tmp_path)) == []


def test_gpus_are_counted_from_their_device_files_where_the_driver_has_no_proc(tmp_path):
    """gVisor (the sandbox our lent GPU machine runs in) and some containers pass the
    GPUs' device files through, not the driver's /proc; CUDA needs only the device files."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "null"):
        (dev / name).touch()
    (dev / "nvidia-caps").mkdir()
    no_proc = str(tmp_path / "no-proc")
    assert physical_gpus(no_proc, str(dev)) == 2
    assert visible_gpus({}, proc_root=no_proc, dev_root=str(dev)) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, proc_root=no_proc, dev_root=str(dev)) == [
        "1"
    ]
    assert physical_gpus(no_proc, str(tmp_path / "no-dev")) == 0
    # where the driver's /proc is there, it counts (device files can lag behind it)
    proc = tmp_path / "gpus"
    proc.mkdir()
    (proc / "0000:01:00.0").mkdir()
    assert physical_gpus(str(proc), str(dev)) == 1
    with pytest.raises(PreflightError, match="names '2', which is no GPU of this machine"):
        check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "2"}, no_proc, str(dev))


def test_local_ranks_group_by_host_in_first_seen_order():
    assert assign_local_ranks(["a", "a", "b", "b", "a"]) == [
        (0, 3, 0),
        (1, 3, 0),
        (0, 2, 1),
        (1, 2, 1),
        (2, 3, 0),
    ]
    plan = plan_cluster(4, gpu_ids=["0", "1"], hosts=["a", "a", "b", "b"])
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert plan.backend == "nccl"
    assert [r.env["GROUP_RANK"] for r in plan.ranks] == ["0", "0", "1", "1"]


def test_more_local_ranks_than_the_machine_can_run_is_refused():
    import os

    from notebook_dist.plan import max_local_ranks

    assert max_local_ranks() == 16 * os.cpu_count()
    with pytest.raises(PreflightError) as info:
        plan_cluster(n=10**20, gpu_ids=[])
    assert str(info.value) == (
        f"-n {10**20}: more ranks than this machine can run ({os.cpu_count()} CPU cores; "
        f"at most {max_local_ranks()} ranks on one machine)"
    )
    assert plan_cluster(n=max_local_ranks(), gpu_ids=[]).world_size == max_local_ranks()


@pytest.mark.parametrize(
    ("hosts", "n", "engines"),
    [
        ("node1,node2", None, {"node1": 1, "node2": 1}),
        ("node1,node2,node3", 7, {"node1": 3, "node2": 2, "node3": 2}),
        ("me@node1:2,node2:1", None, {"me@node1": 2, "node2": 1}),
        ("me@node1:2, node2:1,", 3, {"me@node1": 2, "node2": 1}),
    ],
)
def test_ssh_hosts_are_spread_as_asked(hosts, n, engines):
    from notebook_dist.cluster.hosts import parse_hosts, spread_over_hosts

    assert spread_over_hosts(parse_hosts(hosts), n) == engines


@pytest.mark.parametrize(
    ("hosts", "n", "message"),
    [
        ("", None, "--launcher ssh needs --hosts"),
        ("a:0", None, "--hosts: 'a:0': after ':' give how many ranks that host runs"),
        ("a:x", None, "--hosts: 'a:x': after ':' give how many ranks"),
        ("a,a:2", None, "--hosts lists a twice"),
        ("-oProxyCommand=x", None, "--hosts: '-oProxyCommand=x' is not an ssh destination"),
        (":3", None, "--hosts: ':3' is not an ssh destination"),
        ("a,b,c", 2, "-n 2 is fewer ranks than the 3 hosts given"),
    ],
)
def test_ssh_hosts_refused_with_a_reason(hosts, n, message):
    from notebook_dist.cluster.hosts import parse_hosts, spread_over_hosts

    with pytest.raises(PreflightError) as err:
        spread_over_hosts(parse_hosts(hosts), n)
    assert str(err.value).startswith(message), str(err.value)


def test_cuda_visible_devices_that_hides_gpus_is_said_and_one_that_names_none_is_refused(tmp_path):
    for i in range(8):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    gpus = str(tmp_path)
    assert check_cuda_visible_devices({}, gpus) is None
    assert check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, gpus) is None
    note = check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "0"}, gpus)
    assert note.startswith(
        "CUDA_VISIBLE_DEVICES=0 in this notebook's environment hides 7 of this machine's 8 GPUs"
    )
    assert "the ranks get none" in check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": ""}, gpus)
    with pytest.raises(
        PreflightError, match=r"CUDA_VISIBLE_DEVICES=0,9 names '9', which is no GPU"
    ):
        check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "0,9"}, gpus)
    assert (
        check_cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "0"}, "/nonexistent", "/nonexistent")
        is None
    )


def _probe(host, gpus):
    return {
        "host": host,
        "machine": host,
        "ip": f"10.0.0.{len(host)}",
        "gpus": gpus,
        "iface": "eth0",
    }


def test_a_mixed_gpu_and_cpu_world_is_refused_before_anything_starts():
    ordered = [_probe("node1", ["0", "1"]), _probe("node1", ["0", "1"]), _probe("node2", [])]
    with pytest.raises(
        PreflightError, match="a mixed GPU/CPU world: node1 has GPUs, node2 has none"
    ):
        plan_on_engines(ordered, "here", loopback_only=False)
    alike = [_probe("node1", ["0"]), _probe("node2", ["0"])]
    assert plan_on_engines(alike, "here", loopback_only=False, n=2).backend == "nccl"


def test_two_ranks_on_one_gpu_cannot_use_nccl():
    with pytest.raises(
        PreflightError, match="NCCL needs one GPU per rank: 2 ranks asked on one host, 1 GPU"
    ):
        plan_cluster(2, "nccl", gpu_ids=["0"])
