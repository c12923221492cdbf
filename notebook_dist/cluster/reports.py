"""What a dead rank left on its host, read for the doctor's verdict and for how the rank is
said to have ended: its fault file (faulthandler's stacks, the line a cell's ``os._exit()``
wrote, the exit status its witness wrote) and its collective's record."""

from __future__ import annotations

import re
from typing import Any

from ..runtime.state import EXIT_NOTE
from ..runtime.witness import ended_status
from . import engines


def fault_report(cluster, rank: int) -> dict[str, Any]:
    """What a dead rank left (:func:`rank_report`), by its rank in ``cluster``."""
    pid = next((r.pid for r in cluster.ranks if r.rank == rank), None)
    return {} if pid is None else rank_report(cluster.processes, rank, pid)


def rank_report(processes, rank: int, pid: int) -> dict[str, Any]:
    """Where a rank that died was, and how it ended: its cell line and collective, if known
    (Python's faulthandler wrote every thread's stack to its fault file), the record of the
    collective it was in (``record``: what it passed; the tracker keeps it in a file mapped
    into memory, which outlives the rank), and the exit status its witness wrote
    (``status``, ``runtime/witness.py``). Read on its host (one ssh call for one on another
    host); once the status is there its files change no more, and the report is kept
    (``Processes.ended``), not read again."""
    from ..runtime.tracker import read_blackbox

    known = processes.ended.get((rank, pid))
    if known is not None:
        return known
    host = processes.host_launcher(rank)
    out: dict[str, Any] = {}
    paths = [processes.control_file(rank, kind, pid) for kind in ("record", "fault")]
    try:  # on its host, with one call
        box, text = engines.read_on_host(host, paths)
    except Exception:  # (a host that does not answer: nothing known of where it was)
        box = text = None
    rec = read_blackbox(box) if box else None
    if rec is not None:
        out["record"] = rec
    _from_stacks(text or "", out)
    if rec and "op" not in out:  # no stack written (a segfault can stop the writer): it
        out["op"] = rec["op"]  # died inside the collective its record holds, still open
        if rec.get("where"):
            out["file"], out["line"] = rec["where"]
    if "status" in out:
        processes.ended[(rank, pid)] = out
    return out


def _from_stacks(text: str, out: dict) -> None:
    """The collective and the cell line of the first thread that shows one, from the stacks
    Python's faulthandler wrote."""
    from ..runtime.tracker import COLLECTIVES

    # how it ended, for a rank on another host, whose exit status the notebook cannot see
    fatal = FATAL_ERROR.search(text)
    if fatal:
        out["signal"] = FATAL_SIGNALS[fatal.group(1)]
    called = EXITED.search(text)
    if called:
        out["exit_code"] = int(called.group(1))
    status = ended_status(text)
    if status is not None:
        out["status"] = status
    section = text.split("Current thread", 1)[-1] if "Current thread" in text else text
    found = False  # the end of the first thread with a cell line or a collective in it
    for line in section.splitlines():
        line = line.strip()
        if not line.startswith('File "'):
            if found and not line:
                break
            continue
        filename, _, rest = line[6:].partition('", line ')
        num, _, func = rest.partition(" in ")
        if "op" not in out and func in COLLECTIVES:
            out["op"] = func
            found = True
        if filename.startswith("Cell In[") and "line" not in out:
            out["file"], out["line"] = filename, int(num)
            found = True


#: the fatal signal that faulthandler names on its first line ("Fatal Python error:
#: Segmentation fault"), as Python 3.9 to 3.13 word each
FATAL_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
FATAL_ERROR = re.compile(r"^Fatal Python error: (" + "|".join(FATAL_SIGNALS) + ")", re.MULTILINE)
#: what a cell's os._exit() wrote before its stack (``runtime.bootstrap``)
EXITED = re.compile("^" + re.escape(EXIT_NOTE) + r"(-?\d+)$", re.MULTILINE)
