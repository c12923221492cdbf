"""Where an engine runs: its machine, its address towards other hosts, and what its
launcher says of its rank (for clusters whose engines start before they are ranks)."""

from __future__ import annotations

import os
import socket

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
    from .devices import visible_gpus

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


def clock_id() -> str:
    """Identifies one clock: processes on one kernel read one CLOCK_REALTIME, whatever
    container or network namespace they are in. The kernel's boot id; the host name where
    there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def machine_id() -> str:
    """Identifies one machine, and one network namespace on it (each acts as a host)."""
    try:
        return f"{clock_id()}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return clock_id()


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
