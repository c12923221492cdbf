"""The rank's default process group: made on a rendezvous store bound to MASTER_ADDR only,
and kept by the cluster. The bootstrap makes it; recovery rebuilds it (after a release) with
the same :func:`init_default_group`.

A second ``init_process_group()`` from user code (a pasted torchrun script) is skipped with a
note, and so is ``destroy_process_group()`` of the default group (frameworks end with it):
the next cell needs the group. The cluster's own code calls torch's originals.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .state import STATE, rank_file, user_namespace

#: torch's own init_process_group and destroy_process_group, before the guards
_originals: dict[str, Any] = {}


#: the cluster's own rendezvous and identity: a cell that sets them (a tutorial's setup())
#: changes its own environment, never the cluster's group or its rebuild
CLUSTER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _guarded_init_process_group(*args: Any, **kwargs: Any):
    """``init_process_group`` that leaves the cluster's own group in place.

    Code copied from a torchrun script calls ``init_process_group()``; here the group
    already exists, so the call is skipped, with a note once per cell naming the backend
    asked for and the one kept. Arguments torch itself would refuse are refused, in its
    words, as under torchrun.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return _originals["init"](*args, **kwargs)
    asked = kwargs.get("backend", args[0] if args else None)
    _check_like_torch(asked, kwargs.get("device_id"))
    kept = dist.get_backend()
    if STATE.extras.get("init_said") != STATE.cell_token:
        STATE.extras["init_said"] = STATE.cell_token
        differs = (
            f"; {asked!r} was asked for and {kept!r} is kept"
            if asked is not None and str(asked).lower() != kept
            else ""
        )
        print(
            f"notebook_dist: the default process group is already initialised (backend "
            f"{kept}, rank {dist.get_rank()} of {dist.get_world_size()}){differs}; this "
            "init_process_group() call is skipped. %dist_init with other arguments (or "
            "%dist_restart) gives a fresh group.",
            file=sys.stderr,
        )
    return None


def _check_like_torch(backend: Any, device_id: Any) -> None:
    """What torch's init_process_group refuses before it makes a group, refused alike."""
    import torch
    import torch.distributed as dist

    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if isinstance(backend, str):
        known = {*dist.Backend.backend_list, *getattr(dist.Backend, "_plugins", {})}
        for part in backend.split(","):  # "cpu:gloo,cuda:nccl" too
            name = part.split(":")[-1].strip().lower()
            if name not in known:
                raise AssertionError(f"Unknown backend type {name}")
    if device_id is None:
        return
    acc = torch.accelerator.current_accelerator()
    if isinstance(device_id, int):
        if acc is None:
            raise ValueError(
                "device_id is an int, but no accelerator support is found from the current "
                "compilation. Please use a different compiled version that supports your "
                "accelerator."
            )
        device_id = torch.device(acc.type, device_id)
    if device_id.type == "cpu" or device_id.index is None:
        raise ValueError(
            "init_process_group device_id parameter must be an accelerator with an index"
        )
    if acc is None or device_id.type != acc.type:
        raise ValueError(
            f"device_id {device_id} does not match the current compilation's accelerator "
            f"support: {acc}. Please use a different compiled version that supports your "
            "accelerator."
        )


def note_env_changes() -> None:
    """After a cell: say once that the cluster keeps its own MASTER_ADDR, RANK, ... when the
    cell set other values (its own code sees them; the group and its rebuild never do)."""
    own = STATE.extras.get("cluster_env") or {}
    changed = [k for k, v in own.items() if os.environ.get(k, v) != v]
    fresh = [k for k in changed if k not in STATE.extras.setdefault("env_said", set())]
    if not fresh:
        return
    STATE.extras["env_said"].update(fresh)
    said = ", ".join(f"{k}={os.environ[k]}" for k in fresh)
    theirs = ", ".join(f"{k}={own[k]}" for k in fresh)
    print(
        f"notebook_dist: this cell set {said}; the cluster keeps its own ({theirs}) for its "
        "process group and for rebuilding it. Said once.",
        file=sys.stderr,
    )


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


