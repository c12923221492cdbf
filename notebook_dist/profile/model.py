"""What a profile found, as data: per rank where the time went, per op the bandwidth,
the verdict; drawn by ``view``, its merged trace written by ``trace``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..phrases import rank_list


@dataclass
class RankTime:
    rank: int
    wall_s: float
    compute_s: float
    collectives_s: float  # time inside collectives (from arrival to completion, merged)
    waiting_s: float  # of which, waiting for the last peer to arrive
    exposed_s: float  # communication the main thread did not overlap with its own work
    # the cell's thread: runnable but not running (waiting for a CPU), and on a CPU (Linux)
    cpu_wait_s: float | None = None
    cpu_busy_s: float | None = None
    # every thread of its process (Gloo's and torch's too), waiting for a CPU, summed (Linux)
    process_wait_s: float | None = None
    # the cell's thread neither on a CPU nor waiting for one, outside the communication it
    # waited on: asleep, reading, on a lock (Linux)
    off_cpu_s: float | None = None


@dataclass
class OpTime:
    op: str
    count: int
    bytes: int  # S, as nccl-tests counts it
    mean_s: float  # from the last arrival to completion: the transfer itself
    algbw: float  # GB/s
    busbw: float  # GB/s


@dataclass
class Profile:
    cell: str
    world: list[int]
    ranks: dict[int, RankTime]
    ops: list[OpTime]
    verdict: str | None
    trace_path: str | None = None
    lanes: dict[int, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    span_s: float = 0.0
    cuda: bool = False  # GPU ranks: the table also shows exposed (not overlapped) communication
    #: a rank was last because it waited for a CPU: said instead of a verdict on the code
    machine: str | None = None
    #: ranks whose collectives the Flight Recorder did not record: nothing can be matched
    unrecorded: list[int] = field(default_factory=list)
    #: the merged Chrome trace, until save_trace() writes it (analyze writes no file)
    trace_events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def finding(self) -> str:
        """The sentence under the tables: the verdict, the machine's part, or all clear."""
        if self.unrecorded:
            return (
                f"No verdict: torch's Flight Recorder, by which the profile matches each "
                f"collective across the ranks, recorded none of this cell's collectives on "
                f"{rank_list(self.unrecorded)} (torch before 2.8 records none on Gloo; "
                "TORCH_FR_BUFFER_SIZE=0 turns it off), so time in collectives, waiting for "
                "peers and compute are not known."
            )
        if self.verdict:
            return f"Verdict: {self.verdict}"
        if self.machine:
            return f"No rank's code holds the others back. {self.machine}"
        return "No rank holds the others back."

    def save_trace(self, folder: str | None = None) -> str | None:
        """Write the merged trace (Perfetto, chrome://tracing); its path, kept in
        ``trace_path``. The events are let go once written."""
        from .trace import save_trace

        if self.trace_events:
            self.trace_path = save_trace(self.trace_events, self.cell, folder)
            self.trace_events = []
        return self.trace_path

    def text(self, full: bool = False) -> str:
        """The tables and the finding; from ``phrases.COMPACT_FROM`` ranks the rank table
        names the ranks at either end and gives the others one row, unless ``full``."""
        from .view import text

        return text(self, full)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        from .view import html_of

        return html_of(self)

    def timeline_svg(self, width: int = 640) -> str:
        from .view import timeline_svg

        return timeline_svg(self, width)
