"""Release a rank blocked inside a Gloo or NCCL collective, and rebuild the process group.

SIGINT cannot interrupt a rank waiting in Gloo (the KeyboardInterrupt lands only when
the collective returns), and ``pg.abort()``/``destroy_process_group()`` from another
thread do not unblock it. Shutting down the rank's own Gloo pair sockets does: the
blocked call raises ``RuntimeError: ... Connection closed by peer`` at once, on this rank
and on the peers it was waiting with. Those are the sockets made while torch made a
process group (:func:`track_group_sockets`); every other connection of the rank is left
alone: the rendezvous store's, ipyparallel's, the notebook's lane, and the user's own.
Then every rank calls :func:`reinit`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

from .state import STATE, rebuild_step

#: held while the agent releases this rank and while the main thread rebuilds the group:
#: a release that was asked for during a cell can never close a rebuilt group's connections
_GROUP_LOCK = threading.Lock()


def _socket_inodes() -> dict[int, int]:
    """inode -> fd for this process's sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _tcp_table() -> dict[int, tuple[int, int, str, str]]:
    """inode -> (local port, remote port, state, remote address as /proc writes it) for TCP
    sockets (v4 and v6); :func:`_address` reads the address."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
                    address, _, port = remote.rpartition(":")
                    table[inode] = (int(local.rsplit(":", 1)[1], 16), int(port, 16), state, address)
        except OSError:
            continue
    return table


def _address(words: str) -> str:
    """An address as /proc/net/tcp writes it (32-bit words in hex, each in this machine's
    byte order), as ``ipaddress`` writes it; an IPv4 one mapped into IPv6 as IPv4."""
    import ipaddress

    raw = bytes.fromhex(words)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def remember_preexisting_sockets() -> None:
    """Called before the default group is made (again): the sockets open now are never a
    release's to shut, and the groups' sockets (:func:`track_group_sockets`) are gathered
    anew (a rebuild voids every group made before it)."""
    STATE.extras["preexisting_sockets"] = set(_socket_inodes())
    if "group_sockets" in STATE.extras:  # (gathered: track_group_sockets is in place)
        STATE.extras["group_sockets"] = set()


def track_group_sockets(c10d) -> None:
    """Gather the sockets of every process group torch makes: the default group,
    ``new_group``'s and ``split_group``'s are all made by ``_new_process_group_helper``,
    and the sockets that appear while it runs are that group's (Gloo's pairs). A release
    shuts those only: a connection the user's code made after the group (a tracker's,
    a download's, a database's) is left alone."""
    make = getattr(c10d, "_new_process_group_helper", None)
    if make is None or getattr(make, "_notebook_dist_tracked", False):
        return

    def made_with_sockets(*args, **kwargs):
        before = set(_socket_inodes())
        try:
            return make(*args, **kwargs)
        finally:
            found = set(_socket_inodes()) - before
            STATE.extras.setdefault("group_sockets", set()).update(found)

    made_with_sockets._notebook_dist_tracked = True
    made_with_sockets.__wrapped__ = make
    c10d._new_process_group_helper = made_with_sockets
    STATE.extras.setdefault("group_sockets", set())


def _gloo_connects_lazily() -> bool:
    """``TORCH_GLOO_LAZY_INIT``: Gloo connects a group's pairs at its first collective, not
    as the group is made (so they are not among :func:`track_group_sockets`')."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() in ("1", "true", "yes", "y")


def controller_endpoints() -> tuple[set[int], set[str] | None]:
    """The ports of the ipyparallel controller this engine's channels connect to (its
    registration, heartbeat, shell, control and IOPub), and its addresses where the
    engine's connection info names them as IPs (None: not known, any address counts);
    no ports outside an engine."""
    try:
        from ipyparallel.engine.app import IPEngine

        if not IPEngine.initialized():
            return set(), None
        info = IPEngine.instance().connection_info
    except Exception:  # (not an ipyparallel engine, or one without its connection info)
        return set(), None
    import ipaddress

    ports: set[int] = set()
    for value in info.values():
        for port in value if isinstance(value, list) else (value,):
            if isinstance(port, int) and not isinstance(port, bool):
                ports.add(port)
    addresses = set()
    for host in (str(info.get("interface", "")).partition("://")[2], info.get("location")):
        try:
            ip = ipaddress.ip_address(str(host).strip("[]"))
        except ValueError:  # a name, or none: the engine connected to what it resolves to
            continue
        if not ip.is_unspecified:  # ("*" or 0.0.0.0: the engine connected to its location)
            addresses.add(str(ip))
    return ports, addresses or None


def gloo_socket_fds() -> list[int]:
    """This rank's Gloo connections, which a release shuts: its established TCP sockets
    made as its process groups were (:func:`track_group_sockets`), but for the store's, the
    lane's and the controller's. Where the groups' sockets are not known (Gloo connecting
    lazily, or torch without the function that makes groups), those made since the
    default group was."""
    made = STATE.extras.get("group_sockets")
    if made is not None and not _gloo_connects_lazily():
        chosen = made.__contains__
    else:
        keep = STATE.extras.get("preexisting_sockets", set())
        chosen = lambda inode: inode not in keep  # noqa: E731
    master_port = int(os.environ.get("MASTER_PORT", "0"))
    tcp = _tcp_table()
    controller, controller_at = controller_endpoints()
    fds = []
    for inode, fd in _socket_inodes().items():
        if inode not in tcp or not chosen(inode):
            continue
        local_port, remote_port, state, remote = tcp[inode]
        if state != "01":  # ESTABLISHED only; listening sockets are left alone
            continue
        if master_port in (local_port, remote_port):
            continue  # the rendezvous store
        if remote_port in STATE.extras.get("lane_ports", ()):
            continue  # the notebook's lane to this rank (runtime/lane.py)
        if remote_port in controller and (
            controller_at is None or _address(remote) in controller_at
        ):
            continue  # the engine's own channels, even one zmq made again after the group
        fds.append(fd)
    return fds


class CollectiveReleased(RuntimeError):
    """Raised in a rank's main thread once the notebook has released it from an NCCL
    collective that could not complete: the wait it was in returned, but what that
    collective (and what followed it on the GPU) computed is void, so the cell ends here."""

    def __init__(self, *args):
        super().__init__(
            *(
                args
                or (
                    "released from an NCCL collective that could not complete: its results are void",
                )
            )
        )


def release_cell(token: str) -> int | None:
    """Release this rank from its collectives if the cell ``token`` still runs here; None
    when it does not (the request came late). Runs on the agent thread."""
    with _GROUP_LOCK:
        if STATE.cell_state != "running" or STATE.cell_token != token:
            return None
        return abort_collectives()


def abort_collectives() -> int:
    """Release this rank from the collectives it is stuck in: Gloo's connections shut down
    (the blocked call raises), or every NCCL communicator aborted. Runs on the agent thread."""
    if STATE.backend == "nccl":
        return abort_nccl()
    closed = 0
    for fd in gloo_socket_fds():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            s.close()
    STATE.extras["aborted_at"] = time.time()
    return closed


def abort_nccl(timeout_s: float = 5.0) -> int:
    """Abort every NCCL communicator of this rank (torch's ``_abort_process_group``: all
    groups, within one NCCL group call), then end the cell in the main thread.

    The main thread waits on the host for the GPU (``.item()``, ``.cpu()``, a
    synchronize) behind a kernel that waits for a peer; the abort lets that kernel end and
    the wait return, with values that mean nothing, so :class:`CollectiveReleased` is
    raised in the main thread (torchft marks its results void the same way). The abort
    runs on a thread of its own: ``ncclCommAbort`` can block (behind a kernel that is not
    NCCL's), and the agent must go on reporting. Returns how many groups were aborted.
    """
    import threading

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    groups = list(c10d._world.pg_map)
    # kept alive: a group freed now would join its watchdog thread while holding the GIL
    STATE.extras.setdefault("aborted_groups", []).extend(groups)
    done = threading.Event()

    def abort() -> None:
        try:
            c10d._abort_process_group()
        except Exception as exc:  # said by the rebuild, which checks the device
            STATE.extras["abort_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            done.set()

    threading.Thread(target=abort, name="notebook_dist-abort", daemon=True).start()
    if not done.wait(timeout_s):
        STATE.extras["abort_error"] = f"ncclCommAbort did not return within {timeout_s:.0f} s"
    if STATE.cell_state == "running":
        raise_in_main_thread(CollectiveReleased)
    STATE.extras["aborted_at"] = time.time()
    return len(groups)


def raise_in_main_thread(exc_type: type[BaseException]) -> None:
    """Make the main thread raise ``exc_type`` at its next Python instruction (called
    under ``_GROUP_LOCK`` while the cell runs; :func:`cancel_pending_release` undoes it if
    the cell ends first)."""
    import ctypes

    ident = threading.main_thread().ident
    STATE.extras["release_pending"] = True
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))


