"""Rank side of %dist_compare, %dist_debug and %dist_inspect."""

from __future__ import annotations

import sys
import traceback
from typing import Any

from ..compare import fingerprint, flatten, tensor_diff
from ..values import pack
from .state import STATE, user_namespace

MAX_LOCALS = 40


def evaluate(expr: str) -> list:
    """``pack`` of EXPR evaluated in the rank's namespace (for %dist_inspect)."""
    return pack(eval(compile(expr, "<inspect>", "eval"), user_namespace()))


def _leaves(expr: str) -> dict[str, Any]:
    return flatten(eval(compile(expr, "<compare>", "eval"), user_namespace()))


def fingerprints(expr: str) -> dict[str, Any]:
    """Phase 1 of a comparison: an exact fingerprint of every leaf (no communication)."""
    return {"entries": {name: fingerprint(leaf) for name, leaf in _leaves(expr).items()}}


def diff(
    expr: str, reference: int, wanted: dict[int, list[str]], atol: float, rtol: float
) -> dict[str, Any]:
    """Phase 2: the reference rank sends the leaves that differ to each rank that holds a
    different copy (rank to rank), which diffs them; only the numbers reach the notebook."""
    import torch
    import torch.distributed as dist

    leaves = _leaves(expr)
    device = torch.device(STATE.device) if STATE.backend == "nccl" else torch.device("cpu")
    out: dict[str, Any] = {}
    if STATE.rank == reference:
        for other, names in sorted(wanted.items()):
            for name in names:
                dist.send(leaves[name].detach().to(device).contiguous(), dst=other)
    else:
        for name in wanted.get(STATE.rank, []):
            theirs = torch.empty_like(leaves[name].detach(), device=device)
            dist.recv(theirs, src=reference)
            out[name] = tensor_diff(leaves[name], theirs, atol, rtol)
    return out


def _frames(tb) -> list:
    """Frames of a traceback from the first cell frame inward (innermost last), without
    the tool's own frames."""
    from .tracker import is_tool_frame

    frames = []
    while tb is not None:
        if not is_tool_frame(tb.tb_frame.f_code.co_filename):
            frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    start = next(
        (i for i, (f, _) in enumerate(frames) if f.f_code.co_filename.startswith("Cell In[")), 0
    )
    return frames[start:]


def short_repr(value: Any, limit: int = 100) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the others
        text = f"<repr failed: {type(exc).__name__}>"
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def debug(frame_index: int, expr: str | None) -> dict[str, Any]:
    """The failing frame (``frame_index`` 0) or a caller (1, 2, ...) of the last error."""
    if STATE.last_error is None:
        return {"error": "none"}
    exc, tb = STATE.last_error
    frames = _frames(tb)
    if not frames:
        return {"error": "none"}
    if not 0 <= frame_index < len(frames):
        return {"error": "frame", "count": len(frames)}
    frame, lineno = frames[len(frames) - 1 - frame_index]
    out: dict[str, Any] = {
        "exception": f"{type(exc).__name__}: {exc}",
        "frames": [(f.f_code.co_filename, ln, f.f_code.co_name) for f, ln in frames],
        "index": frame_index,
        "file": frame.f_code.co_filename,
        "line": lineno,
        "func": frame.f_code.co_name,
        "locals": {
            k: short_repr(v)
            for k, v in frame.f_locals.items()
            if not (k.startswith("__") and k.endswith("__"))
            and not (
                frame.f_code.co_name == "<module>"
                and k in ("torch", "dist", "nd", "In", "Out", "exit", "quit", "get_ipython", "open")
            )
        },
    }
    if frame.f_code.co_name == "<module>":  # the cell's namespace: the user's own names only
        out["locals"] = {k: v for k, v in out["locals"].items() if not k.startswith("_")}
    if len(out["locals"]) > MAX_LOCALS:
        out["locals"] = dict(list(out["locals"].items())[-MAX_LOCALS:])
        out["truncated"] = True
    if expr:
        try:
            out["value"] = short_repr(
                eval(compile(expr, "<debug>", "eval"), frame.f_globals, dict(frame.f_locals)), 2000
            )
        except Exception:
            out["value_error"] = traceback.format_exception_only(*sys.exc_info()[:2])[-1].strip()
    return out
