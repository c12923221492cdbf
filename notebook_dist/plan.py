"""Which device and backend each rank gets: pure decisions, testable with any GPU count.

The kernel never imports torch to decide this (that costs seconds); it counts GPUs from
the driver (:func:`visible_gpus`) and the ranks confirm what they see when they start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import PreflightError
from .runtime.devices import DEV_ROOT, PROC_GPUS, physical_gpus, visible_gpus

BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class RankPlan:
    """What one rank is told before it starts: its identity, device and environment."""

    rank: int
    local_rank: int
    device: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterPlan:
    """The whole cluster's layout; ``notes`` are said to the user at start."""

    world_size: int
    backend: str
    ranks: tuple[RankPlan, ...]
    cuda_visible_devices: str | None
    notes: tuple[str, ...] = ()


def check_cuda_visible_devices(
    environ: dict[str, str] | None = None, proc_root: str = PROC_GPUS, dev_root: str = DEV_ROOT
) -> str | None:
    """The notebook's own ``CUDA_VISIBLE_DEVICES`` against the machine's GPUs, before
    anything starts: an entry that names no GPU is refused (CUDA would silently stop at
    it), and one that hides GPUs is said (the ranks get only what it shows)."""
    environ = os.environ if environ is None else environ
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    physical = physical_gpus(proc_root, dev_root)
    if spec is None or not physical:
        return None
    shown = visible_gpus(environ, proc_root, dev_root)
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if items and items != ["-1"] and len(shown) < len(items):
        bad = items[len(shown)]
        raise PreflightError(
            f"CUDA_VISIBLE_DEVICES={spec} names {bad!r}, which is no GPU of this machine (it "
            f"has {physical}: 0-{physical - 1}); CUDA would stop there and use "
            f"{', '.join(shown) or 'no GPU'}. Fix it, or unset it and choose with --gpus"
        )
    if len(shown) < physical:
        hidden = physical - len(shown)
        return (
            f"CUDA_VISIBLE_DEVICES={spec} in this notebook's environment hides {hidden} of this "
            f"machine's {physical} GPUs: the ranks get {len(shown) or 'none'} "
            f"(unset it to use them all, or choose with --gpus)"
        )
    return None


def assign_local_ranks(hosts: list[str]) -> list[tuple[int, int, int]]:
    """``(local_rank, local_world_size, group_rank)`` for each rank, by host, in rank order.

    Hosts keep the order in which their first rank appears (that is torchrun's node rank).
    """
    order: dict[str, int] = {}
    counts: dict[str, int] = {}
    local = []
    for host in hosts:
        order.setdefault(host, len(order))
        local.append(counts.get(host, 0))
        counts[host] = counts.get(host, 0) + 1
    return [(lr, counts[h], order[h]) for lr, h in zip(local, hosts)]


def parse_gpu_list(text: str | list[int] | None) -> list[int] | None:
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        try:
            items = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise PreflightError(f"bad --gpus {text!r}: give GPU indices like '0,1'") from None
    if not items:
        raise PreflightError("--gpus is empty: give GPU indices like '0,1'")
    if len(set(items)) != len(items):
        raise PreflightError(f"--gpus {text!r} lists a GPU twice; each rank needs its own GPU")
    return items


def max_local_ranks() -> int:
    """Ranks one machine may run: each is a process holding torch (hundreds of MB)."""
    return 16 * (os.cpu_count() or 1)


