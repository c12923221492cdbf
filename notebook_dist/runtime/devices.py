"""What a rank's device is doing: its GPU and CUDA memory (read by the agent, the dashboard
and %dist_status)."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from .state import STATE


def gpu_state() -> dict[str, Any] | None:
    """This rank's GPU and its CUDA memory (allocated, reserved by the caching allocator,
    peak allocated), once CUDA has started on it."""
    torch = sys.modules.get("torch")
    if torch is None or not STATE.device.startswith("cuda") or not torch.cuda.is_initialized():
        return None
    device = torch.device(STATE.device)
    name = STATE.extras.get("gpu_name")
    if name is None:
        name = STATE.extras["gpu_name"] = torch.cuda.get_device_name(device)
    return {
        "device": STATE.device,
        "name": name,
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
    }


#: where the NVIDIA driver lists its GPUs, one folder each, and where their device files are
PROC_GPUS = "/proc/driver/nvidia/gpus"
DEV_ROOT = "/dev"


def physical_gpus(proc_root: str = PROC_GPUS, dev_root: str = DEV_ROOT) -> int:
    """How many NVIDIA GPUs this machine shows, without importing torch or starting CUDA.

    The driver's folder per GPU in /proc; where there is none, the ``nvidiaN`` device files
    (a sandbox such as gVisor, or a container, can pass the GPUs' device files through
    without the driver's /proc, and CUDA needs only the device files).
    """
    try:
        return len(os.listdir(proc_root))
    except OSError:
        pass
    try:
        return sum(1 for name in os.listdir(dev_root) if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


def visible_gpus(
    environ: dict[str, str] | None = None,
    proc_root: str = PROC_GPUS,
    dev_root: str = DEV_ROOT,
) -> list[str]:
    """IDs of the NVIDIA GPUs this process may use (:func:`physical_gpus`), without
    importing torch.

    Honours ``CUDA_VISIBLE_DEVICES`` the way CUDA does: a list of ids (or UUIDs),
    stopping at the first invalid entry; empty or ``-1`` hides every GPU.
    """
    environ = os.environ if environ is None else environ
    ids = [str(i) for i in range(physical_gpus(proc_root, dev_root))]
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return ids
    chosen = []
    for item in spec.split(","):
        item = item.strip()
        if item.startswith("GPU-") or item.startswith("MIG-"):
            chosen.append(item)
            continue
        if not item.isdigit() or item not in ids:
            break
        chosen.append(item)
    return chosen
