"""Make an engine a torch.distributed rank: environment, device, process group.

Runs once per engine through ``apply``; everything it needs arrives as arguments.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from .state import STATE

_original_init = None


def user_namespace() -> dict:
    """The namespace cells run in: the engine shell's, or ``__main__``'s outside one."""
    try:
        from IPython import get_ipython  # core only, no display code

        ip = get_ipython()
    except ImportError:
        ip = None
    if ip is not None:
        return ip.user_ns
    import __main__

    return __main__.__dict__


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
    return _original_init(*args, **kwargs)


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


_originals: dict[str, Any] = {}


def _install_init_guard(dist_module) -> None:
    global _original_init
    c10d = dist_module.distributed_c10d
    if _original_init is None:
        _original_init = c10d.init_process_group
        _originals["destroy"] = c10d.destroy_process_group
    for module in (dist_module, c10d):
        module.init_process_group = _guarded_init_process_group
        module.destroy_process_group = _guarded_destroy_process_group


def original_init_process_group():
    """torch's own ``init_process_group`` (ours skips a second init)."""
    if _original_init is None:
        import torch.distributed as dist

        return dist.init_process_group
    return _original_init


def destroy_default_group() -> None:
    """torch's own ``destroy_process_group`` of the default group (ours leaves it alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        _originals.get("destroy", dist.destroy_process_group)()


def present_as_script() -> None:
    """Frameworks decide whether they run in an interactive prompt from ``sys.ps1``
    (Lightning refuses ``strategy="ddp"`` there, when it is imported), and a rank is not
    one: its cells come from the notebook, like a torchrun worker's script. IPython sets
    ``sys.ps1`` once and reads it nowhere else (display, tracebacks and input work
    without it)."""
    if hasattr(sys, "ps1"):
        STATE.extras["ps1"] = sys.ps1
        del sys.ps1
    if hasattr(sys, "ps2"):
        del sys.ps2


def bootstrap(
    env: dict[str, str],
    device: str,
    backend: str,
    timeout_s: float,
    overrides: dict[str, str],
    control_file: str | None = None,
    publish_interval: float = 0.5,
) -> dict:
    """Set torchrun's environment, pin the device, and initialise the default group.

    ``overrides`` are interactive-safe settings; a user-set value that differs is
    replaced and reported back, so the notebook can say so.
    """
    t0 = time.perf_counter()
    overridden = {}
    for key, value in overrides.items():
        old = os.environ.get(key)
        if old is not None and old != value:
            overridden[key] = old
        os.environ[key] = value
    os.environ.update(env)  # before CUDA initialises: CUDA_VISIBLE_DEVICES must be in place

    import torch
    import torch.distributed as dist

    t_import = time.perf_counter() - t0
    rank = int(env["RANK"])
    world_size = int(env["WORLD_SIZE"])
    if device.startswith("cuda"):
        torch.cuda.set_device(int(device.split(":")[1]))
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL: use --backend gloo")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    _install_init_guard(dist)
    present_as_script()
    from . import recover, tracker

    tracker.install(dist)
    destroy_default_group()
    recover.remember_preexisting_sockets()
    init_default_group(backend, rank, world_size, timeout_s, device)

    STATE.rank = rank
    STATE.world_size = world_size
    STATE.local_rank = int(env["LOCAL_RANK"])
    STATE.device = device
    STATE.backend = backend
    STATE.timeout_s = timeout_s
    STATE.bootstrapped = True
    _start_agent(control_file, publish_interval)
    if control_file:
        _enable_fault_report(control_file.replace("release-rank-", "fault-rank-"))

    import notebook_dist

    ns = user_namespace()
    ns.setdefault("torch", torch)
    ns.setdefault("dist", dist)
    ns.setdefault("nd", notebook_dist)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "machine": machine_id(),
        "pid": os.getpid(),
        "device": device,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if device.startswith("cuda") else 0,
        "import_s": t_import,
        "init_s": time.perf_counter() - t0,
        "overridden": overridden,
    }


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

    kwargs: dict[str, Any] = dict(
        backend=backend,
        store=rendezvous_store(rank, world_size, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    original_init_process_group()(**kwargs)


def _enable_fault_report(path: str) -> None:
    """On a fatal signal (Gloo's abort, a segfault) Python writes every thread's stack
    here, so the notebook can say at which cell line the rank died. Costs nothing until then."""
    import faulthandler

    old = STATE.extras.get("fault_file")
    # on another host without the notebook's filesystem the folder is made there (and
    # removed at shutdown by the ssh launcher)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    f = open(path, "w")  # noqa: SIM115 - must stay open for the life of the process
    faulthandler.enable(file=f, all_threads=True)
    STATE.extras["fault_file"] = f
    if old is not None:
        old.close()
    if not hasattr(os._exit, "__wrapped__"):
        real_exit = os._exit

        def _exit(code: int) -> None:
            """os._exit from a cell: leave its stack in the fault file first, so the
            notebook can say at which line the rank ended itself."""
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=STATE.extras["fault_file"], all_threads=False)
            real_exit(code)

        _exit.__wrapped__ = real_exit
        os._exit = _exit


def _start_agent(control_file: str | None, interval: float) -> None:
    from .agent import Agent

    old = STATE.extras.get("agent")
    if old is not None:
        old.stopped.set()
    agent = STATE.extras["agent"] = Agent(control_file, interval)
    agent.start()


def exit_now() -> None:
    """End this rank's process at once (the cluster is shutting down)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    getattr(os._exit, "__wrapped__", os._exit)(0)


def health() -> dict:
    """What ``%dist_status`` shows of a rank's process group."""
    import torch.distributed as dist

    from .devices import gpu_state

    info = {"pid": os.getpid(), "initialized": dist.is_available() and dist.is_initialized()}
    info["gpu"] = gpu_state()
    if info["initialized"]:
        info["backend"] = dist.get_backend()
        info["rank"] = dist.get_rank()
        info["world_size"] = dist.get_world_size()
    return info


# launcher variables that give an engine's rank in its job (MPI, Slurm)
LAUNCHER_RANK_VARS = (
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "NOTEBOOK_DIST_LAUNCH_RANK",  # --launcher ssh: the engine's place in --hosts
)


def probe() -> dict:
    """Where this engine runs, before it is a rank (for clusters notebook_dist attaches to)."""
    from ..plan import visible_gpus

    launcher_rank = next((int(os.environ[k]) for k in LAUNCHER_RANK_VARS if k in os.environ), None)
    ip = outgoing_ip()
    return {
        "host": socket.gethostname(),
        "machine": machine_id(),
        "ip": ip,
        "iface": interface_of(ip),
        "pid": os.getpid(),
        "launcher_rank": launcher_rank,
        "gpus": visible_gpus(),
    }


def machine_id() -> str:
    """Identifies one machine, and one network namespace on it (each acts as a host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def outgoing_ip() -> str:
    """The address other hosts reach this one at: the source address of the default route
    (no packet is sent); 127.0.0.1 when there is no route off the machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (Gloo is told to use it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def detach() -> None:
    """Stop being a rank and leave the engine running (it belongs to someone else)."""
    agent = STATE.extras.pop("agent", None)
    if agent is not None:
        agent.stopped.set()
    import torch.distributed as dist

    if dist.is_available():
        destroy_default_group()
    STATE.bootstrapped = False