def plan_cluster(
    n: int | None = None,
    backend: str = "auto",
    gpus: str | list[int] | None = None,
    *,
    gpu_ids: list[str] | None = None,
    hosts: list[str] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    run_id: str | None = None,
) -> ClusterPlan:
    """Decide world size, backend and one device per rank.

    ``gpu_ids`` are the GPUs visible to the notebook (default: :func:`visible_gpus`).
    ``run_id`` is the ranks' TORCHELASTIC_RUN_ID (default: a fresh one, as torchrun's).
    Raises :class:`PreflightError` with a sentence to act on when the request cannot work.
    """
    backend = (backend or "auto").lower()
    if backend not in BACKENDS:
        raise PreflightError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    notes: list[str] = []
    if gpu_ids is None:  # this machine: what the notebook's CUDA_VISIBLE_DEVICES shows
        hidden = check_cuda_visible_devices()
        notes += [hidden] if hidden else []
        gpu_ids = visible_gpus()
    use = chosen_gpus(gpus, gpu_ids, n)
    check_rank_count(n, hosts)
    world_size = (len(use) if use else DEFAULT_CPU_RANKS) if n is None else n
    hosts = hosts or ["localhost"] * world_size
    if len(hosts) != world_size:
        raise PreflightError(f"{len(hosts)} hosts given for {world_size} ranks")
    local = assign_local_ranks(hosts)
    chosen_backend, devices, cvd, said = place_on_devices(use, local, backend)
    run_id = run_id or new_run_id()
    ranks = []
    for rank, (device, (local_rank, local_world_size, group_rank)) in enumerate(
        zip(devices, local)
    ):
        env = torchrun_env(rank, world_size, local_rank, local_world_size, group_rank)
        env.update(
            GROUP_WORLD_SIZE=str(len(set(hosts))),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            TORCHELASTIC_RUN_ID=run_id,
        )
        if device == "cpu":  # CPU ranks: Accelerate and Transformers use them as `--cpu`
            env["ACCELERATE_USE_CPU"] = "true"
        if cvd is not None:
            env["CUDA_VISIBLE_DEVICES"] = cvd
        ranks.append(RankPlan(rank=rank, local_rank=local_rank, device=device, env=env))
    return ClusterPlan(world_size, chosen_backend, tuple(ranks), cvd, tuple(notes + said))


def new_run_id() -> str:
    import uuid

    return f"notebook_dist-{uuid.uuid4().hex[:12]}"


