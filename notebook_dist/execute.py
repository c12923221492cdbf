"""Kernel side of running a cell: prepare it, and collect its results (the ranks' output
is ``notebook_dist.output``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import CellSyntaxError, RemoteTraceback
from .values import RankValues


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
    #: whether the ranks' alike tracebacks show once, as their output was folded
    fold: bool = False

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

            raise RankError(self.errors, self.fold)


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
