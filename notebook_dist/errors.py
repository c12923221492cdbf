"""Exceptions that reach the user, each rendered as a short, actionable message.

IPython calls ``_render_traceback_`` when an exception defines it, so these show
what happened on the ranks instead of a traceback through notebook_dist itself.
"""

from __future__ import annotations

from .phrases import alike, each_rank, rank_list


class NotebookDistError(Exception):
    """Base class: a problem the user can act on, shown without internal frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class UsageMistake(NotebookDistError):
    """Input the user can correct (an option, a rank, a name): the magics show it as
    IPython's ``UsageError``, one line, no traceback."""


class RankSpecError(UsageMistake, ValueError):
    """A ``--ranks`` specification that does not name ranks of this cluster."""


class PreflightError(UsageMistake, RuntimeError):
    """A cluster request that cannot work, refused before anything starts."""


class OptionError(UsageMistake, ValueError):
    """An option of a cell or a call that cannot be used as given."""


class NoClusterError(UsageMistake, RuntimeError):
    """Something that needs the ranks was asked for while no cluster runs."""


class ClusterError(NotebookDistError, RuntimeError):
    """The cluster could not start, is gone, or lost a rank."""


class TransferError(NotebookDistError, ValueError):
    """A value that cannot be moved between the notebook and a rank."""


class CellSyntaxError(NotebookDistError):
    """The cell does not compile; reported once, before any rank runs it.

    Not a SyntaxError subclass: IPython would render it as its own syntax error,
    pointing into notebook_dist instead of the cell.
    """

    def __init__(
        self, msg: str, filename: str, lineno: int | None, offset: int | None, text: str | None
    ):
        super().__init__(f"{msg} ({filename}, line {lineno})")
        self.msg, self.filename, self.lineno, self.offset, self.text = (
            msg,
            filename,
            lineno,
            offset,
            text,
        )

    def _render_traceback_(self) -> list[str]:
        out = [f'  File "{self.filename}", line {self.lineno}']
        if self.text:
            line = self.text.rstrip("\n")
            stripped = line.lstrip()
            out.append("    " + stripped)
            if self.offset:
                caret_at = max(self.offset - 1 - (len(line) - len(stripped)), 0)
                out.append("    " + " " * caret_at + "^")
        out.append(f"SyntaxError: {self.msg} (nothing ran on any rank)")
        return out


class RankError(NotebookDistError, RuntimeError):
    """One or more ranks raised while running a cell.

    ``errors`` maps rank -> ``RemoteTraceback``; the exception renders each rank's
    traceback once, with frames in the cell numbered as the notebook shows them. With
    ``fold`` (the cell's output was folded: ``DistConfig.fold_from_ranks``), ranks whose
    tracebacks are the same show one, and ranks whose tracebacks differ only in their last
    line (a message that names the rank) share the lines above it.
    """

    def __init__(self, errors: dict[int, RemoteTraceback], fold: bool = False):
        self.errors = dict(sorted(errors.items()))
        self.fold = fold
        super().__init__(_raised(self.errors))

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        for shown in _tracebacks(self.errors, self.fold):
            lines.extend(shown)
            lines.append("")
        lines.append(f"RankError: {self}")
        return lines


#: past this many different errors, the message names the first and counts the others
_SAID_APART = 3


def _raised(errors: dict[int, RemoteTraceback]) -> str:
    """'ranks 0-15 raised ValueError: bad value', each different error once; many different
    messages (one naming each rank): how many, and the first."""
    said = [(r, f"raised {e.ename}: {e.evalue}") for r, e in errors.items()]
    different = len({words for _, words in said})
    if different <= _SAID_APART:
        return each_rank(said)
    names = ", ".join(dict.fromkeys(e.ename for e in errors.values()))
    r0, first = said[0]
    return f"{rank_list(errors)} raised {names} ({different} different messages; rank {r0} {first})"


def _tracebacks(errors: dict[int, RemoteTraceback], fold: bool):
    """Each traceback shown, its lines prefixed with the ranks they are of."""
    if not fold:
        for rank, err in errors.items():
            yield [f"[rank {rank}] {line}" for line in err.traceback.rstrip("\n").splitlines()]
        return
    lines = {r: err.traceback.rstrip("\n").splitlines() or [""] for r, err in errors.items()}
    for above, ranks in alike(lines, key=lambda r: tuple(lines[r][:-1])).items():
        yield [f"[{rank_list(ranks)}] {line}" for line in above] + [
            f"[{rank_list(same)}] {last}"
            for last, same in alike(ranks, key=lambda r: lines[r][-1]).items()
        ]


class CellInterrupted(KeyboardInterrupt):
    """The cell was interrupted (Ctrl-C, the stop button) and the ranks were stopped.

    The tool's own message about the ranks is printed above; this renders as one short
    final line instead of a traceback through the kernel's machinery, and the cell still
    fails, so "Run All" stops. A KeyboardInterrupt, for code that catches those.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"CellInterrupted: {self}"]


class HangError(NotebookDistError, RuntimeError):
    """A cell stopped because it hung (``--on-hang stop``); the message is the verdict.

    The ranks were released and keep their variables; the process group was rebuilt.
    """


class RemoteTraceback:
    """An exception as it happened on a rank: name, message and formatted traceback."""

    def __init__(self, ename: str, evalue: str, traceback: str):
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback

    def __repr__(self) -> str:
        return f"RemoteTraceback({self.ename}: {self.evalue})"
