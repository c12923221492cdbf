"""Every collective's arguments compared across the group before it runs, when asked
(``%%distributed --check-collectives``, ``DistConfig.check_collectives``).

What ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for DDP, for any collective a cell calls: the
ranks first all-gather a small description of the call (the op, the dtypes, the shapes
where they must agree, the root and the reduce op), and if any rank's differs, every rank
raises :class:`CollectiveMismatch`, naming each rank's arguments, and the collective is
not issued. A mismatch that Gloo answers by aborting a rank (dtypes or shapes), or that
would silently give wrong numbers (a reduce op), becomes an error with every rank alive
and its variables kept. The price is one all_gather of ``SIZE`` bytes per collective
(measured in ``benchmarks/cases.py``, ``check_collectives``).

A rank that never calls the collective never joins the check either: the others wait in
it as they would have in the collective, and the doctor says so.
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: bytes of one rank's description (longer ones are cut: shapes of long lists)
SIZE = 512
#: collectives whose tensors must have the same shape on every rank (others may differ:
#: all_to_all splits, gather/scatter lists, uneven all_gather on NCCL, objects)
SHAPED = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
#: the fields compared, in the order a difference is named
FIELDS = ("op", "dtypes", "shapes", "src", "dst", "reduce_op")


class CollectiveMismatch(RuntimeError):
    """The ranks called one collective with arguments that differ; it was not issued."""


def describe(rec: dict[str, Any]) -> dict[str, Any]:
    """What must agree across ranks for the tracked collective ``rec``."""
    out: dict[str, Any] = {"op": rec["op"], "dtypes": list(rec.get("dtypes") or [])}
    if rec["op"] in SHAPED:
        out["shapes"] = [list(s) if isinstance(s, tuple) else s for s in rec.get("shapes") or []]
    out.update({k: v for k, v in (rec.get("args") or {}).items() if k != "async_op"})
    return out


def check(rec: dict[str, Any], group: Any, device: str) -> None:
    """All-gather ``rec``'s description over ``group`` (torch's own all_gather, untracked);
    raise :class:`CollectiveMismatch` on every rank if they differ."""
    torch = sys.modules["torch"]
    dist = sys.modules["torch.distributed"]
    mine = json.dumps(describe(rec), separators=(",", ":")).encode()[:SIZE]
    dev = device if device.startswith("cuda") else "cpu"
    buf = torch.zeros(SIZE, dtype=torch.uint8, device=dev)
    buf[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8, device=dev)
    size = dist.get_world_size(group)
    outs = [torch.empty_like(buf) for _ in range(size)]
    gather = getattr(dist.all_gather, "_notebook_dist_original", dist.all_gather)
    gather(outs, buf, group=group)
    seen = [bytes(o.cpu().tolist()).rstrip(b"\0") for o in outs]
    if len(set(seen)) == 1:
        return
    ranks = rec.get("group_ranks") or list(range(size))
    descs = {int(r): _load(s) for r, s in zip(ranks, seen)}
    raise CollectiveMismatch(mismatch_text(rec, descs))


def _load(raw: bytes) -> dict[str, Any]:
    try:
        return json.loads(raw.decode())
    except ValueError:  # cut at SIZE
        return {"op": "?", "cut": raw.decode(errors="replace")}


def mismatch_text(rec: dict[str, Any], descs: dict[int, dict[str, Any]]) -> str:
    """'all_reduce #1 at line 3 was not issued: the ranks pass different dtypes (rank 0:
    float32; rank 1: float64). Every rank must pass the same dtypes ...'."""
    where = rec.get("where")
    at = f" at line {where[1]}" if where else ""
    fields = [k for k in FIELDS if len({json.dumps(d.get(k)) for d in descs.values()}) > 1]
    name = fields[0] if fields else "arguments"
    shown = {"reduce_op": "op"}.get(name, name)

    def value(d: dict) -> str:
        v = d.get(name)
        if name == "shapes":
            return ", ".join(str(tuple(s)) if isinstance(s, list) else str(s) for s in v or [])
        if name == "dtypes":
            return "/".join(v or [])
        return f"{shown}={v}" if name in ("src", "dst", "reduce_op") else str(v)

    each = "; ".join(f"rank {r}: {value(d)}" for r, d in sorted(descs.items()))
    return (
        f"{rec['op']} #{rec.get('seq', '?')}{at} was not issued: the ranks pass different "
        f"{shown} ({each}). Every rank must pass the same {shown} to one collective "
        "(--check-collectives compared them first; every rank kept its variables)."
    )
