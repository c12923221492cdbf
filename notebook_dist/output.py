"""The ranks' output in the notebook, as it arrives, tagged by rank.

Reads the growing per-message output ipyparallel accumulates for each rank. A complete line
is written at once (``[rank 1] loss 0.3``); a partial line waits for its end or the cell's.
Three things make many ranks' output read as one program's:

- **Carriage returns** (progress lines, ``print(f"\\rstep {i}", end="")``): a line keeps only
  its last state. While it is still being rewritten, the notebook shows its current state
  live in a display of its own, one per rank; the saved notebook keeps the last state.
- **Folding**: from ``fold_from`` ranks up, a line that several ranks print alike is shown
  once, ``[ranks 0-7] epoch 1 done``. Lines wait at most ``fold_window_s`` for the other
  ranks' copy; one rank's own lines are never reordered. ``fold_from=0`` keeps every
  rank's stream raw.
- **A cap**: past ``max_lines`` lines or ``max_bytes`` per rank and stream, the rest of what
  a rank printed goes to a log file, named at the end (a rank printing 100 MB must not
  freeze the notebook).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from typing import Any, TextIO

from .phrases import rank_span

MAX_LINES_PER_RANK = 2000
MAX_BYTES_PER_RANK = 1 << 20


class OutputStreamer:
    def __init__(
        self,
        sources: list[tuple[int, dict]],
        out: TextIO | None = None,
        err: TextIO | None = None,
        max_lines: int = MAX_LINES_PER_RANK,
        max_bytes: int = MAX_BYTES_PER_RANK,
        log_name: str = "cell",
        fold_from: int = 0,
        fold_window_s: float = 0.3,
        live: bool = False,
    ):
        self.sources = sources  # (rank, ipyparallel metadata dict of that rank's message)
        self.ranks = [r for r, _ in sources]
        self.out = out
        self.err = err
        self.max_lines = max_lines  # per rank and stream; the rest goes to a log file
        self.max_bytes = max_bytes
        self.log_name = log_name
        self.fold = fold_from > 0 and len(sources) >= fold_from
        self.fold_window_s = fold_window_s
        self.live = live  # a notebook front end: progress lines shown live in a display
        self._bytes: dict[tuple[int, str], int] = {}
        self._shown: dict[tuple[int, str], int] = {}
        self._logs: dict[tuple[int, str], Any] = {}
        self.dropped: dict[tuple[int, str], int] = {}
        self._offsets: dict[tuple[int, str], int] = {}
        self._partial: dict[tuple[int, str], str] = {}
        #: lines waiting to be folded: (line, since when it waits, its turn in line)
        self._pending: dict[tuple[int, str], deque] = {}
        self._turns = itertools.count()
        self._displays: dict[tuple[int, str], Any] = {}  # live progress lines
        self._outputs_seen: dict[int, int] = {}
        self.lines_written = 0
        self.last_line: dict[int, str] = {}  # per rank, for the dashboard

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self.err or sys.stderr
        return self.out or sys.stdout

    def stdout_stream(self) -> TextIO:
        """Where the cell's own notes go: the cell's stdout."""
        return self._stream("stdout")

    # ---- reading ----------------------------------------------------------------------

    def poll(self) -> None:
        for rank, md in self.sources:
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                key = (rank, name)
                start = self._offsets.get(key, 0)
                if len(text) <= start:
                    continue
                self._offsets[key] = len(text)
                if key in self._logs:  # capped: the rest goes to the log only
                    self._logs[key].write(text[start:])
                    continue
                self._take(rank, name, self._partial.pop(key, "") + text[start:], text)
            self._republish_outputs(rank, md)
        self._release(time.monotonic())

    def _take(self, rank: int, name: str, text: str, full: str) -> None:
        """Complete lines of ``text`` kept (up to the cap), the rest waits for its end."""
        key = (rank, name)
        *lines, rest = text.split("\n")
        shown, nbytes = self._shown.get(key, 0), self._bytes.get(key, 0)
        keep = []
        capped = False
        for line in lines:
            line = last_state(line)
            if shown >= self.max_lines or nbytes + len(line) > self.max_bytes:
                capped = True
                break
            keep.append(line)
            shown += 1
            nbytes += len(line) + 1
        if not capped and rest:
            if nbytes + len(rest) > self.max_bytes:
                capped = True  # one enormous line: do not hold it, do not show it
            else:
                self._partial[key] = rest
                if "\r" in rest:
                    self._show_live(key, last_state(rest))
        if capped:
            self._partial.pop(key, None)
            self._start_log(key, full)
        self._shown[key], self._bytes[key] = shown, nbytes
        for line in keep:
            if line.strip():
                self.last_line[rank] = line
        if keep and self.fold:
            now = time.monotonic()
            queue = self._pending.setdefault(key, deque())
            queue.extend((line, now, next(self._turns)) for line in keep)
        elif keep:
            self._write([rank], name, keep)

    # ---- writing ----------------------------------------------------------------------

    def _write(self, ranks: list[int], name: str, lines: list[str]) -> None:
        """``lines`` of ``ranks`` (one rank, or several that printed them alike)."""
        live = [r for r in ranks if (r, name) in self._displays]
        for r in live:  # its progress line ended: the display keeps the last state
            self._show_live((r, name), lines[0])
            del self._displays[(r, name)]
        if live:
            others = [r for r in ranks if r not in live]
            if others:
                self._put(others, name, lines[:1])
            lines = lines[1:]
        if lines:
            self._put(ranks, name, lines)

    def _put(self, ranks: list[int], name: str, lines: list[str]) -> None:
        prefix = f"[{rank_span(ranks)}] "
        stream = self._stream(name)
        stream.write("".join(f"{prefix}{line}\n" for line in lines))
        stream.flush()
        self.lines_written += len(lines)

    def _release(self, now: float, final: bool = False) -> None:
        """Folding: the oldest waiting line goes out once every rank has printed it (one
        line, their ranks), or when it has waited ``fold_window_s`` (with the ranks that
        have printed it by then), or at the cell's end."""
        for name in ("stdout", "stderr"):
            while True:
                heads = {r: q[0] for (r, n), q in self._pending.items() if n == name and q}
                if not heads:
                    break
                oldest = min(heads, key=lambda r: heads[r][1:])
                text, arrived, _ = heads[oldest]
                alike = sorted(r for r, (line, _, _) in heads.items() if line == text)
                every = len(alike) == len(self.ranks)
                if not (every or final or now - arrived >= self.fold_window_s):
                    break
                for r in alike:
                    q = self._pending[(r, name)]
                    q.popleft()
                    if q:  # the next line waits its own moment, from now, for its copies
                        q[0] = (q[0][0], max(q[0][1], now), next(self._turns))
                self._write(alike, name, [text])

    def _show_live(self, key: tuple[int, str], state: str) -> None:
        """A rewritten line's current state, in a display of its own (notebooks only)."""
        if not self.live:
            return
        from IPython.display import display

        text = {"text/plain": f"[rank {key[0]}] {state}"}
        handle = self._displays.get(key)
        if handle is None:
            self._displays[key] = display(text, raw=True, display_id=True)
        else:
            handle.update(text, raw=True)

    def _start_log(self, key: tuple[int, str], full: str) -> None:
        """Past the cap: everything the rank printed in this cell goes to a file."""
        import tempfile

        folder = os.path.join(tempfile.gettempdir(), f"notebook_dist-logs-{os.getuid()}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        rank, name = key
        path = os.path.join(folder, f"{self.log_name}-rank{rank}-{name}.log".replace(" ", "_"))
        f = open(path, "w")  # noqa: SIM115 - closed in finish()
        f.write(full)
        self._logs[key] = f

    def _republish_outputs(self, rank: int, md: dict) -> None:
        """A rank's rich outputs (figures, tables, widgets), each said to be that rank's."""
        outputs = md.get("outputs") or []
        seen = self._outputs_seen.get(rank, 0)
        if len(outputs) <= seen:
            return
        self._outputs_seen[rank] = len(outputs)
        try:
            from IPython.display import publish_display_data
        except ImportError:
            return
        for output in outputs[seen:]:
            data = dict(output.get("data", {}))
            if "text/plain" in data:
                data["text/plain"] = f"[rank {rank}] " + data["text/plain"]
            rich = set(data) - {"text/plain"}
            if rich and not rich <= {"application/vnd.jupyter.widget-view+json"}:
                publish_display_data(  # a label above a figure or a table
                    {
                        "text/plain": f"[rank {rank}]",
                        "text/html": f"<div class='nd-rank-label' style='font-size:11px;"
                        f"color:#777'>rank {rank}</div>",
                    },
                )
            publish_display_data(data, output.get("metadata", {}))

    def finish(self) -> None:
        self.poll()
        self._release(time.monotonic(), final=True)
        for key, f in sorted(self._logs.items()):
            rank, name = key
            f.flush()
            total = _count_lines(f.name)
            f.close()
            dropped = max(total - self._shown.get(key, 0), 0)
            self.dropped[key] = dropped
            size = os.path.getsize(f.name)
            self._stream(name).write(
                f"[rank {rank}] ... output capped: {dropped:,} more lines of {name} not shown "
                f"(cap: {self.max_lines:,} lines or {self.max_bytes // 1024:,} KiB per rank); "
                f"all {size / 2**20:.1f} MiB are in {f.name}\n"
            )
        for (rank, name), rest in sorted(self._partial.items()):
            self._write([rank], name, [last_state(rest)])
        self._partial.clear()


def last_state(line: str) -> str:
    """What a line rewritten with carriage returns shows last ('\\rstep 0\\rstep 4' -> 'step 4');
    a Windows line end (a final '\\r') is no rewrite."""
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1] if "\r" in line else line


def _count_lines(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n
