"""The doctor's input from the kernel's views of the ranks: per rank its status and
snapshot, and how it ended (its exit, its error and line, where a fatal signal found it).

``before_release`` gives the ranks as they were while they waited: a released rank as it
was when it was released, a rank whose collective torch's timeout ended as it was in it.
"""

from __future__ import annotations

from ..doctor import RankReport
from ..phrases import UNSEEN_EXITS, describe_exit
from .progress import RankView


def doctor_input(
    views: dict[int, RankView],
    cell_file: str,
    fault_report,
    before_release: bool = False,
) -> dict[int, RankReport]:
    """``fault_report(rank)``: what the rank's fault file and record say (a dead rank)."""
    timed = timed_out(views) if before_release else {}
    out: dict[int, RankReport] = {}
    for r, v in views.items():
        if v.status == "dead":  # (also one released before it was found dead: on another
            out[r] = dead_report(v, fault_report(r))  # host, that can take seconds)
        elif before_release and v.released and not interrupted_in_python(v):
            out[r] = RankReport("running", v.before_release or v.snap)
        elif r in timed:  # as it was while it waited, before torch's timeout ended the wait
            rec = {k: x for k, x in timed[r].items() if k not in ("t1", "failed")}
            same = (rec.get("group"), rec.get("seq"))
            history = [
                h for h in v.snap.get("history") or [] if (h.get("group"), h.get("seq")) != same
            ]
            out[r] = RankReport("running", dict(v.snap, collective=rec, history=history))
        elif v.status == "error" and v.result:
            e = v.result["error"]
            line = error_line(e.get("traceback", ""), cell_file)
            out[r] = RankReport("error", v.snap, error=(e["ename"], e["evalue"], line))
        else:
            out[r] = RankReport(v.status, v.snap)
    return out


def dead_report(v: RankView, fault: dict) -> RankReport:
    """A dead rank: how it ended, and where (its fault file). Where the notebook could not
    see its exit status (a rank on another host, found gone by the heartbeat), what its own
    files there say: the status its witness wrote (``runtime.witness``), else the fatal
    signal faulthandler named or the code of a cell's ``os._exit()``."""
    exit_ = v.exit
    if exit_ in UNSEEN_EXITS:
        if fault.get("status") is not None:
            exit_ = describe_exit(fault["status"])
        elif fault.get("signal"):
            exit_ = f"was killed by {fault['signal']}"
        elif fault.get("exit_code") is not None:
            exit_ = describe_exit(fault["exit_code"])
    return RankReport("dead", v.snap, exit_, v.dead_at, fault=fault)


def interrupted_in_python(v: RankView) -> bool:
    """A rank released while in Python code, not in a collective, which the interrupt sent
    with the release ended (a dead rank's peers get both at once when the kernel polls
    late, as on a busy machine): the release freed it from nothing, and its interrupt is
    what it did."""
    error = (v.result or {}).get("error") or {}
    before = v.before_release or v.snap or {}
    return (
        v.status == "error"
        and error.get("ename") == "KeyboardInterrupt"
        and not before.get("collective")
    )


def broken(views: dict[int, RankView]) -> dict[int, dict]:
    """Ranks whose default group broke in this cell: rank -> {"kind", "why"}."""
    return {
        r: v.result["group_broken"]
        for r, v in views.items()
        if v.result and v.result.get("group_broken")
    }


def timed_out(views: dict[int, RankView]) -> dict[int, dict]:
    """Ranks whose collective torch's own timeout ended: rank -> that collective's record."""
    out = {}
    for r, why in broken(views).items():
        # the tracker's record of the broken collective (its error may have been caught)
        rec = why.get("record") or (views[r].result.get("error") or {}).get("record")
        if why.get("kind") == "timeout" and rec:
            out[r] = rec
    return out


def error_line(traceback_text: str, filename: str) -> int | None:
    """The last line number of ``filename`` in a formatted traceback."""
    line = None
    marker = f'File "{filename}", line '
    for part in traceback_text.splitlines():
        part = part.strip()
        if part.startswith(marker):
            try:
                line = int(part[len(marker) :].split(",", 1)[0])
            except ValueError:
                pass
    return line
