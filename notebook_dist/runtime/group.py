"""The rank's default process group: made on a rendezvous store bound to MASTER_ADDR only,
and kept by the cluster. The bootstrap makes it; recovery rebuilds it (after a release) with
the same :func:`init_default_group`.

A second ``init_process_group()`` from user code (a pasted torchrun script) is skipped with a
note, and so is ``destroy_process_group()`` of the default group (frameworks end with it):
the next cell needs the group. The cluster's own code calls torch's originals.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any

from .state import STATE

#: torch's own init_process_group and destroy_process_group, before the guards
_originals: dict[str, Any] = {}


def _guarded_init_process_group(*args: Any, **kwargs: Any):
    """``init_process_group`` that leaves the cluster's own group in place.

    Code copied from a torchrun script calls ``init_process_group()``; here the group
    already exists, so the call is skipped with a note instead of raising.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        print(
            f"notebook_dist: the default process group is already initialised "
            f"(backend {dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}); "
            "this init_process_group() call is skipped. %dist_init with other arguments (or "
            "%dist_restart) gives a fresh group.",
            file=sys.stderr,
        )
        return None
    return _originals["init"](*args, **kwargs)


def _guarded_destroy_process_group(group: Any = None) -> None:
    """``destroy_process_group`` that leaves the cluster's default group in place.

    Frameworks end their runs with it (Accelerate's ``end_training()``, the Transformers
    Trainer's ``end()``); under torchrun the process exits next, here the next cell needs
    the group. Other groups are destroyed as asked.
    """
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        if not STATE.extras.get("destroy_said"):
            STATE.extras["destroy_said"] = True
            print(
                "notebook_dist: destroy_process_group() of the default group is skipped: it "
                "belongs to the cluster, and the next cell needs it (%dist_restart gives fresh "
                "ranks). Said once per rank.",
                file=sys.stderr,
            )
        return None
    return _originals["destroy"](group)


def install_guards(dist_module) -> None:
    c10d = dist_module.distributed_c10d
    if not _originals:
        _originals["init"] = c10d.init_process_group
        _originals["destroy"] = c10d.destroy_process_group
    for module in (dist_module, c10d):
        module.init_process_group = _guarded_init_process_group
        module.destroy_process_group = _guarded_destroy_process_group


def destroy_default_group() -> None:
    """torch's own ``destroy_process_group`` of the default group (ours leaves it alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        _originals.get("destroy", dist.destroy_process_group)()


def rendezvous_store(rank: int, world_size: int, timeout_s: float):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, rank 0 hosting it.

    torch's own store listens on every interface; ours is handed a socket bound to
    MASTER_ADDR only (127.0.0.1 on one machine), so nothing is exposed by default.
    """
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(128)
    fd = sock.detach()  # the store owns the descriptor from now on
    return dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=fd, use_libuv=True)


def init_default_group(
    backend: str, rank: int, world_size: int, timeout_s: float, device: str
) -> None:
    """torch's init_process_group on our loopback-bound store (also after a rebuild)."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = dict(
        backend=backend,
        store=rendezvous_store(rank, world_size, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    (_originals.get("init") or dist.init_process_group)(**kwargs)
