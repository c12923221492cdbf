"""Kernel side of cross-rank inspection: compare, post-mortem debug, inspect.

>>> cluster.compare("model").agree          # are the replicas identical?
>>> cluster_debug(cluster, rank=1, expr="x")  # rank 1's frame where it raised
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .compare import Comparison, merge
from .errors import UsageMistake
from .phrases import rank_list
from .runtime import inspect as rt_inspect
from .values import RankValues, unpack


class InspectError(UsageMistake, ValueError):
    """A post-mortem or comparison that cannot be done, with what to do instead."""


def compare(
    cluster, expr: str, ranks: Any = None, atol: float = 0.0, rtol: float = 0.0
) -> Comparison:
    """Evaluate EXPR on the ranks and report what differs from the first selected rank."""
    _check_expr(expr)
    selected = cluster.select(ranks)
    if len(selected) < 2:
        raise InspectError("comparing needs at least two ranks")
    # phase 1: fingerprints only; an expression that fails anywhere fails here, before
    # any rank waits on another
    reports = dict(cluster.apply(rt_inspect.fingerprints, expr, ranks=selected, timeout=600))
    reference = selected[0]
    ref = reports[reference]["entries"]
    wanted: dict[int, list[str]] = {}
    for rank in selected[1:]:
        for name, fp in reports[rank]["entries"].items():
            other = ref.get(name)
            if (
                other is not None
                and fp["kind"] == other["kind"] == "tensor"
                and fp["hash"] != other["hash"]
                and fp["shape"] == other["shape"]
                and fp["dtype"] == other["dtype"]
            ):
                wanted.setdefault(rank, []).append(name)
    if wanted:  # phase 2: only the ranks and leaves that differ, diffed rank to rank
        involved = [reference, *sorted(wanted)]
        diffs = cluster.apply(
            rt_inspect.diff, expr, reference, wanted, atol, rtol, ranks=involved, timeout=600
        )
        for rank, found in diffs.items():
            for name, d in found.items():
                reports[rank]["entries"][name]["diff"] = d
    return merge(reports, reference, atol, rtol)


def inspect(cluster, expr: str, ranks: Any = None) -> RankValues:
    """EXPR on every selected rank, side by side, without running a cell."""
    _check_expr(expr)
    packed = cluster.apply(rt_inspect.evaluate, expr, ranks=ranks, timeout=60)
    return RankValues({r: unpack(frames) for r, frames in packed.items()}, name=expr)


@dataclass
class FrameView:
    rank: int
    exception: str
    frames: list[tuple[str, int, str]]
    index: int
    file: str
    line: int
    func: str
    locals: dict[str, str]
    value: str | None = None
    value_error: str | None = None
    truncated: bool = False

    def text(self) -> str:
        where = (
            f"line {self.line}"
            if self.file.startswith("Cell In[")
            else f"{self.file}, line {self.line}"
        )
        lines = [
            f"rank {self.rank} raised {self.exception}",
            f"frame {self.index} of {len(self.frames)} (0 = where it raised): {self.file}, {where.split(', ')[-1]}, in {self.func}",
        ]
        if self.locals:
            w = max(len(k) for k in self.locals)
            lines.append("locals:" + (" (the last 40)" if self.truncated else ""))
            lines.extend(f"  {k.ljust(w)} = {v}" for k, v in self.locals.items())
        else:
            lines.append("locals: (none)")
        if self.value is not None:
            lines.append(f"=> {self.value}")
        if self.value_error is not None:
            lines.append(f"=> {self.value_error}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()


def failed_ranks(cluster) -> list[int]:
    watch = cluster.last_watch
    if watch is None:
        return []
    return sorted(r for r, v in watch.view().views.items() if v.status == "error")


def debug(cluster, rank: int | None = None, expr: str | None = None, frame: int = 0) -> FrameView:
    """The frame where ``rank`` raised in the last cell (``frame`` 1, 2 ... walk to callers)."""
    if expr is not None:
        _check_expr(expr)
    failed = failed_ranks(cluster)
    if not failed:
        raise InspectError("no rank raised in the last cell: there is nothing to debug")
    if rank is None:
        rank = failed[0]
    cluster.select(rank)
    if rank not in failed:
        raise InspectError(
            f"rank {rank} did not raise in the last cell; "
            f"{rank_list(failed, 'rank that did:', 'ranks that did:')} (use --rank {failed[0]})"
        )
    if frame < 0:
        raise InspectError("--frame counts up from 0 (where it raised): give 0 or more")
    info = cluster.apply(rt_inspect.debug, frame, expr, ranks=[rank], timeout=60)[rank]
    if info.get("error") == "none":
        raise InspectError(
            f"rank {rank} holds no traceback any more (a cell ran since, or the ranks restarted)"
        )
    if info.get("error") == "frame":
        raise InspectError(
            f"--frame {frame}: rank {rank}'s traceback has frames 0-{info['count'] - 1}"
        )
    return FrameView(
        rank=rank,
        **{k: v for k, v in info.items() if k in FrameView.__dataclass_fields__ and k != "rank"},
    )


def _check_expr(expr: str) -> None:
    try:
        compile(expr, "<expr>", "eval")
    except SyntaxError as exc:
        raise InspectError(f"{expr!r} is not a Python expression: {exc.msg}") from None
