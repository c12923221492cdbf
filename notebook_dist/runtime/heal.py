"""The rank side of healing: a fresh engine stands in for a dead rank (the kernel side is
:mod:`notebook_dist.heal`).

The stand-in becomes rank r of the same world twice over. First it joins a group of its
own that only pretends to communicate (torch's ``fake`` backend: every collective returns
at once and sends nothing), so the notebook's setup cells can run on it alone while the
survivors wait; then, with the survivors, the real default group is made again
(:func:`notebook_dist.runtime.recover.reinit`), so ``dist.get_rank()`` is r everywhere.
Variables are then copied from a survivor as one object graph (:func:`pack` there,
:func:`unpack` here): an optimizer still refers to the copied model's parameters, and
tensors land on this rank's device.
"""

from __future__ import annotations

import io

from .state import STATE, user_namespace


def warm() -> int:
    """What a spare imports before it is needed (:func:`preload`), so that taking it
    costs a process group, not imports. Its pid."""
    import os

    preload()
    return os.getpid()


def preload() -> None:
    """torch, what an optimizer loads when the first one is made, and the modules a rank
    loads as it joins a group and runs its first cell (an optimizer's first one alone is
    ~1 s here; the first cell's modules 10 ms, for each rank)."""
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    from . import (  # noqa: F401
        agent,
        cell,
        debugger,
        lane,
        launch,
        recover,
        streams,
        tracker,
        workspace,
    )

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo & co.


def join_alone(rank: int, world_size: int) -> None:
    """The default group as rank ``rank`` of ``world_size``, with nobody else in it: its
    collectives return at once (what they would have received is not known)."""
    # importing it registers torch's "fake" backend (in torch since 2.1)
    from torch.testing._internal.distributed import fake_pg

    from .group import torch_init_process_group

    torch_init_process_group(
        backend="fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size
    )
    _ddp_alone()


def _ddp_alone() -> None:
    """A DDP module made in the group of its own reduces nothing: its gradients stay its
    own (torch's fake group cannot complete DDP's bucket all_reduce). Its reducer is made
    anew on the real group afterwards (``group.rebind_ddp``), without this hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, "_notebook_dist_alone", False):
        return
    init = DDP.__init__

    def init_alone(self, *args, **kwargs):
        import torch.distributed as dist

        init(self, *args, **kwargs)
        if dist.get_backend(self.process_group) == "fake":
            self.register_comm_hook(None, noop_hook)

    init_alone._notebook_dist_alone = True
    DDP.__init__ = init_alone


def pack(names: list[str]) -> bytes:
    """``names`` from this rank's namespace, pickled together (shared objects stay
    shared), tensors by torch's own format so the receiver can place them."""
    import cloudpickle
    import torch

    ns = user_namespace()
    missing = [n for n in names if n not in ns]
    if missing:
        raise NameError(
            f"{', '.join(missing)} not defined on rank {STATE.rank}, the rank healed from"
        )
    buf = io.BytesIO()
    torch.save({n: ns[n] for n in names}, buf, pickle_module=cloudpickle)
    return buf.getvalue()


def unpack(blob: bytes) -> list[str]:
    """What :func:`pack` made on a survivor, in this rank's namespace, on its device."""
    import torch

    objs = torch.load(io.BytesIO(blob), map_location=STATE.device, weights_only=False)
    user_namespace().update(objs)
    return sorted(objs)
