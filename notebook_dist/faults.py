"""Fault injection: reproduce each classic distributed bug on demand, inside a cell.

For teaching and for tests. Call inside ``%%distributed`` on every rank::

    %%distributed
    nd.faults.conditional_collective()      # a collective only rank 0 calls

Each function does what buggy user code does; none of them fakes a diagnosis.
"""

from __future__ import annotations

import signal
import time


def _dist():
    import torch
    import torch.distributed as dist

    return torch, dist


def conditional_collective(rank: int = 0) -> None:
    """Only ``rank`` broadcasts; every rank then all_reduces: the ranks disagree at #1."""
    torch, dist = _dist()
    t = torch.ones(4)
    if dist.get_rank() == rank:
        dist.broadcast(t, src=rank)
    dist.all_reduce(t)


def mismatched_ops() -> None:
    """Rank 0 all_reduces while the others all_gather, at the same step."""
    torch, dist = _dist()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size())], t)


def root_mismatch(op: str = "broadcast") -> None:
    """Every rank passes itself as the root (``src=rank``, ``dst=rank``), as code written for
    one process does: ``op`` is broadcast, reduce, scatter or gather."""
    torch, dist = _dist()
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    if op == "broadcast":
        dist.broadcast(t, src=rank)
    elif op == "reduce":
        dist.reduce(t, dst=rank)
    elif op == "scatter":
        dist.scatter(t, [torch.ones(4) for _ in range(n)], src=rank)
    elif op == "gather":
        dist.gather(t, [torch.empty(4) for _ in range(n)], dst=rank)
    else:
        raise ValueError(f"op {op!r}: use broadcast, reduce, scatter or gather")


def mismatched_dtypes() -> None:
    """Rank 0 passes float32, the others float64 (Gloo aborts the receiving rank)."""
    torch, dist = _dist()
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.float64))


def mismatched_shapes() -> None:
    """Rank 0 passes 4 elements, the others 5 (Gloo aborts the receiving rank)."""
    torch, dist = _dist()
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 5))


def raise_on(rank: int = 1, after_s: float = 0.5) -> None:
    """``rank`` raises while the others wait for it in an all_reduce."""
    torch, dist = _dist()
    if dist.get_rank() == rank:
        time.sleep(after_s)
        raise RuntimeError(f"injected failure on rank {rank}")
    dist.all_reduce(torch.ones(1))


def die(rank: int = 1, sig: int = signal.SIGKILL, after_s: float = 0.5) -> None:
    """``rank``'s process is killed by ``sig`` while the others wait in an all_reduce."""
    torch, dist = _dist()
    if dist.get_rank() == rank:
        time.sleep(after_s)
        signal.raise_signal(sig)  # itself only: no pid to get wrong
    dist.all_reduce(torch.ones(1))


def busy(rank: int = 1, seconds: float = 60.0) -> None:
    """``rank`` computes in Python for ``seconds`` before joining the others' all_reduce."""
    torch, dist = _dist()
    if dist.get_rank() == rank:
        deadline = time.monotonic() + seconds
        x = 0
        while time.monotonic() < deadline:
            x += 1
    dist.all_reduce(torch.ones(1))


def finish_early(rank: int = 1) -> None:
    """``rank`` skips the final barrier and finishes the cell while the others wait."""
    _, dist = _dist()
    if dist.get_rank() != rank:
        dist.barrier()


def uneven_ddp(extra_batches: int = 3) -> None:
    """A DDP loop where rank 0 has ``extra_batches`` more batches than the others."""
    torch, dist = _dist()
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 1))
    batches = 5 + (extra_batches if dist.get_rank() == 0 else 0)
    for _ in range(batches):
        model(torch.randn(8, 4)).sum().backward()


def kill(rank: int = 1, sig: int = signal.SIGKILL) -> None:
    """If this is ``rank``, its process is killed by ``sig`` now: a crashed node, an
    out-of-memory kill. The other ranks go on until they wait for it."""
    _, dist = _dist()
    if dist.get_rank() == rank:
        signal.raise_signal(sig)  # itself only: no pid to get wrong


def p2p_deadlock() -> None:
    """Every rank sends to the next before it receives from the previous: a ring of sends
    in which no rank posts the receive another needs (Gloo's send waits for it)."""
    torch, dist = _dist()
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    dist.send(t, dst=(rank + 1) % size)
    dist.recv(t, src=(rank - 1) % size)


def orphan_recv(rank: int = 1, src: int = 0) -> None:
    """``rank`` waits to receive from ``src``, which never sends: it finishes the cell."""
    torch, dist = _dist()
    if dist.get_rank() == rank:
        dist.recv(torch.empty(4), src=src)


def library_collective(rank: int = 0) -> None:
    """Only ``rank`` gathers a sharded DTensor (``full_tensor()`` runs an all_gather), as a
    rank-0-only print or save of a sharded model would."""
    torch, dist = _dist()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    weight = distribute_tensor(torch.arange(8.0, device=device).reshape(4, 2), mesh, [Shard(0)])
    if dist.get_rank() == rank:
        print(weight.full_tensor())