def torch_init_process_group(**kwargs) -> None:
    """torch's own ``init_process_group`` (the cells' one is guarded: ours makes the group)."""
    import torch.distributed as dist

    (_originals.get("init") or dist.init_process_group)(**kwargs)


def default_group():
    """The default process group object, or None."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def instances(*classes) -> list[list]:
    """Every object of the process that is an instance of each of ``classes`` (None: none
    asked), in one look through the heap, each type judged once: ``isinstance`` would run a
    class's own check on every object (a device mesh's reads attributes of each, with
    torch's warnings: 100 ms for a rank's heap here, against 35 ms for this whole look)."""
    import gc

    wanted = [c for c in classes if c is not None]
    found: dict[Any, list] = {c: [] for c in wanted}
    if wanted:
        judged: dict[type, Any] = {}
        for obj in gc.get_objects():
            kind = type(obj)
            hit = judged.get(kind)
            if hit is None:
                hit = judged[kind] = next((c for c in wanted if issubclass(kind, c)), False)
            if hit:
                found[hit].append(obj)
    return [found[c] if c is not None else [] for c in classes]


def rebind_ddp(pairs: list[tuple[Any, Any]], modules: list) -> int:
    """DDP modules of ``modules`` (every one of the process: :func:`instances`) that used
    an old group of ``pairs`` (destroyed, made again: the default group, one made with
    ``new_group()`` or a device mesh's) use its new one: their reducer is built anew, as
    when a DDP module is unpickled, so the survivors' models train on after a rebuild.
    Returns how many were rebound."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    new_for = {id(o): n for o, n in pairs if o is not None and n is not None and n is not o}
    if ddp is None or not new_for:
        return 0
    found = [m for m in modules if id(getattr(m, "process_group", None)) in new_for]
    for m in found:
        _rebuild_reducer(ddp, m, new_for[id(m.process_group)])
    return len(found)


def _rebuild_reducer(ddp, module, new) -> None:
    """``module``'s reducer made anew on the group ``new``, by DDP's own unpickling, which
    takes the default group: for the time of it, torch's default group as DDP's module
    sees it is ``new`` for this thread, and the real one for any other (a thread of the
    user's that makes a DDP module meanwhile gets the default group, not ``new``)."""
    module.process_group = new
    default = ddp._get_default_group
    here = threading.get_ident()
    ddp._get_default_group = lambda: new if threading.get_ident() == here else default()
    try:
        module.__setstate__(module.__getstate__())
    finally:
        ddp._get_default_group = default


def rebind_holders(pairs: list[tuple[Any, Any]]) -> int:
    """Everything else that held an old group of ``pairs`` (destroyed, made again) as an
    attribute, or as a variable of the cells, holds its new one: FSDP2's mesh info
    (``fully_shard`` keeps the group it shards over), an object of the user's. A list or a
    tuple that holds one (torch's own books) is left as it is. One look through the heap for
    all of them. Returns how many were."""
    import gc

    # (by id: the old groups are alive, held by ``pairs``, so no other object has theirs)
    new_for = {id(o): n for o, n in pairs if o is not None and n is not None and n is not o}
    if not new_for:
        return 0
    olds = [old for old, _ in pairs if id(old) in new_for]
    namespace = user_namespace()
    rebound = 0
    for holder in gc.get_referrers(*olds):
        if holder is namespace:
            found = {k: new_for[id(v)] for k, v in holder.items() if id(v) in new_for}
            holder.update(found)
            rebound += len(found)
        elif not isinstance(holder, (dict, list, tuple, type, types.FrameType, types.CellType)):
            for name, value in _attributes(holder):
                if id(value) in new_for:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(holder, name, new_for[id(value)])
                        rebound += 1
    return rebound


def _attributes(obj) -> list[tuple[str, Any]]:
    """An object's attributes, from its ``__dict__`` and its classes' ``__slots__``."""
    out = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    return out


def destroy_default_group() -> None:
    """torch's own ``destroy_process_group`` of the default group (ours leaves it alone).

    torch names each new group by a count it starts again here, and every rank must name
    the next group alike; a group whose making failed (a rank not there in time) was
    counted, on the ranks that got that far: the count starts again then too."""
    import torch.distributed as dist

    if dist.is_initialized():
        _originals.get("destroy", dist.destroy_process_group)()
    with contextlib.suppress(AttributeError):  # (torch's books, as torch 2.x keeps them)
        dist.distributed_c10d._world.group_count = 0


#: rank 0's store sockets, bound and listening before the port was handed to the others
_listening: dict[int, socket.socket] = {}


def _listening_socket(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def open_rendezvous(addr: str) -> int:
    """On rank 0's engine: the store's socket, bound to ``addr`` on a port the OS picks and
    listening from now on; returns the port. Nothing else can take the port between its
    choice and the store's start (a port found free and closed again can be)."""
    close_rendezvous()
    sock = _listening_socket(addr, 0)
    port = sock.getsockname()[1]
    _listening[port] = sock
    return port


def close_rendezvous() -> None:
    """The sockets :func:`open_rendezvous` opened here and no store took, closed."""
    for old in _listening.values():
        old.close()
    _listening.clear()


def rendezvous_store(rank: int, world_size: int, timeout_s: float):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, rank 0 hosting it.

    torch's own store listens on every interface; ours is handed a socket bound to
    MASTER_ADDR only (127.0.0.1 on one machine), so nothing is exposed by default: the one
    :func:`open_rendezvous` opened for this port, or one bound now (a port the user chose).
    """
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    sock = _listening.pop(port, None) or _listening_socket(addr, port)
    fd = sock.detach()  # the store owns the descriptor from now on
    # not waiting for the others to connect: the group's own rendezvous waits for each of
    # them (and fails after the same timeout), where torch's wait for workers polls the
    # count every 10 ms, and so took 10-12 ms of every 2-rank group's start here
    own = {"wait_for_workers": False, "master_listen_fd": fd}
    try:
        return dist.TCPStore(addr, port, world_size, True, timeout, use_libuv=True, **own)
    except NotImplementedError:  # torch 2.4: its libuv store takes no socket, the legacy one does
        return dist.TCPStore(addr, port, world_size, True, timeout, use_libuv=False, **own)


def init_default_group(
    backend: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: str,
    rendezvous_timeout_s: float | None = None,
    store_timeout_s: float | None = None,
    then: Callable[[Any], Any] | None = None,
) -> Any:
    """torch's init_process_group on our loopback-bound store (also after a rebuild).

    ``timeout_s`` is the collectives' timeout; ``store_timeout_s`` (default the same) how
    long the store waits once the group is made (``new_group()`` meets in it);
    ``rendezvous_timeout_s`` (default the store's) how long a rank waits for its peers to
    meet in the store to make this group, and in ``then(store)`` (what else is made
    before the group is in use: the other groups a rebuild makes again), whose result is
    returned."""
    import torch

    store_timeout_s = store_timeout_s or timeout_s
    store = rendezvous_store(rank, world_size, rendezvous_timeout_s or store_timeout_s)
    kwargs: dict[str, Any] = dict(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    meeting = timedelta(seconds=rendezvous_timeout_s) if rendezvous_timeout_s else None
    with meeting_within(meeting) if meeting else contextlib.nullcontext():
        torch_init_process_group(**kwargs)
    try:
        return then(store) if then else None
    finally:
        if rendezvous_timeout_s:
            store.set_timeout(timedelta(seconds=store_timeout_s))


@contextlib.contextmanager
def meeting_within(within: timedelta):
    """The Gloo groups made in the block meet (their members connect) within ``within``
    (the rendezvous's timeout), then get the timeout they were asked for: Gloo's members
    wait for each other that long (the collectives' timeout; torch's default for a
    ``new_group()``, 30 minutes), so one that failed to come would hold the others there.
    (NCCL's meet in the store, within its timeout.)"""
    import torch.distributed.distributed_c10d as c10d

    helper = c10d._new_process_group_helper

    def meeting(*args, **kwargs):
        asked = kwargs.get("timeout")
        backend = str(kwargs.get("backend", args[3] if len(args) > 3 else "")).lower()
        if asked is None or asked <= within or "nccl" in backend:
            return helper(*args, **kwargs)
        made = helper(*args, **{**kwargs, "timeout": within})
        if isinstance(made[0], c10d.ProcessGroup):  # (a member)
            c10d._set_pg_timeout(asked, made[0])
        return made

    c10d._new_process_group_helper = meeting
    try:
        yield
    finally:
        c10d._new_process_group_helper = helper


#: torch's own collective timeout, as Gloo and NCCL word it
TIMEOUT = re.compile(
    r"Timed out waiting (\d+)ms|Watchdog caught collective operation timeout|"
    r"operation timed out|timed out after",
    re.IGNORECASE,
)
#: a communicator that can no longer be used: its connections were closed or aborted
CLOSED = re.compile(
    r"Application timeout caused pair closure|Connection closed by peer|"
    r"Connection reset by peer|Broken pipe|communicator was aborted|NCCL communicator .*abort",
    re.IGNORECASE,
)


def note_failure(
    exc: BaseException, in_collective: bool, record: dict | None = None
) -> dict | None:
    """Whether ``exc`` broke the default group, and why; the first break is kept until the
    group is made again. A group whose collective timed out, or whose connections were
    closed or aborted, fails every later collective at once until it is made again. Only an
    error from torch.distributed counts (``in_collective``: the tracker saw the collective
    fail, in any thread, caught by the user's code or not; else a frame of torch.distributed
    or DDP in the traceback), never a user's own socket error. ``record``: the tracker's
    record of the collective that failed (which one torch's timeout ended, and where)."""
    text = str(exc)
    timeout, closed = TIMEOUT.search(text), CLOSED.search(text)
    if not (timeout or closed):
        return None
    if not in_collective:
        frames = traceback.extract_tb(exc.__traceback__)
        if not any(
            "/torch/distributed/" in f.filename or "/torch/nn/parallel/" in f.filename
            for f in frames
        ):
            return None
    if STATE.group_broken is not None:  # the first break is the cause; later ones follow it
        return STATE.group_broken
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # Gloo's "[.../pair.cc:553] "
    broken = {"kind": "timeout" if timeout else "closed", "why": first[:200]}
    if record is not None:
        broken["record"] = record
    STATE.group_broken = broken
    _mark_broken(broken["why"])
    return broken


def broken_folder(folder: str) -> str:
    """Where ranks whose group broke say so (:func:`_mark_broken`): a folder of its own beside
    their control files in ``folder``, so the notebook's look before each cell lists these
    marks (most often none), not every rank's control files."""
    return os.path.join(folder, "broken")


def _broken_mark() -> str | None:
    """The file that says the rank's group broke (in :func:`broken_folder`): the notebook
    looks for it before a cell, so a group that broke between cells (a thread of the user's
    ran into torch's timeout) is made again before the cell runs."""
    control = STATE.extras.get("control_file")
    if not control:
        return None
    return rank_file(broken_folder(os.path.dirname(control)), "broken", STATE.rank)


def _mark_broken(why: str) -> None:
    path = _broken_mark()
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(why)
        except OSError:  # the cell's own reply still says so
            pass


def clear_broken_mark() -> None:
    path = _broken_mark()
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