def cancel_pending_release() -> None:
    """Withdraw an exception :func:`raise_in_main_thread` scheduled that has not landed yet
    (main thread, under ``_GROUP_LOCK``, as the cell ends): it must never land in
    ipykernel's or ipyparallel's code."""
    if not STATE.extras.pop("release_pending", False):
        return
    import ctypes

    ident = threading.main_thread().ident
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)


def cuda_unusable() -> str | None:
    """Why this rank's CUDA context can no longer be used (an illegal memory access left
    by an abort, say), or None when a synchronize and a tiny kernel still work."""
    import torch

    if not STATE.device.startswith("cuda"):
        return None
    try:
        torch.cuda.synchronize(STATE.device)
        if torch.ones(1, device=STATE.device).add_(1).item() != 2:
            return "a test kernel computed a wrong value"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


@contextlib.contextmanager
def _interrupts_ignored():
    """SIGINT ignored in the block (main thread only): a Ctrl-C meant for the cell that was
    just released, arriving late, must not land between destroying the old group and making
    the new one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _rebind(pairs: list[tuple], renamed: dict[str, str] | None) -> int:
    """Whatever held an old group of ``pairs`` (old, new) holds its new one: DDP modules,
    and device meshes when a mesh's groups were made again (``renamed``: their names that
    changed); the heap looked through once for both. Returns how many holders were."""
    from . import group, subgroups

    ddp = sys.modules.get("torch.nn.parallel.distributed")
    mesh = sys.modules.get("torch.distributed.device_mesh") if renamed is not None else None
    modules, meshes = group.instances(
        getattr(ddp, "DistributedDataParallel", None), getattr(mesh, "DeviceMesh", None)
    )
    if renamed is not None:
        subgroups.rename_in_meshes(meshes, renamed)
    return group.rebind_ddp(pairs, modules) + group.rebind_holders(pairs)


def reinit(master_port: int, rendezvous_timeout_s: float | None = None) -> dict:
    """Destroy the (broken) default group and make a fresh one on ``master_port``.

    An NCCL group is aborted rather than destroyed (destroying waits for work a released
    peer will never do), and a CUDA context that an abort left unusable is reported, not
    used: only fresh engines (``%dist_restart``) can have a GPU again. Never raises: what
    went wrong is returned (``error``), for the notebook to try again or say so.
    """
    import torch.distributed as dist

    from . import group, subgroups

    t0 = time.perf_counter()
    rebuild_step("waiting for its cell or a release to end")
    try:
        with _interrupts_ignored(), _GROUP_LOCK:
            rebuild_step("destroying the old group")
            if STATE.backend == "nccl":
                if dist.is_initialized():
                    abort_nccl()
                broken = cuda_unusable()
                if broken:
                    return {"rank": STATE.rank, "cuda_unusable": broken}
            old = group.default_group()
            voided, kept = subgroups.others(), subgroups.alive()
            group.destroy_default_group()
            from .tracker import forget_groups

            forget_groups()
            own = STATE.extras.setdefault("cluster_env", {})
            own["MASTER_PORT"] = str(master_port)
            os.environ.update(own)  # the cluster's own, whatever a cell set
            remember_preexisting_sockets()
            rebuild_step(f"meeting the others on port {master_port} to make the new group")
            mine, renamed = group.init_default_group(
                STATE.backend,
                STATE.rank,
                STATE.world_size,
                STATE.timeout_s or 300,
                STATE.device,
                rendezvous_timeout_s,
                STATE.store_timeout_s,
                then=lambda store: subgroups.remake(kept, store),
            )
            rebuild_step("giving the new groups to what held the old ones")
            rebound = _rebind([(old, group.default_group()), *mine], renamed)
            remade = len(mine)
    except BaseException as exc:  # a Ctrl-C that was pending before the block, too
        said = str(exc).strip().splitlines()
        return {"rank": STATE.rank, "error": f"{type(exc).__name__}: {said[0] if said else ''}"}
    finally:
        rebuild_step(None)
    STATE.group_broken = None
    group.clear_broken_mark()
    took = time.perf_counter() - t0
    lost = max(0, voided - remade)
    said = {"rebound": rebound, "groups_lost": lost, "groups_remade": remade}
    return {"rank": STATE.rank, "reinit_s": took, **said}
