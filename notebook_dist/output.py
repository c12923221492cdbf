"""The ranks' output in the notebook, as it arrives, tagged by rank.

Reads the growing per-message output ipyparallel accumulates for each rank. A complete line
is written at once (``[rank 1] loss 0.3``); a partial line waits for its end or the cell's.
A rank's stdout and stderr lines (prints, warnings, ``logging``) come out in the order the
rank wrote them: the rank sends them so (``runtime.streams``) and :func:`in_order` notes
the order they land in. Three things make many ranks' output read as one program's:

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

import functools
import heapq
import itertools
import os
import re
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from .displays import DisplayRelay
from .phrases import rank_list, size_text

STREAMS = ("stdout", "stderr")
NOTE = "notebook_dist:"  # how the tool's own notes on a rank begin
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
        fold = fold_from > 0 and len(sources) >= fold_from
        self.folding = Folding(len(sources), fold_window_s) if fold else None
        self.live = live  # a notebook front end: progress lines shown live in a display
        self._bytes: dict[tuple[int, str], int] = {}
        self._shown: dict[tuple[int, str], int] = {}
        self._logs: dict[tuple[int, str], Any] = {}
        self.dropped: dict[tuple[int, str], int] = {}
        self._offsets: dict[tuple[int, str], int] = {}
        self._partial: dict[tuple[int, str], str] = {}
        self._order_seen: dict[int, int] = {}
        self._displays: dict[tuple[int, str], Any] = {}  # live progress lines
        self.displays = DisplayRelay()
        self.lines_written = 0
        self._held: TextIO | None = None  # the stream written to and not yet flushed
        self.last_line: dict[int, str] = {}  # per rank, for the dashboard
        for _, md in sources:
            in_order(md)  # from now on, the order the two streams grow in is noted

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self.err or sys.stderr
        return self.out or sys.stdout

    def stdout_stream(self) -> TextIO:
        """Where the cell's own notes go: the cell's stdout."""
        return self._stream("stdout")

    # ---- reading ----------------------------------------------------------------------

    def poll(self, whole: bool = False) -> None:
        """Show what came; ``whole``: every line waiting to be folded goes now (a rank is to
        ask the user something: what it printed before it asked shows before the prompt)."""
        for rank, md in self.sources:
            if not (md.get("stdout") or md.get("stderr") or md.get("outputs")):
                continue  # nothing from this rank yet (most ranks of most cells)
            for name, end in self._grown(rank, md):
                self._read_lines(rank, name, md.get(name) or "", end)
            for name in STREAMS:
                self._read_partial(rank, name, md.get(name) or "")
            if md.get("outputs"):
                self._flush()  # (a display comes after the lines written before it)
                self.displays.relay(rank, md, self._put_display)
        self._release(time.monotonic(), final=whole)
        self._flush()

    def _grown(self, rank: int, md: dict) -> list[tuple[str, int]]:
        """Which stream grew, in the order the rank's messages came, each with where its
        complete lines end then. ipyparallel keeps one string per stream; the order
        between the two is kept by :func:`in_order` (else stdout's lines come first)."""
        order = in_order(md)
        if order is None:
            return [(name, (md.get(name) or "").rfind("\n") + 1) for name in STREAMS]
        seen = self._order_seen.get(rank, 0)
        grown = order[seen:]
        self._order_seen[rank] = seen + len(grown)
        return grown

    def _read_lines(self, rank: int, name: str, text: str, end: int) -> None:
        """The complete lines of one stream up to ``end``. What comes before a stream's
        last line end never changes; ipyparallel rewrites only the line being written
        (it keeps a carriage-return line's last state)."""
        key = (rank, name)
        start = self._offsets.get(key, 0)
        if end <= start:
            return
        self._offsets[key] = end
        if key in self._logs:  # capped: the rest goes to the log only
            self._logs[key].write(text[start:end])
            return
        self._take(rank, name, text[start:end].split("\n")[:-1], text[:end])

    def _read_partial(self, rank: int, name: str, text: str) -> None:
        """The line a rank is still writing: shown live while it is rewritten in place (a
        progress line), written out when it ends or at the cell's end."""
        key = (rank, name)
        rest, before = text[self._offsets.get(key, 0) :], self._partial.get(key, "")
        if rest == before:
            return
        self._partial[key] = rest
        if key in self._logs:
            return
        if self._bytes.get(key, 0) + len(rest) > self.max_bytes:
            self._start_log(key, text[: self._offsets.get(key, 0)])  # one enormous line
            return
        rewritten = "\r" in rest or not rest.startswith(before) or key in self._displays
        if rest and rewritten:
            self._show_live(key, last_state(rest))

    def _take(self, rank: int, name: str, lines: list[str], upto: str) -> None:
        """``lines`` kept (up to the cap), written or queued for folding."""
        key = (rank, name)
        shown, nbytes = self._shown.get(key, 0), self._bytes.get(key, 0)
        keep = []
        for raw in lines:
            line = last_state(raw)
            if line != raw and not line.strip():
                continue  # nothing left to see: a cleared progress line, a cursor control
            if shown >= self.max_lines or nbytes + len(line) > self.max_bytes:
                self._start_log(key, upto)
                break
            keep.append(line)
            shown += 1
            nbytes += len(line) + 1
        self._shown[key], self._bytes[key] = shown, nbytes
        for line in keep:
            if line.strip() and not line.startswith(NOTE):
                self.last_line[rank] = line  # the user's line, not the tool's note
        if keep and self.folding is not None:
            self.folding.add(rank, name, keep, time.monotonic())
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

    def late_output(self, request: dict | None = None) -> Callable[[int, str, str], None]:
        """Where the i-th rank's output goes when it comes after the cell ended
        (:func:`late_output`)."""
        return late_output(self.ranks, self.out, self.err, request)

    def _put_display(self, rank: int, lines: list[str]) -> None:
        """A display's text, outside a kernel: the rank's lines on stdout."""
        self._put([rank], "stdout", lines)

    def _put(self, ranks: list[int], name: str, lines: list[str]) -> None:
        self._put_text(name, _prefixed(ranks, lines), len(lines))

    def _put_text(self, name: str, text: str, lines: int) -> None:
        stream, held = self._stream(name), self._held
        if held is not None and held is not stream:
            held.flush()  # what the other stream holds goes first
        stream.write(text)
        self._held = stream
        self.lines_written += lines

    def _flush(self) -> None:
        """What was written, sent: at the end of each look, before a display, and when the
        writes switch streams, not after each line (a kernel's stream flushes by a round
        trip to its IO thread: a cell of 4 ranks printing 1000 lines each took 2 s so)."""
        held, self._held = self._held, None
        if held is not None:
            held.flush()

    def _release(self, now: float, final: bool = False) -> None:
        """The folded lines due (:meth:`Folding.due`), written: those due one after another
        on one stream in one write (each in its own while a progress line shown live is
        to end)."""
        if self.folding is None:
            return
        due = self.folding.due(now, final)
        if self._displays:
            for ranks, name, lines in due:
                self._write(ranks, name, lines)
            return
        for name, runs in itertools.groupby(due, key=lambda run: run[1]):
            runs = list(runs)
            text = "".join(_prefixed(ranks, lines) for ranks, _, lines in runs)
            self._put_text(name, text, sum(len(lines) for _, _, lines in runs))

    def _show_live(self, key: tuple[int, str], state: str) -> None:
        """A rewritten line's current state, in a display of its own (notebooks only)."""
        if not self.live:
            return
        from IPython.display import display

        self._flush()

        text = {"text/plain": f"[rank {key[0]}] {state}"}
        handle = self._displays.get(key)
        if handle is None:
            self._displays[key] = display(text, raw=True, display_id=True)
        else:
            handle.update(text, raw=True)

    def _start_log(self, key: tuple[int, str], upto: str) -> None:
        """Past the cap: everything the rank printed in this cell goes to a file (``upto``
        so far, the rest as it comes)."""
        import tempfile

        folder = os.path.join(tempfile.gettempdir(), f"notebook_dist-logs-{os.getuid()}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        rank, name = key
        path = os.path.join(folder, f"{self.log_name}-rank{rank}-{name}.log".replace(" ", "_"))
        f = open(path, "w")  # noqa: SIM115 - closed in finish()
        f.write(upto)
        self._logs[key] = f

    def finish(self) -> None:
        self.poll()
        self._release(time.monotonic(), final=True)
        for (rank, name), rest in sorted(self._partial.items()):  # lines without an end
            if (rank, name) in self._logs:
                self._logs[(rank, name)].write(rest)
            elif rest:
                self._write([rank], name, [last_state(rest)])
        self._partial.clear()
        self._flush()
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
                f"all {size_text(size)} are in {f.name}\n"
            )


def _prefixed(ranks: list[int], lines: list[str]) -> str:
    """``lines`` as the notebook shows them: ``[rank 3] loss 0.3``, ``[ranks 0-7] done``."""
    prefix = _prefix(tuple(ranks))
    return "".join(f"{prefix}{line}\n" for line in lines)


@functools.lru_cache(maxsize=4096)
def _prefix(ranks: tuple[int, ...]) -> str:
    """``[rank 3] ``, ``[ranks 0-7] ``: made once for each set of ranks."""
    return f"[{rank_list(list(ranks))}] "


class Folding:
    """The lines of ``n`` ranks waiting to be folded. The oldest waiting line is due once
    every rank has printed it (one line, their ranks), or when it has waited ``window_s``
    (with the ranks that have printed it by then), or at the cell's end. A rank's lines,
    on either stream, wait in one queue: they go out in the order the rank wrote them.
    The oldest is found in a heap and its copies by their text, not by a look at every
    rank for each line."""

    def __init__(self, n: int, window_s: float):
        self.n, self.window_s = n, window_s
        #: each rank's lines waiting: (stream, line, since when, turn in line)
        self.pending: dict[int, deque] = {}
        self._turns = itertools.count()

    def add(self, rank: int, name: str, lines: list[str], now: float) -> None:
        queue = self.pending.setdefault(rank, deque())
        queue.extend((name, line, now, next(self._turns)) for line in lines)

    def due(self, now: float, final: bool = False) -> list[tuple[list[int], str, list[str]]]:
        """The lines that go out now, taken, as (ranks, stream, lines): lines that go out
        one after another alike come as one."""
        pending = self.pending
        heads = {r: q[0] for r, q in pending.items() if q}
        order = [(head[2], head[3], r) for r, head in heads.items()]  # (since when, turn)
        heapq.heapify(order)
        alike_at: dict[tuple[str, str], set[int]] = {}  # (stream, line) -> ranks it heads
        for r, head in heads.items():
            alike_at.setdefault(head[:2], set()).add(r)
        out: list[tuple[list[int], str, list[str]]] = []
        while order:
            arrived, turn, oldest = order[0]
            head = heads.get(oldest)
            if head is None or head[3] != turn:  # a rank's head since moved on
                heapq.heappop(order)
                continue
            name, text = head[:2]
            members = alike_at[(name, text)]
            alike = sorted(members) if len(members) > 1 else [oldest]
            if not (len(alike) == self.n or final or now - arrived >= self.window_s):
                break
            del alike_at[(name, text)]
            for r in alike:
                q = pending[r]
                q.popleft()
                if not q:
                    del heads[r]
                    continue
                # the next line waits its own moment, from now, for its copies
                head = heads[r] = q[0] = (*q[0][:2], max(q[0][2], now), next(self._turns))
                alike_at.setdefault(head[:2], set()).add(r)
                heapq.heappush(order, (head[2], head[3], r))
            if out and out[-1][0] == alike and out[-1][1] == name:
                out[-1][2].append(text)
            else:
                out.append((alike, name, [text]))
        return out


#: where a terminal line is rewritten: a carriage return, or "erase the line" (Rich)
_REWRITE = re.compile(r"\r|\x1b\[2K")
#: terminal controls other than colours (cursor moves and visibility, erasing, links):
#: a notebook shows colours and nothing of the rest
_CONTROLS = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def last_state(line: str) -> str:
    """What a line rewritten in place shows last ('\\rstep 0\\rstep 4' -> 'step 4'; Rich's
    erase-line controls alike), colours kept and other terminal controls dropped; a Windows
    line end (a final '\\r') is no rewrite."""
    line = _REWRITE.split(line.rstrip("\r"))[-1]
    return _CONTROLS.sub("", line) if "\x1b" in line else line


def _count_lines(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n


_IN_ORDER: list = []  # ipyparallel's Metadata and its subclass, made on first use


def _in_order_classes() -> tuple[type, type]:
    """(ipyparallel's Metadata, a subclass that also notes, as each stream message lands,
    which stream grew and where its complete lines then end). Made when first needed, so
    importing notebook_dist does not import ipyparallel's client."""
    if not _IN_ORDER:
        from ipyparallel.client.client import Metadata

        class InOrder(Metadata):
            def __setitem__(self, key, value):
                super().__setitem__(key, value)
                if key in STREAMS:
                    self.__dict__["_notebook_dist_order"].append((key, value.rfind("\n") + 1))

        _IN_ORDER.extend((Metadata, InOrder))
    return _IN_ORDER[0], _IN_ORDER[1]


#: [the ordered record's class, a new record's entries as ipyparallel's Metadata makes them,
#: those made anew for each record (a list, a dict) with their type]
_FRESH: list = []


def ordered_record() -> dict:
    """A new record for one request (ipyparallel's Metadata) that notes the order its two
    streams grow in from the start: what :func:`in_order` makes of a new one, made so at
    once (a cell's record for each rank, on the way to every rank's request)."""
    if not _FRESH:
        metadata, in_order_class = _in_order_classes()
        fresh = dict(metadata())
        made = {k: type(v) for k, v in fresh.items() if isinstance(v, (list, dict))}
        _FRESH.extend((in_order_class, fresh, made))
    in_order_class, fresh, made = _FRESH
    md = dict.__new__(in_order_class)
    dict.update(md, fresh)
    for key, kind in made.items():
        dict.__setitem__(md, key, kind())
    md.__dict__["_notebook_dist_order"] = [("stdout", 0), ("stderr", 0)]
    return md


def in_order(md: dict) -> list[tuple[str, int]] | None:
    """The order ``md``'s two streams grew in, from now on (what came before comes
    stdout first), or None for metadata that is not ipyparallel's."""
    try:  # (a cell's own records: ordered from the start, see ordered_record)
        return md.__dict__["_notebook_dist_order"]
    except (AttributeError, KeyError):
        pass
    metadata, in_order_class = _in_order_classes()
    if type(md) is not metadata:
        return None
    order = md.__dict__["_notebook_dist_order"] = []
    object.__setattr__(md, "__class__", in_order_class)
    order.extend((name, (md[name] or "").rfind("\n") + 1) for name in STREAMS)
    return order


def late_output(
    ranks: list[int], out: TextIO | None, err: TextIO | None, request: dict | None = None
) -> Callable[[int, str, str], None]:
    """Where the i-th rank's output goes when it comes after its cell ended (a thread of
    the rank's writing while no cell runs): ``late(i, stream, text)`` writes it to the
    cell's streams as that rank's lines, unfolded. In a kernel, ``request`` (the notebook
    cell's) shows them under the cell that ran, as Jupyter shows a thread's output under
    the cell that started it. Called on the client's IO thread; it keeps the cell's own
    streams only while someone else does (the lane remembers it for many cells)."""
    ranks = list(ranks)
    refs = {"stdout": _weak(out), "stderr": _weak(err)}

    def late(i: int, name: str, text: str) -> None:
        ref = refs[name]
        stream = ref() if ref is not None else getattr(sys, name)
        if stream is None:
            return  # (the cell's own stream, since dropped)
        lines = _prefixed([ranks[i]], text.splitlines())
        if request is not None and hasattr(stream, "set_thread_parent"):  # ipykernel's
            token = stream.set_thread_parent(request)
            try:
                stream.write(lines)  # (held under the request until it is sent)
            finally:
                stream.reset_thread_parent(token)
        else:
            stream.write(lines)
        stream.flush()  # before whatever the rank sent after it

    return late


def _weak(stream: TextIO | None) -> Callable[[], TextIO | None] | None:
    if stream is None:
        return None
    try:
        return weakref.ref(stream)
    except TypeError:  # (a stream that cannot be referred to weakly: kept)
        return lambda: stream
