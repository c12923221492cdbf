"""Comparing values across ranks: flatten to named leaves, then diff leaf by leaf.

Pure functions used on both sides: on the ranks (where large tensors are compared
against the reference rank's copy, sent rank to rank, so only a summary reaches the
notebook) and in the notebook (``RankValues.compare()`` on values already there).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from typing import Any

from .phrases import rank_list


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """name -> leaf for modules (their state_dict), optimizers, dicts, lists and tuples."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.nn.Module):
            return flatten(obj.state_dict(), prefix)
        if isinstance(obj, torch.optim.Optimizer):
            return flatten(obj.state_dict(), prefix)
        if isinstance(obj, torch.Tensor):
            return {prefix or "value": obj}
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]" if prefix else f"[{i}]"))
        return out
    return {prefix or "value": obj}


def fingerprint(leaf: Any) -> dict[str, Any]:
    """A small, exact summary: shape, dtype and a hash of the bytes (or of the repr)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        digest = hashlib.blake2b(
            t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"", digest_size=16
        ).hexdigest()
        return {
            "kind": "tensor",
            "shape": tuple(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "hash": digest,
            "numel": t.numel(),
        }
    text = repr(leaf)
    return {
        "kind": "object",
        "repr": text[:80],
        "hash": hashlib.blake2b(text.encode(), digest_size=16).hexdigest(),
    }


def tensor_diff(a, b, atol: float, rtol: float) -> dict[str, float | bool]:
    """Max absolute and relative difference of two same-shape tensors, and allclose."""
    import torch

    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "close": True}
    d = (a - b).abs()
    rel = d / b.abs().clamp_min(1e-12)
    return {
        "max_abs": float(d.max()),
        "max_rel": float(rel.max()),
        "close": bool(torch.allclose(a, b, atol=atol, rtol=rtol)),
    }


@dataclass
class Difference:
    name: str
    ranks: list[int]
    what: str  # "values", "shape", "dtype", "missing", "object"
    max_abs: float | None = None
    max_rel: float | None = None
    detail: str = ""


@dataclass
class Comparison:
    """What differs across ranks; ``agree`` when nothing does (within tolerance)."""

    reference: int
    ranks: list[int]
    num_entries: int
    num_values: int
    differences: list[Difference] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def agree(self) -> bool:
        return not self.differences

    def __bool__(self) -> bool:
        return self.agree

    def text(self) -> str:
        tol = (
            f" (atol={self.atol:g}, rtol={self.rtol:g})" if self.atol or self.rtol else " (exactly)"
        )
        if self.agree:
            return f"all {len(self.ranks)} ranks agree{tol}: {self.num_entries} entries, {self.num_values:,} values"
        lines = [
            f"{len(self.differences)} of {self.num_entries} entries differ from rank {self.reference}{tol}:"
        ]
        w = max(len(d.name) for d in self.differences)
        for d in self.differences:
            ranks = rank_list(d.ranks)
            if d.what == "values":
                lines.append(
                    f"  {d.name.ljust(w)}  {ranks}: max abs diff {d.max_abs:.3g}, max rel diff {d.max_rel:.3g}"
                )
            else:
                lines.append(f"  {d.name.ljust(w)}  {ranks}: {d.what} differs {d.detail}".rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()


def merge(
    reports: dict[int, dict[str, Any]], reference: int, atol: float, rtol: float
) -> Comparison:
    """Fold per-rank reports (name -> fingerprint plus optional diff vs the reference)."""
    ref = reports[reference]["entries"]
    names = sorted(set().union(*(r["entries"] for r in reports.values())))
    diffs: dict[tuple[str, str], Difference] = {}
    num_values = sum(e.get("numel", 1) for e in ref.values())
    for rank, report in sorted(reports.items()):
        if rank == reference:
            continue
        mine = report["entries"]
        for name in names:
            a, b = ref.get(name), mine.get(name)
            key = None
            if a is None or b is None:
                key, what, detail = (
                    (name, "missing"),
                    "missing",
                    f"(only on rank {reference if b is None else rank})",
                )
            elif a["hash"] == b["hash"]:
                continue
            elif a["kind"] != b["kind"] or a["kind"] == "object":
                key, what, detail = (
                    (name, "object"),
                    "object",
                    f"({a.get('repr', a['kind'])!s} vs {b.get('repr', b['kind'])!s})",
                )
            elif a["shape"] != b["shape"]:
                key, what, detail = (name, "shape"), "shape", f"({a['shape']} vs {b['shape']})"
            elif a["dtype"] != b["dtype"]:
                key, what, detail = (name, "dtype"), "dtype", f"({a['dtype']} vs {b['dtype']})"
            else:
                d = b.get("diff")
                if d is not None and d["close"] and (atol or rtol):
                    continue  # within tolerance
                key, what, detail = (name, "values"), "values", ""
            diff = diffs.setdefault(key, Difference(name, [], what, detail=detail))
            diff.ranks.append(rank)
            if what == "values" and b.get("diff"):
                diff.max_abs = max(diff.max_abs or 0.0, b["diff"]["max_abs"])
                diff.max_rel = max(diff.max_rel or 0.0, b["diff"]["max_rel"])
    return Comparison(
        reference, sorted(reports), len(names), num_values, list(diffs.values()), atol, rtol
    )


def compare_local(values: dict[int, Any], atol: float = 0.0, rtol: float = 0.0) -> Comparison:
    """Compare values that are all in this process (``RankValues.compare``)."""
    ranks = sorted(values)
    reference = ranks[0]
    flat = {r: flatten(values[r]) for r in ranks}
    reports = {}
    for r in ranks:
        entries = {}
        for name, leaf in flat[r].items():
            fp = fingerprint(leaf)
            other = flat[reference].get(name)
            if r != reference and fp["kind"] == "tensor" and other is not None:
                ofp = fingerprint(other)
                if (
                    ofp["kind"] == "tensor"
                    and ofp["shape"] == fp["shape"]
                    and ofp["dtype"] == fp["dtype"]
                    and ofp["hash"] != fp["hash"]
                ):
                    fp["diff"] = tensor_diff(leaf, other, atol, rtol)
            entries[name] = fp
        reports[r] = {"entries": entries}
    return merge(reports, reference, atol, rtol)
