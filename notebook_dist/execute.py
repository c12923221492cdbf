"""Kernel side of running a cell: prepare it, stream the ranks' output, collect results."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from .errors import CellSyntaxError, RemoteTraceback
from .values import RankValues

# shown per rank and stream, per cell; the rest goes to a log file (a rank printing
# 100 MB must not freeze the notebook)
MAX_LINES_PER_RANK = 2000
MAX_BYTES_PER_RANK = 1 << 20


@dataclass(frozen=True)
class PreparedCell:
    code: str  # plain Python, IPython syntax already transformed
    source: str  # the cell as the notebook shows it, for tracebacks
    filename: str
    first_line: int  # notebook line number of code's first line
    want_value: bool


def prepare_cell(cell: str, filename: str = "<cell>", header: str | None = None) -> PreparedCell:
    """Transform IPython syntax, check it compiles, and decide whether to keep the value.

    ``header`` is the magic line the notebook shows above ``cell`` (``%%distributed``);
    it is line 1, so the cell's first line is line 2, as in the notebook.
    """
    from IPython.core.inputtransformer2 import TransformerManager

    first_line = 2 if header is not None else 1
    source = (header + "\n" + cell) if header is not None else cell
    _check_encodable(cell, filename, source, first_line)
    try:
        code = TransformerManager().transform_cell(cell)
    except SyntaxError as exc:
        raise _syntax_error(exc, filename, source, first_line) from None
    try:
        compile(code, filename, "exec")
    except SyntaxError as exc:
        raise _syntax_error(exc, filename, source, first_line) from None
    return PreparedCell(code, source, filename, first_line, _wants_value(cell))


def _check_encodable(cell: str, filename: str, source: str, first_line: int) -> None:
    """A cell holding text that is not valid Unicode (a lone surrogate, as undecodable
    bytes become) is refused with its line, before anything runs."""
    try:
        cell.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = cell[exc.start]
        lineno = cell.count("\n", 0, exc.start) + first_line
        offset = exc.start - (cell.rfind("\n", 0, exc.start) + 1) + 1
        raise CellSyntaxError(
            f"the cell holds {bad!r}, which is not valid text (undecodable bytes?): remove it, "
            f"or write it as the escape {ascii(bad)[1:-1]} inside a string",
            filename,
            lineno,
            offset,
            source.splitlines()[lineno - 1].encode("utf-8", "replace").decode(),
        ) from None


def _syntax_error(exc: SyntaxError, filename: str, source: str, first_line: int) -> CellSyntaxError:
    lineno = (exc.lineno or 1) + first_line - 1
    lines = source.splitlines()
    text = lines[lineno - 1] if 0 < lineno <= len(lines) else exc.text
    return CellSyntaxError(exc.msg, filename, lineno, exc.offset, text)


def _wants_value(cell: str) -> bool:
    """A trailing ``;`` hides the value, as in IPython."""
    for line in reversed(cell.splitlines()):
        code = line.split("#", 1)[0].rstrip()
        if code:
            return not code.endswith(";")
    return False


class OutputStreamer:
    """Copies each rank's stdout/stderr to the notebook as it arrives, tagged by rank.

    Reads the growing per-message output that ipyparallel accumulates; complete lines
    are written at once, a partial line waits for its end (or for the cell's end).
    """

    def __init__(
        self,
        sources: list[tuple[int, dict]],
        out: TextIO | None = None,
        err: TextIO | None = None,
        max_lines: int = MAX_LINES_PER_RANK,
        max_bytes: int = MAX_BYTES_PER_RANK,
        log_name: str = "cell",
    ):
        self.sources = sources  # (rank, ipyparallel metadata dict of that rank's message)
        self.out = out
        self.err = err
        self.max_lines = max_lines  # per rank and stream; the rest goes to a log file
        self.max_bytes = max_bytes
        self._bytes: dict[tuple[int, str], int] = {}
        self.log_name = log_name
        self._shown: dict[tuple[int, str], int] = {}
        self._logs: dict[tuple[int, str], Any] = {}
        self.dropped: dict[tuple[int, str], int] = {}
        self._offsets: dict[tuple[int, str], int] = {}
        self._partial: dict[tuple[int, str], str] = {}
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
                    self._log(key, text[start:])
                    continue
                self._emit(rank, name, self._partial.pop(key, "") + text[start:], text, start)
            self._republish_outputs(rank, md)

    def _emit(self, rank: int, name: str, text: str, full: str = "", start: int = 0) -> None:
        key = (rank, name)
        *lines, rest = text.split("\n")
        shown, nbytes = self._shown.get(key, 0), self._bytes.get(key, 0)
        keep = []
        capped = False
        for line in lines:
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
        if capped:
            self._partial.pop(key, None)
            self._start_log(key, full)
        self._shown[key], self._bytes[key] = shown, nbytes
        lines = keep
        if lines:
            for line in reversed(lines):
                if line.strip():
                    self.last_line[rank] = line
                    break
            prefix = f"[rank {rank}] "
            stream = self._stream(name)
            stream.write("".join(f"{prefix}{line}\n" for line in lines))
            stream.flush()
            self.lines_written += len(lines)

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

    def _log(self, key: tuple[int, str], text: str) -> None:
        self._logs[key].write(text)

    def _republish_outputs(self, rank: int, md: dict) -> None:
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
            publish_display_data(data, output.get("metadata", {}))

    def finish(self) -> None:
        self.poll()
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
            stream = self._stream(name)
            stream.write(f"[rank {rank}] {rest}\n")
            stream.flush()
            self.lines_written += 1
        self._partial.clear()


def _count_lines(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n


@dataclass
class CellResult:
    """What a cell produced on the ranks that ran it."""

    ranks: list[int]
    values: RankValues | None = None
    gathered: dict[str, RankValues] = field(default_factory=dict)
    errors: dict[int, RemoteTraceback] = field(default_factory=dict)
    elapsed_s: float = 0.0
    released: list[int] = field(default_factory=list)
    profile: Any = None  # notebook_dist.profile.Profile, for a cell run with profile=True
    #: ranks whose cell ended itself (exit(), sys.exit()): notebook_dist.runtime.exits.report
    exits: dict[int, dict] = field(default_factory=dict)

    def exit_note(self) -> str:
        """The one line for the ranks whose cell called exit() or sys.exit(); "" if none."""
        if not self.exits:
            return ""
        from .phrases import rank_list

        groups: dict[tuple, list[int]] = {}
        for rank, e in sorted(self.exits.items()):
            groups.setdefault((e["called"], e["code"], e["message"], e["line"]), []).append(rank)
        parts = []
        for (called, code, message, line), ranks in groups.items():
            where = f" at line {line}" if line else ""
            said = f": {message}" if message else ""
            parts.append(f"{rank_list(ranks)} called {called}{where} (exit code {code}{said})")
        these = (
            "that rank, which stays running with its variables"
            if len(self.exits) == 1
            else "those ranks, which stay running with their variables"
        )
        return f"notebook_dist: {'; '.join(parts)}. The cell ended there on {these}."

    def raise_for_errors(self) -> None:
        if self.errors:
            from .errors import RankError

            raise RankError(self.errors)


def collect(ranks: list[int], results: list[dict[str, Any]], gather: list[str]) -> CellResult:
    """Fold per-rank result dicts (from ``runtime.cell.run_cell``) into a CellResult."""
    out = CellResult(ranks=list(ranks))
    values: dict[int, Any] = {}
    any_value = False
    gathered: dict[str, dict[int, Any]] = {name: {} for name in gather}
    for rank, res in zip(ranks, results):
        if res["status"] == "error":
            e = res["error"]
            out.errors[rank] = RemoteTraceback(e["ename"], e["evalue"], e["traceback"])
        if res.get("exited"):
            out.exits[rank] = res["exited"]
        if res.get("has_value") and res.get("value") is not None:
            any_value = True  # as in IPython, a None value shows nothing
        values[rank] = res.get("value")
        for name, value in res.get("gather", {}).items():
            gathered[name][rank] = value
        if res["status"] == "ok" and res.get("missing"):
            names = ", ".join(repr(n) for n in res["missing"])
            msg = f"--gather {names}: not defined on rank {rank} after the cell ran"
            out.errors[rank] = RemoteTraceback("NameError", msg, f"NameError: {msg}\n")
    if any_value:
        out.values = RankValues(values)
    out.gathered = {name: RankValues(v, name=name) for name, v in gathered.items() if v}
    return out
