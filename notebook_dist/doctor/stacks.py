"""Reading a rank's Python stack: where in the cell its main thread is, the library call
it is inside, a collective torch issued that shows only in the stack; and every rank's
stack as text, for %dist_stacks and a shown hang."""

from __future__ import annotations

from typing import Any

from ..phrases import alike
from .words import CELL_PREFIX, p2p_text, rank_list, short_file


def stack_line(stack: list[dict] | None, cell_file: str | None) -> tuple[str, int | None]:
    """Where in the cell the main thread is: 'line 5 in crunch (called at line 8)'."""
    if not stack:
        return "?", None

    def at(f):
        return f"line {f['line']}" if f["file"] == cell_file else f"{f['file']}, line {f['line']}"

    cell_frames = [f for f in stack if f["file"].startswith(CELL_PREFIX)]
    inner = stack[-1]
    if not cell_frames:
        return f"{inner['func']} ({inner['file'].rsplit('/', 1)[-1]}:{inner['line']})", None
    innermost, outermost = cell_frames[-1], cell_frames[0]
    text = at(innermost)
    if innermost["func"] != "<module>":
        text += f" in {innermost['func']}"
    if innermost is not outermost:
        text += f" (called at {at(outermost)})"
    if inner is not innermost:
        text += f", now in {inner['func']} ({inner['file'].rsplit('/', 1)[-1]}:{inner['line']})"
    # the running cell's line: a helper from an earlier cell has its line in that cell
    here = [f for f in cell_frames if f["file"] == cell_file] if cell_file else cell_frames
    return text, (here[-1]["line"] if here else None)


def library_call(stack: list[dict] | None) -> dict[str, Any] | None:
    """The library function the cell called, on the way to where the rank is now: the
    first frame outside the cell after its innermost cell frame, with that cell line."""
    if not stack:
        return None
    last_cell = max(
        (i for i, f in enumerate(stack) if f["file"].startswith(CELL_PREFIX)), default=None
    )
    if last_cell is None or last_cell + 1 >= len(stack):
        return None
    called = stack[last_cell + 1]
    cell = stack[last_cell]
    return {
        "func": called["func"],
        "file": short_file(called["file"]),
        "line": cell["line"],
        "code": cell.get("code", ""),
    }


#: torch's op dispatch: a thread blocked in a torch op shows these frames innermost
_DISPATCH = ("/torch/_ops.py", "/torch/_library/", "/torch/utils/_python_dispatch.py")


#: the functions of torch.distributed code that wait for a collective it issued
_WAITS = ("wait_tensor", "wait")


def collective_in_stack(stack: list[dict] | None) -> dict[str, Any] | None:
    """A collective torch issued itself, seen in the main thread's stack, for when the Flight
    Recorder cannot say (torch before 2.8 records no Gloo collective; TORCH_FR_BUFFER_SIZE=0
    turns it off): below the cell's call, the innermost frame outside torch's op dispatch
    is torch.distributed code waiting for one (a functional collective's ``wait_tensor``,
    as DTensor and FSDP2 use), or a c10d call the tracker did not see. ``op`` is that
    call's name, or empty where only the wait is on the stack."""
    if not stack:
        return None
    last_cell = max(
        (i for i, f in enumerate(stack) if f["file"].startswith(CELL_PREFIX)), default=None
    )
    if last_cell is None:
        return None
    inner = stack[last_cell + 1 :]
    while inner and any(part in inner[-1]["file"] for part in _DISPATCH):
        inner = inner[:-1]
    if not inner or "/torch/distributed/" not in inner[-1]["file"]:
        return None
    top = inner[-1]
    if top["func"] in _WAITS:
        return {"op": ""}
    if top["file"].endswith("/distributed_c10d.py"):
        return {"op": top["func"].lstrip("_")}
    return None


def in_backward(stack: list[dict] | None) -> bool:
    return bool(stack) and any(
        f["func"] in ("backward", "_engine_run_backward", "run_backward") for f in stack
    )


def format_stacks(snaps: dict[int, dict], cell_file: str | None = None) -> str:
    """Every rank's main-thread stack, innermost last, cell frames as cell lines. Ranks whose
    stacks read the same are shown once under all their numbers ('ranks 0-4, 6-15: in
    all_reduce #1'): at 32 ranks a hang is a few stacks, not 32 copies of one."""
    same = alike(sorted(snaps), key=lambda r: _stack_text(snaps[r] or {}, cell_file))
    return "\n".join(rank_list(ranks) + text for text, ranks in same.items())


def _file(path: str) -> str:
    """A frame's file as a stack shows it: an installed package's from the package
    (torch/distributed/distributed_c10d.py), any other whole."""
    short = short_file(path)
    return short if "/" in short else path


#: what a rank whose report has no stack is doing, by its cell's state
_ENDED = {
    "done": "finished the cell",
    "error": "ended the cell with an error",
    "idle": "idle, no cell running",
}


def _stack_text(snap: dict, cell_file: str | None) -> str:
    """One rank's stack as :func:`format_stacks` shows it, after the rank's number."""
    stack = snap.get("stack") or []
    coll = snap.get("collective")
    out = [""]
    if coll and coll.get("kind") == "p2p":
        out[0] = f": in {p2p_text(coll)}"
    elif coll:
        out[0] = f": in {coll['op']} #{coll['seq']}"
    elif snap.get("p2p_pending"):
        out[0] = ": waiting on " + ", ".join(p2p_text(p) for p in snap["p2p_pending"][:3])
    ended = _ENDED.get(snap.get("cell_state"))
    if not stack and ended:  # (its final report, or one while no cell runs: no stack)
        out[0] = out[0] or f": {ended}"
    elif not stack:
        out.append("  (no stack reported)")
    for f in stack:
        if not f.get("file"):  # frames left out of a deep stack
            out.append(f"  {f['func']}")
            continue
        where = (
            f"line {f['line']}"
            if f["file"] == cell_file
            else f"{_file(f['file'])}, line {f['line']}"
        )
        out.append(f"  {where}, in {f['func']}")
        if f.get("code"):
            out.append(f"    {f['code']}")
    return "\n".join(out)