def torchrun_env(
    rank: int, world_size: int, local_rank: int, local_world_size: int, group_rank: int
) -> dict[str, str]:
    """The variables torchrun gives a worker (its rendezvous ones, MASTER_ADDR, MASTER_PORT,
    GROUP_WORLD_SIZE and TORCHELASTIC_RUN_ID, are the cluster's to add)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def chosen_gpus(gpus, gpu_ids: list[str], n: int | None) -> list[str]:
    """The GPUs the ranks use: ``--gpus`` (indices into ``gpu_ids``), or all of them."""
    chosen = parse_gpu_list(gpus)
    if chosen is None:
        return list(gpu_ids)
    if not gpu_ids:
        raise PreflightError(f"--gpus {gpus!r} asked, but no GPU is visible to this notebook")
    bad = [g for g in chosen if g < 0 or g >= len(gpu_ids)]
    if bad:
        raise PreflightError(
            f"--gpus names GPU {bad[0]}, but only {len(gpu_ids)} GPU(s) are visible "
            f"(indices 0-{len(gpu_ids) - 1})"
        )
    if n is not None and n != len(chosen):
        raise PreflightError(
            f"-n {n} asks for {n} ranks but --gpus lists {len(chosen)} GPUs; "
            "give one of them, or make them agree"
        )
    return [gpu_ids[g] for g in chosen]


def check_rank_count(n: int | None, hosts: list[str] | None) -> None:
    if n is not None and n < 1:
        raise PreflightError(f"-n {n}: a cluster needs at least one rank")
    if n is not None and hosts is None and n > max_local_ranks():
        raise PreflightError(
            f"-n {n}: more ranks than this machine can run ({os.cpu_count()} CPU cores; "
            f"at most {max_local_ranks()} ranks on one machine)"
        )


def place_on_devices(
    use: list[str], local: list[tuple[int, int, int]], backend: str
) -> tuple[str, list[str], str | None, list[str]]:
    """(backend, each rank's device, CUDA_VISIBLE_DEVICES, notes): NCCL with one GPU per
    rank, Gloo when ranks share GPUs or there are none."""
    world_size = len(local)
    if not use:
        if backend == "nccl":
            raise PreflightError(
                "NCCL needs one GPU per rank, and no GPU is visible to this notebook. "
                "Use --backend gloo (the default without GPUs)."
            )
        return "gloo", ["cpu"] * world_size, None, []
    per_host = max(lws for _, lws, _ in local)  # GPUs are per host
    notes = []
    if per_host > len(use):
        if backend == "nccl":
            raise PreflightError(
                f"NCCL needs one GPU per rank: {per_host} ranks asked on one host, {len(use)} GPU(s) "
                f"available. Use -n {len(use)}, or --backend gloo to let ranks share GPUs."
            )
        chosen = "gloo"
        notes.append(
            f"{per_host} ranks share {len(use)} GPU(s), so the backend is Gloo "
            "(NCCL refuses two ranks on one GPU)."
        )
    else:
        chosen = "nccl" if backend in ("auto", "nccl") else "gloo"
    devices = [f"cuda:{lr % len(use)}" for lr, _, _ in local]
    return chosen, devices, ",".join(use[: min(per_host, len(use))]), notes


def rank_order(probes: dict[int, dict]) -> list[int]:
    """Engine ids in rank order: by the launcher's own rank where every engine has one
    (MPI, Slurm); otherwise hosts in the order of their first engine, engines by id within
    a host, so LOCAL_RANK counts within each host as torchrun's does."""
    ids = sorted(probes)
    launcher = [probes[e].get("launcher_rank") for e in ids]
    if None not in launcher and len(set(launcher)) == len(ids):
        return sorted(ids, key=lambda e: probes[e]["launcher_rank"])
    first: dict[str, int] = {}
    for e in ids:
        first.setdefault(probes[e]["machine"], len(first))
    return sorted(ids, key=lambda e: (first[probes[e]["machine"]], e))


def master_address(ordered: list[dict], here: str, loopback_only: bool) -> str:
    """MASTER_ADDR: loopback when every rank is on this machine; otherwise an address of
    rank 0's host that the others reach, which needs the network flag."""
    machines = {p["machine"] for p in ordered}
    if machines == {here}:
        return "127.0.0.1"
    hosts = sorted({p["host"] for p in ordered})
    if loopback_only:
        where = f"{len(machines)} hosts" if len(machines) > 1 else "another host"
        raise PreflightError(
            f"the engines run on {where} ({', '.join(hosts)}), so the ranks must "
            "meet over the network: add --network to let rank 0's rendezvous store and Gloo listen "
            f"on {ordered[0]['ip']} (connections between ranks are not encrypted; the ipyparallel "
            "messages stay HMAC-signed)"
        )
    if ordered[0]["ip"].startswith("127."):
        raise PreflightError(
            f"rank 0's host {ordered[0]['host']} has no address off the machine (only "
            f"{ordered[0]['ip']}): the other hosts could not reach its rendezvous store"
        )
    return ordered[0]["ip"]


def plan_on_engines(
    ordered: list[dict],
    here: str,
    loopback_only: bool,
    n: int | None = None,
    backend: str = "auto",
    gpus: str | list[int] | None = None,
) -> ClusterPlan:
    """The plan for engines that already run, from their probes in rank order: LOCAL_RANK
    by host, GPUs as rank 0's host sees them, MASTER_ADDR from :func:`master_address` and,
    over the network, Gloo on the interface that holds each rank's address."""
    with_gpus = {p["host"] for p in ordered if p["gpus"]}
    if with_gpus and len(with_gpus) < len({p["host"] for p in ordered}):
        without = sorted({p["host"] for p in ordered} - with_gpus)
        raise PreflightError(
            f"a mixed GPU/CPU world: {', '.join(sorted(with_gpus))} "
            f"{'has' if len(with_gpus) == 1 else 'have'} GPUs, {', '.join(without)} "
            f"{'has' if len(without) == 1 else 'have'} none. Every rank must be alike: start the "
            "ranks on hosts with GPUs only, or hide the GPUs (CUDA_VISIBLE_DEVICES= on those "
            "hosts' engines) for CPU ranks on Gloo everywhere"
        )
    plan = plan_cluster(
        n,
        backend,
        gpus,
        gpu_ids=ordered[0]["gpus"],
        hosts=[p["machine"] for p in ordered],
        master_addr=master_address(ordered, here, loopback_only),
    )
    if not loopback_only:
        for rp, p in zip(plan.ranks, ordered):
            if p.get("iface"):
                rp.env["GLOO_SOCKET_IFNAME"] = p["iface"]
    return plan
