"""One sentence at the end of an error that GPU-first code raises on a CPU rank, naming the
line and the change. Code from torchrun scripts assumes a GPU per rank; on CPU ranks
(Gloo) torch's own message does not say what to write instead. Nothing is rewritten or
patched: the code raised as it would anywhere without a GPU, and the hint only explains.

The five patterns: ``.to(rank)``/``.cuda(rank)``, ``DDP(model, device_ids=[rank])``,
``torch.cuda.set_device(...)``, ``torch.accelerator.current_accelerator().type``, and a
GPU count (``rank % torch.cuda.device_count()``).
"""

from __future__ import annotations

import linecache
import re

from .state import STATE

NO_DEVICE = re.compile(
    r"Cannot access accelerator device when none is available|Torch not compiled with CUDA "
    r"enabled|Found no NVIDIA driver|No CUDA GPUs are available|CUDA driver initialization failed"
)
TO_DEVICE = re.compile(r"\.(?:to|cuda)\(\s*([^),]*)")
GPU_WORDS = re.compile(r"\bGPUs?\b|\bCUDA device")


def _cell_line(exc: BaseException) -> tuple[int, str] | None:
    """The innermost cell frame of the traceback: (line, its code)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith("Cell In["):
            text = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            found = (tb.tb_lineno, text)
        tb = tb.tb_next
    return found


def gpu_hint(exc: BaseException) -> str | None:
    """The sentence for ``exc`` raised on a CPU rank by GPU-first code, or None."""
    if not STATE.device.startswith("cpu"):
        return None
    where = _cell_line(exc)
    if where is None:
        return None
    line, code = where
    text = str(exc)
    at = f"at line {line} (`{code}`)"
    if NO_DEVICE.search(text):
        moved = TO_DEVICE.search(code)
        what = f"`{moved.group(1).strip()}`" if moved and moved.group(1).strip() else "the GPU"
        return (
            f"this rank has no GPU (a CPU rank, on Gloo): use `nd.device` in place of {what} "
            f"{at}; nd.device is 'cpu' here and each rank's own GPU on GPU ranks."
        )
    if isinstance(exc, ValueError) and "device_ids" in text and "device_ids" in code:
        return (
            f"this rank has no GPU: leave out device_ids {at} (DDP(model) on CPU ranks); on "
            "GPU ranks, device_ids=[nd.local_rank] with the model on nd.device."
        )
    if isinstance(exc, AttributeError) and "_cuda_setDevice" in text:
        return (
            f"this rank has no GPU: torch.cuda.set_device cannot run {at}; guard it with "
            "`if torch.cuda.is_available():` (the cluster already set each GPU rank's device)."
        )
    if isinstance(exc, AttributeError) and "current_accelerator" in code:
        return (
            f"this rank has no accelerator: torch.accelerator.current_accelerator() is None "
            f"{at}; use nd.device (or torch.device('cpu')) for the device."
        )
    counted = "device_count" in code or ("is_available" in code and "cuda" in code)
    if counted or GPU_WORDS.search(text):  # a GPU check: assert n_gpus >= 2, "needs GPUs"
        return (
            f"this rank has no GPU: torch.cuda.device_count() is 0 (is_available() False) "
            f"{at}; the ranks are nd.world_size CPU processes: use nd.local_rank for the "
            "rank on this machine and nd.device for its device."
        )
    return None
