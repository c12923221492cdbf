"""The profile's one merged Chrome trace: a process per rank, on the kernel's clock."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any


def trace_events(
    profiles: dict[int, dict[str, Any]], shift: dict[int, int], t0: int
) -> list[dict[str, Any]]:
    """Every rank's events (torch.profiler's and the collectives'), on one clock (pure)."""
    events: list[dict[str, Any]] = []
    tids = {"main": 0, "collectives": 1, "gpu": 2}
    for r, p in sorted(profiles.items()):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for lane, tid in tids.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}}
            )
        for e in p["trace"]:
            events.append(
                {
                    "name": e["name"],
                    "ph": "X",
                    "pid": r,
                    "tid": tids.get(e["lane"], 0),
                    "ts": (e["start"] - shift[r] - t0) / 1e3,
                    "dur": max(0, e["end"] - e["start"]) / 1e3,
                }
            )
        for c in p["collectives"]:
            events.append(
                {
                    "name": f"{c['op']} #{c['seq']} ({c['group']})",
                    "ph": "X",
                    "pid": r,
                    "tid": 3,
                    "ts": (c["arrive"] - shift[r] - t0) / 1e3,
                    "dur": max(0, c["end"] - c["arrive"]) / 1e3,
                    "args": {"bytes": c["bytes"], "line": c.get("line")},
                }
            )
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": r,
                "tid": 3,
                "args": {"name": "arrival to completion"},
            }
        )
    return events


def save_trace(events: list[dict[str, Any]], cell: str, folder: str | None = None) -> str:
    """Write ``events`` as one Chrome trace file (JSON); its path."""
    folder = folder or os.path.join(tempfile.gettempdir(), f"notebook_dist-profiles-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    name = "".join(ch if ch.isalnum() else "-" for ch in cell).strip("-") or "cell"
    path = os.path.join(folder, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
