"""Make an engine a torch.distributed rank: environment, device, process group.

Runs once per engine through ``apply``; everything it needs arrives as arguments.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

from . import group, witness
from .state import EXIT_NOTE, STATE, rank_file, user_namespace


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
    flight_recorder_entries: int | None = None,
    store_timeout_s: float | None = None,
    alone: bool = False,
    scheduling: str = "normal",
) -> dict:
    """Set torchrun's environment, pin the device, and initialise the default group.

    ``overrides`` are interactive-safe settings; a user-set value that differs is
    replaced and reported back, so the notebook can say so. ``alone``: a stand-in for a
    dead rank joins a group of its own first (``runtime.heal``); the real one is made
    with the survivors afterwards. ``scheduling``: ``"batch"`` runs the rank's threads
    under Linux's SCHED_BATCH (``DistConfig.rank_scheduling``), before the group makes
    its own threads, which take the policy of the thread that makes them.
    """
    t0 = time.perf_counter()
    overridden = _set_environment(env, overrides)
    scheduled = schedule(scheduling)

    import torch
    import torch.distributed as dist

    t_import = time.perf_counter() - t0
    if flight_recorder_entries is not None:  # read when the first process group is made
        flight_recorder_env(flight_recorder_entries, torch.__version__)
    rank = int(env["RANK"])
    world_size = int(env["WORLD_SIZE"])
    _join_group(dist, torch, backend, rank, world_size, timeout_s, device, store_timeout_s, alone)
    STATE.rank = rank
    STATE.world_size = world_size
    STATE.local_rank = int(env["LOCAL_RANK"])
    STATE.device = device
    STATE.backend = backend
    STATE.timeout_s = timeout_s
    STATE.store_timeout_s = store_timeout_s
    STATE.extras["cluster_env"] = {k: env[k] for k in group.CLUSTER_ENV if k in env}
    STATE.extras["control_file"] = control_file
    group.clear_broken_mark()  # a rank this engine replaces may have left one
    STATE.bootstrapped = True
    _start_agent(control_file, publish_interval)
    if control_file:
        folder, pid = os.path.dirname(control_file), os.getpid()
        _enable_fault_report(rank_file(folder, "fault", rank, pid))
        from .tracker import TRACKER, open_blackbox

        TRACKER.blackbox = open_blackbox(rank_file(folder, "record", rank, pid))
    _prepare_namespace(torch, dist)
    from ..signals import start_time
    from .host import machine_id

    return {
        "rank": rank,
        "host": socket.gethostname(),
        "machine": machine_id(),
        "pid": os.getpid(),
        "start": start_time(os.getpid()),  # with the pid: this very process, for signalling
        "device": device,
        # plain strings: torch's own str types would make the notebook import torch to
        # read this reply (a second on the path to the first cell, measured)
        "backend": str(dist.get_backend()),
        "torch": str(torch.__version__),
        "cuda_devices": torch.cuda.device_count() if device.startswith("cuda") else 0,
        "import_s": t_import,
        "init_s": time.perf_counter() - t0,
        "overridden": overridden,
        "scheduling": scheduled,
    }


def schedule(policy: str) -> str:
    """Every thread of this process under Linux's ``SCHED_BATCH`` when ``policy`` is
    ``"batch"``, and back under the normal policy when it was made batch here and
    ``policy`` is ``"normal"`` (a policy the user gave the engine is left as it is);
    returns the policy it runs under (``"normal"`` where the system has no such policy, or
    refuses it). Threads made later take their maker's policy."""
    batch = policy == "batch"
    if not hasattr(os, "SCHED_BATCH") or batch == _BATCHED[0]:
        return "batch" if _BATCHED[0] else "normal"
    how, param = (os.SCHED_BATCH if batch else os.SCHED_OTHER), os.sched_param(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), how, param)
            _BATCHED[0] = batch
        except OSError:  # (a thread that ended meanwhile)
            pass
    return "batch" if _BATCHED[0] else "normal"


