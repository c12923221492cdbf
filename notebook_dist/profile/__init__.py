"""Where the time of a cell goes, across ranks (``%%distributed --profile``).

Each rank ran the cell under torch.profiler (``runtime/profiler.py``) and sent back its
collectives (process group, sequence number, bytes, when it arrived, when the collective
ran) and when its main thread was computing. Here the ranks are put on one clock and
matched collective by collective, which gives what no single rank's trace shows:

- how long each rank **waited for its peers**: for each collective, the time from its own
  arrival to the last rank's arrival (arrival skew);
- a per-op table with algorithm and bus bandwidth by the nccl-tests formulas;
- a plain verdict when one rank holds the others back, naming it and its cell line, and
  none when the machine did it (the late rank waited for a CPU: Linux's schedstat);
- a timeline, one lane per rank, and one merged Chrome trace (Perfetto, chrome://tracing).

The events come from torch.profiler's own results. Holistic Trace Analysis, the usual tool
for such traces, finds communication only in NCCL kernels on GPU streams: on CPU traces
(Gloo) its overlap, temporal and straggler analyses return nothing or fail (tried with HTA
0.5), so the matching across ranks is done here, on the Flight Recorder's sequence numbers.
"""

from __future__ import annotations

from .analysis import analyze, clock_shifts, minus
from .model import OpTime, Profile, RankTime
from .trace import save_trace, trace_events

__all__ = [
    "OpTime",
    "Profile",
    "RankTime",
    "analyze",
    "clock_shifts",
    "minus",
    "save_trace",
    "trace_events",
]
