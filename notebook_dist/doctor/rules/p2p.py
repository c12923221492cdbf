"""Point-to-point: deadlocks (every rank sends, or receives, first), ops that do not
pair (peer, tag), and a peer that is elsewhere."""

from __future__ import annotations

from ..words import cell_line, p2p_text, plural
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
rule = registrar(RULES)


P2P_FIX = (
    "Order the calls by rank parity (even ranks send first, odd ranks receive first), post "
    "the receive before the send (req = dist.irecv(...); dist.send(...); req.wait()), or "
    "issue both at once with dist.batch_isend_irecv([...])."
)


def _involves(p: dict, r: int) -> bool:
    return p.get("peer") in (r, None)


def _matches(mine: dict, me: int, theirs: dict) -> bool:
    return (
        mine["direction"] != theirs["direction"]
        and _involves(theirs, me)
        and mine.get("tag", 0) == theirs.get("tag", 0)
    )


def _unmatched(f: Facts, r: int) -> list[dict]:
    """Rank r's point-to-point ops that no op of their peer can complete."""
    out = []
    for p in f.waits[r].p2p:
        peer = p.get("peer")
        if peer is None or peer not in f.waits or f.waits[peer].kind != "p2p":
            out.append(p)
        elif not any(_matches(p, r, q) for q in f.waits[peer].p2p):
            out.append(p)
    return out


def _p2p_cycle(f: Facts, start: int) -> list[int] | None:
    """Ranks that wait on each other in a ring of sends (or of receives) that can never
    complete: each one's op points at the next, all in the same direction."""
    chain, r = [], start
    direction = None
    while r not in chain:
        if r not in f.waits or f.waits[r].kind != "p2p":
            return None
        ops = _unmatched(f, r)
        if not ops or ops[0].get("peer") is None:
            return None
        if direction is None:
            direction = ops[0]["direction"]
        elif ops[0]["direction"] != direction:
            return None
        chain.append(r)
        r = ops[0]["peer"]
    return chain[chain.index(r) :] if r == start else None


@rule("ND201", "point-to-point deadlock")
def p2p_deadlock(f: Facts) -> Diagnosis | None:
    for r in f.in_kind("p2p"):
        cycle = _p2p_cycle(f, r)
        if not cycle:
            continue
        first = _unmatched(f, cycle[0])[0]
        calls = "; ".join(
            f"rank {q} waits in {p2p_text(_unmatched(f, q)[0])} at {f.p2p_where(q)}" for q in cycle
        )
        two = len(cycle) == 2
        if first["direction"] == "send":
            why = "Each sends before it receives, so " + (
                "neither posts the recv the other needs"
                if two
                else "none posts the recv the next needs"
            )
        else:
            why = "Each receives before it sends, so " + (
                "neither sends what the other waits for"
                if two
                else "none sends what the next waits for"
            )
        return make(
            f,
            "p2p-deadlock",
            f"{cap(plural(cycle))} are in a point-to-point deadlock: {calls}. {why}. {P2P_FIX}",
            cycle,
            cell_line(first, f.cell_file),
        )
    return None


@rule("ND202", "point-to-point ops that do not pair")
def p2p_mismatch(f: Facts) -> Diagnosis | None:
    for r in f.in_kind("p2p"):
        for p in _unmatched(f, r):
            peer = p.get("peer")
            if peer is None or peer not in f.waits or f.waits[peer].kind != "p2p":
                continue
            theirs = f.waits[peer].p2p
            opposite = [q for q in theirs if q["direction"] != p["direction"] and _involves(q, r)]
            mine = f"Rank {r} waits in {p2p_text(p)} at {f.p2p_where(r)}"
            if opposite:
                q = opposite[0]
                return make(
                    f,
                    "p2p-tag",
                    f"{mine}, and rank {peer} waits in {p2p_text(q)} at {f.p2p_where(peer)}: the "
                    f"tags differ ({p.get('tag', 0)} and {q.get('tag', 0)}), so the two never pair. "
                    "Use the same tag on both sides.",
                    [r, peer],
                    cell_line(p, f.cell_file),
                )
            q = theirs[0]
            talks_to = "any rank" if q.get("peer") is None else f"rank {q['peer']}"
            return make(
                f,
                "p2p-peer",
                f"{mine}, but rank {peer} waits in {p2p_text(q)} at {f.p2p_where(peer)}: rank "
                f"{peer} talks to {talks_to}, "
                f"not to rank {r}, so rank {r}'s {p['op']} never pairs. Check the src/dst each "
                "rank computes.",
                [r, peer],
                cell_line(p, f.cell_file),
            )
    return None


@rule("ND203", "a point-to-point peer that is elsewhere")
def p2p_peer_elsewhere(f: Facts) -> Diagnosis | None:
    for r in f.in_kind("p2p"):
        for p in _unmatched(f, r):
            peer = p.get("peer")
            if peer is None or peer not in f.status or peer == r:
                continue
            if peer in f.busy:
                continue  # it may get there yet: the busy rule says so
            counterpart = "sending to it" if p["direction"] == "recv" else "receiving from it"
            where_peer = f.elsewhere(peer)
            if f.status[peer] == "done":
                said = f"rank {peer} finished the cell without {counterpart}"
            else:
                said = f"rank {peer} went on without {counterpart}: it {where_peer}"
            line, cond = f.guarded(p, f.condition)
            guard = (
                f" Line {line} is inside `if {cond[1]}:` (line {cond[0]}), so only some ranks "
                "reach it."
                if cond
                else ""
            )
            fix = (
                f" Make rank {peer} call the matching "
                f"{'send' if p['direction'] == 'recv' else 'recv'} (every send needs its recv), "
                f"or take the {p['op']} out."
            )
            return make(
                f,
                "p2p-missing",
                f"Rank {r} waits in {p2p_text(p)} at {f.p2p_where(r)}, but {said}.{guard}{fix}",
                [peer],
                line,
            )
    return None
