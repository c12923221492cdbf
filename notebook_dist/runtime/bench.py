"""The rank side of ``%dist_bench``: time collectives over a range of sizes, the way
nccl-tests does (warm-up, then many iterations between two barriers, the slowest rank's
time counting)."""

from __future__ import annotations

import time

from .state import STATE

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def _raw(fn):
    """torch's own function, without the tracker's wrapper: its microseconds would count."""
    return getattr(fn, "_notebook_dist_original", fn)


def _call(op: str, dist, send, recv):
    """One collective, by the names torch 2.13 teaches (older ones where those are absent)."""
    if op == "all_reduce":
        return _raw(dist.all_reduce)(send)
    if op == "broadcast":
        return _raw(dist.broadcast)(send, src=0)
    if op == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return _raw(fn)(recv, send)
    if op == "reduce_scatter":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return _raw(fn)(recv, send)
    if op == "all_to_all":
        return _raw(dist.all_to_all_single)(recv, send)
    raise ValueError(op)


def buffers(op: str, size: int, dtype, device, world_size: int):
    """Send and receive buffers for S = ``size`` bytes, as nccl-tests sizes each op:
    all_gather's S is its whole output, reduce_scatter's its whole input."""
    import torch

    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(1, size // elem)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(world_size, count - count % world_size)  # divisible among the ranks
    if op == "all_gather":
        return torch.ones(count // world_size, dtype=dtype, device=device), torch.empty(
            count, dtype=dtype, device=device
        )
    if op == "reduce_scatter":
        return torch.ones(count, dtype=dtype, device=device), torch.empty(
            count // world_size, dtype=dtype, device=device
        )
    if op == "all_to_all":
        return torch.ones(count, dtype=dtype, device=device), torch.empty(
            count, dtype=dtype, device=device
        )
    return torch.ones(count, dtype=dtype, device=device), None


def run(ops: list[str], sizes: list[int], dtype_name: str, budget_s: float = 0.25) -> list[dict]:
    """Per (op, size): the bytes S, iterations and the slowest rank's seconds per iteration."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    device = torch.device(STATE.device) if STATE.backend == "nccl" else torch.device("cpu")
    world_size = dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for op in ops:
        for size in sizes:
            send, recv = buffers(op, size, dtype, device, world_size)
            for _ in range(2):  # warm-up: connections, allocations
                _call(op, dist, send, recv)
            sync()
            # as many iterations as fit the time budget, agreed by every rank (the slowest's)
            t0 = time.perf_counter()
            _call(op, dist, send, recv)
            sync()
            one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(one, op=dist.ReduceOp.MAX)
            iters = int(min(200, max(3, budget_s / max(one.item(), 1e-6))))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                _call(op, dist, send, recv)
            sync()
            took = torch.tensor(
                [(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device
            )
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            moved = send.numel() * send.element_size()
            if op == "all_gather":
                moved *= world_size
            out.append({"op": op, "bytes": moved, "iters": iters, "seconds": took.item()})
    return out
