"""How the doctor writes what it found: places in the notebook (never two cells' lines as
one bare "line N"), shapes, point-to-point ops, ranks. Pure text; no facts are read here."""

from __future__ import annotations

from typing import Any

from ..phrases import each_rank, of_many, rank_list  # noqa: F401 (the rules' words too)

CELL_PREFIX = "Cell In["


def where_text(rec_where: Any, cell_file: str | None) -> str:
    if not rec_where:
        return "?"
    filename, line = rec_where
    return f"line {line}" if filename == cell_file else f"{filename}, line {line}"


def thread_of(rec: dict) -> str:
    """' (in thread 'saver')' for a collective another thread issued, else ''."""
    return f" (in thread {rec['thread']!r})" if rec.get("thread") else ""


def line_of(rec_where: Any) -> int | None:
    return rec_where[1] if rec_where else None


def call_text(rec: dict, cell_file: str | None) -> str:
    """Where an op was called, never two places as one bare "line N": 'line 4', 'line 4 in
    step() (called at line 9)', or for a helper from an earlier cell 'line 4 of evaluate()
    in Cell In[6], called at line 3'."""
    where, site, func = rec.get("where"), rec.get("site"), rec.get("func")
    if not where:
        return "?"
    if where[0] == cell_file:
        text = f"line {where[1]}"
        if func:
            text += f" in {func}()"
            if site:
                text += f" (called at line {site[1]})"
        return text
    inside = f" of {func}() in {where[0]}" if func else f" of {where[0]}"
    text = f"line {where[1]}{inside}"
    if site and site[0] == cell_file:
        text += f", called from line {site[1]} of this cell"
    return text


def cell_line(rec: dict, cell_file: str | None) -> int | None:
    """The running cell's line of an op: its own line, or the line that called the helper
    it is in (a helper from an earlier cell has no line in this cell of its own)."""
    where, site = rec.get("where"), rec.get("site")
    if where and where[0] == cell_file:
        return where[1]
    if site and (cell_file is None or site[0] == cell_file):
        return site[1]
    return None if cell_file is not None or not where else where[1]


def shape_text(shapes: list) -> str:
    if not shapes:
        return ""
    return ", ".join(
        str(tuple(s))
        if not isinstance(s, list)
        else "[" + ", ".join(str(tuple(x)) for x in s) + "]"
        for s in shapes
    )


plural = rank_list  # the doctor's name for the package's one way of writing ranks


def verb(ranks: list[int], singular: str, plural_form: str) -> str:
    return singular if len(ranks) == 1 else plural_form


def short_file(path: str) -> str:
    """torch/distributed/tensor/_api.py rather than the whole site-packages path."""
    for anchor in ("/site-packages/", "/dist-packages/"):
        if anchor in path:
            return path.split(anchor, 1)[1]
    return path.rsplit("/", 1)[-1]


def p2p_text(p: dict) -> str:
    """'send to rank 1', 'recv from rank 0 (tag 3)', 'irecv from any rank'."""
    peer = "any rank" if p.get("peer") is None else f"rank {p['peer']}"
    prep = "to" if p["direction"] == "send" else "from"
    tag = f" (tag {p['tag']})" if p.get("tag") else ""
    return f"{p['op']} {prep} {peer}{tag}"


def gpu_text(gpu: dict) -> str:
    """'NCCL all_reduce #3 in flight' or 'a kernel still running'."""
    nccl = gpu.get("nccl")
    if nccl:
        seq = f" #{nccl['seq']}" if nccl.get("seq") is not None else ""
        return f"NCCL {nccl['op']}{seq} in flight"
    return "a kernel still running"


def internal_op(rec: dict[str, Any]) -> str:
    """The name of a collective torch issued: 'all_gather', or 'a collective' where only its
    wait was seen."""
    return rec.get("op") or "a collective"
