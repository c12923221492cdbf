"""What a rank's device is doing: its GPU and CUDA memory (read by the agent, the dashboard
and %dist_status)."""

from __future__ import annotations

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
