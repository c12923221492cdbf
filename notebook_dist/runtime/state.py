"""Per-process state of a rank, set by the bootstrap and read by the helpers."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str | None = None
    timeout_s: float | None = None
    store_timeout_s: float | None = None
    bootstrapped: bool = False
    #: the last exception a cell raised on this rank: (exc, traceback), for post-mortems
    last_error: tuple[BaseException, Any] | None = None
    #: why the default group cannot be used any more ({"kind": "timeout"|"closed", "why",
    #: and the tracker's "record" of the collective that broke it, when it saw one), until
    #: it is made again (notebook_dist.runtime.group.note_failure)
    group_broken: dict | None = None
    #: what this rank asks the notebook for now (runtime.debugger.ask): id, prompt, kind, where
    asking: dict | None = None
    #: lines the notebook answered: (request id, text), put by the agent thread
    answers: queue.Queue = field(default_factory=queue.Queue)
    #: how the last cell ended itself (exit(), sys.exit()): notebook_dist.runtime.exits.report
    last_exit: dict | None = None
    #: "idle", "running", "done" or "error": what the current/last cell is doing here
    cell_state: str = "idle"
    cell_started: float = 0.0
    cell_token: str = ""
    #: the running cell's filename ("Cell In[7]"): a helper from an earlier cell is elsewhere
    cell_file: str = ""
    #: latest values from nd.report(), and a bounded history of each numeric one
    metrics: dict[str, Any] = field(default_factory=dict)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    reports: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    #: whether the notebook shows this cell's progress bars grouped (``runtime/bars.py``),
    #: and the bars the cell made (each with whether it shows nothing on the rank)
    group_bars: bool = False
    bars: list = field(default_factory=list)

    def reset_cell(self, started: float, token: str = "", cell_file: str = "") -> None:
        self.cell_token = token
        self.cell_file = cell_file
        self.cell_state = "running"
        self.cell_started = started
        self.metrics = {}
        self.series = {}
        self.reports = 0
        self.bars = []


STATE = RankState()


#: the line a cell's ``os._exit(code)`` writes in the rank's fault file before its stack
#: (``bootstrap``), read by the notebook (``cluster.recovery``)
EXIT_NOTE = "notebook_dist: os._exit with code "


def rank_file(folder: str, kind: str, rank: int, pid: int | None = None) -> str:
    """A rank's control file in ``folder``, by kind (``release``, ``answer``, ``broken``);
    with ``pid``, one that only that process of the rank writes (``fault``, ``record``), so
    a process that was the rank before cannot write over its successor's. The notebook
    and the rank both name the files with this."""
    return os.path.join(folder, f"{kind}-rank-{rank}" + (f"-{pid}" if pid else ""))


def rebuild_step(step: str | None) -> None:
    """Where this rank is in a rebuild of its group (``recover.reinit``), in its control
    file of kind ``rebuild``, this process's own (one that was the rank before and died in
    a rebuild left its file): the notebook reads it when a rank does not answer in time
    (None: done, the file goes)."""
    control = STATE.extras.get("control_file")
    if not control:
        return
    path = rank_file(os.path.dirname(control), "rebuild", STATE.rank, os.getpid())
    with contextlib.suppress(OSError):
        if step is None:
            os.remove(path)
            return
        with open(path, "w") as f:
            f.write(f"{time.time():.3f} {step}")


def current() -> RankState:
    """The rank's state; outside a notebook_dist engine it reads torchrun's environment."""
    if STATE.bootstrapped:
        return STATE
    env = os.environ
    return RankState(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        device=_default_device(int(env.get("LOCAL_RANK", 0))),
    )


def _default_device(local_rank: int) -> str:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return "cpu"


#: [the engine's shell], once there is one: a process has one shell for its life, and
#: asking IPython for it costs more than the rest of the lookup (twice on every cell)
_SHELL: list = []


def user_namespace() -> dict:
    """The namespace cells run in: the engine shell's, or ``__main__``'s outside one."""
    if _SHELL:
        return _SHELL[0].user_ns
    try:
        # core only, no display code; not ``from IPython import``, whose module-level
        # __getattr__ costs more than the lookup itself
        from IPython.core.getipython import get_ipython

        ip = get_ipython()
    except ImportError:
        ip = None
    if ip is not None:
        _SHELL.append(ip)
        return ip.user_ns
    import __main__

    return __main__.__dict__