#: [whether this process's threads were made SCHED_BATCH here]
_BATCHED = [False]


def _set_environment(env: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """torchrun's variables and the interactive-safe settings; returns the user's values
    that differ (the engines started with the settings already: a host's own may not)."""
    overridden = {}
    for key, value in overrides.items():
        old = os.environ.get(key)
        if old is not None and old != value:
            overridden[key] = old
        os.environ[key] = value
    os.environ.update(env)  # before CUDA initialises: CUDA_VISIBLE_DEVICES must be in place
    return overridden


def _join_group(
    dist, torch, backend, rank, world_size, timeout_s, device, store_timeout_s, alone=False
) -> None:
    """The device pinned, the guards and the tracker installed, the default group made."""
    from . import recover, subgroups, tracker

    if device.startswith("cuda"):
        torch.cuda.set_device(int(device.split(":")[1]))
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL: use --backend gloo")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    group.install_guards(dist)
    recover.track_group_sockets(dist.distributed_c10d)
    subgroups.install(dist)
    from . import debugger, launch, streams

    launch.install()
    debugger.install()
    streams.adopt_streams()
    streams.keep_in_order()
    streams.logging_follows_streams()
    streams.forward_display_updates()
    present_as_script()
    tracker.install(dist)
    tracker.TRACKER.device = device
    group.destroy_default_group()
    recover.remember_preexisting_sockets()
    if alone:
        from .heal import join_alone

        join_alone(rank, world_size)
        return
    group.init_default_group(
        backend, rank, world_size, timeout_s, device, store_timeout_s=store_timeout_s
    )


def _prepare_namespace(torch, dist) -> None:
    """torch, dist and nd in the cells' namespace; exit() ends the cell, not the rank."""
    from .exits import install as script_exits

    ns = user_namespace()
    ns.setdefault("torch", torch)
    ns.setdefault("dist", dist)
    ns.setdefault("nd", sys.modules[__package__.partition(".")[0]])  # the package (imported)
    script_exits(ns)


def flight_recorder_env(entries: int, torch_version, environ=None) -> None:
    """Keep ``entries`` collectives in torch's Flight Recorder where the user chose nothing
    (torch 2.8-2.10 keep none by default). NCCL before torch 2.8 reads only the old name,
    which newer torch warns about, so the old name is set on older torch only."""
    environ = os.environ if environ is None else environ
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    if any(name in environ for name in names):
        return
    environ[names[0]] = str(entries)
    if torch_version < "2.8":  # torch's TorchVersion compares with a version string
        environ[names[1]] = str(entries)


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
    witness.tell(path)  # (where the rank has one: it writes the exit status there)
    if old is not None:
        old.close()
    if not hasattr(os._exit, "__wrapped__"):
        real_exit = os._exit

        def _exit(code: int) -> None:
            """os._exit from a cell: leave its code and its stack in the fault file first,
            so the notebook can say at which line the rank ended itself, and with which
            code (on another host it cannot see the exit status)."""
            with contextlib.suppress(Exception):
                f = STATE.extras["fault_file"]
                f.write(f"{EXIT_NOTE}{int(code)}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=False)
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
    info["last_exit"] = STATE.last_exit
    info["gpu"] = gpu_state()
    if info["initialized"]:
        info["backend"] = dist.get_backend()
        info["rank"] = dist.get_rank()
        info["world_size"] = dist.get_world_size()
    return info


def detach() -> None:
    """Stop being a rank and leave the engine running (it belongs to someone else)."""
    agent = STATE.extras.pop("agent", None)
    if agent is not None:
        agent.stopped.set()
    import torch.distributed as dist

    if dist.is_available():
        group.destroy_default_group()
    from .lane import disconnect

    disconnect()  # (the notebook's lane is closing: nothing would answer on it)
    STATE.bootstrapped = False
