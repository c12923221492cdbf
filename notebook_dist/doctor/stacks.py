"""Every rank's stack as text: what %dist_stacks and a shown hang print."""

from __future__ import annotations

from .facts import p2p_text


def format_stacks(snaps: dict[int, dict], cell_file: str | None = None) -> str:
    """Every rank's main-thread stack, innermost last, cell frames as cell lines."""
    out = []
    for r in sorted(snaps):
        snap = snaps[r] or {}
        stack = snap.get("stack") or []
        coll = snap.get("collective")
        head = f"rank {r}"
        if coll and coll.get("kind") == "p2p":
            head += f": in {p2p_text(coll)}"
        elif coll:
            head += f": in {coll['op']} #{coll['seq']}"
        elif snap.get("p2p_pending"):
            head += ": waiting on " + ", ".join(p2p_text(p) for p in snap["p2p_pending"][:3])
        out.append(head)
        if not stack:
            out.append("  (no stack reported)")
        for f in stack:
            if not f.get("file"):  # frames left out of a deep stack
                out.append(f"  {f['func']}")
                continue
            where = (
                f"line {f['line']}" if f["file"] == cell_file else f"{f['file']}, line {f['line']}"
            )
            out.append(f"  {where}, in {f['func']}")
            if f.get("code"):
                out.append(f"    {f['code']}")
    return "\n".join(out)
