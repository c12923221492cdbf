"""A debugger and ``input()`` on a rank, answered from the notebook.

An engine's stdin is at its end: ``breakpoint()`` returned at once and ``input()`` raised
EOFError. Here a rank that needs a line *asks*: :func:`ask` puts its prompt in the rank's
report (published at once), and waits for the line the notebook writes to the rank's answer
file, which the agent thread reads. The notebook asks its user through the kernel's own
stdin (JupyterLab's input box), with the rank in the prompt (``[rank 1] (Pdb) ``).

- ``breakpoint()``, ``pdb.set_trace()`` and ``torch.distributed.breakpoint()`` stop the
  rank that calls them in :class:`RankPdb`, a pdb whose prompts are asked this way;
- ``input(prompt)`` asks the same way and returns the answer on that rank;
- a cell run with post-mortem on (IPython's ``%pdb on``, ``%%distributed --pdb``) opens the
  debugger where a rank raised, in the cell's own frames only; ``%debug`` after a failed
  cell does the same later (:func:`post_mortem`).
"""

from __future__ import annotations

import builtins
import itertools
import os
import pdb
import queue
import sys

from .state import STATE
from .tracker import CELL_PREFIX

_ids = itertools.count(1)


def _cell_where(frame) -> tuple[str, int] | None:
    while frame is not None:
        if frame.f_code.co_filename.startswith("Cell In["):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def ask(prompt: str, kind: str = "input", where: tuple[str, int] | None = None) -> str:
    """A line from the notebook's user: the prompt goes in this rank's report; the answer
    comes back through the agent. Interruptible (the stop button ends the wait)."""
    from .agent import publish, snapshot

    request = next(_ids)
    for stream in (sys.stdout, sys.stderr):  # what the rank printed first is seen first
        stream.flush()
    STATE.asking = {
        "id": request,
        "prompt": prompt,
        "kind": kind,
        "where": where or _cell_where(sys._getframe(1)),
    }
    publish(snapshot())
    try:
        while True:
            try:
                got, text = STATE.answers.get(timeout=0.1)
            except queue.Empty:
                continue
            if got == request:
                if text == "\x04":  # the notebook cannot answer: the end of the input
                    raise EOFError("the notebook's front end cannot answer input")
                return text
    finally:
        STATE.asking = None


class RankPdb(pdb.Pdb):
    """pdb whose every prompt is asked through the notebook (``[rank 1] (Pdb) ``)."""

    def __init__(self):
        # nosigint: the stop button interrupts the cell, as in any cell (pdb's own handler
        # would only stop at the next line)
        # skip: stepping never enters the tool's own frames (the collective tracker's wrapper)
        super().__init__(
            stdin=sys.stdin, stdout=sys.stdout, nosigint=True, skip=["notebook_dist.*"]
        )
        self.use_rawinput = True  # cmd.Cmd then calls input(): ours, below
        self.prompt = "(Pdb) "

    def canonic(self, filename: str) -> str:
        """A cell's name as it is (``Cell In[3]``, under which its source is kept): pdb made
        it a path in the working folder, where no source is, so the where-line had no
        ``-> line`` and ``list`` showed nothing."""
        if filename.startswith(CELL_PREFIX):
            return filename
        return super().canonic(filename)

    def setup(self, f, tb):
        """Where the debugger lands: never in the tool's own frames (an error raised by
        --check-collectives, the collective tracker's wrapper), but in the user's frame that
        called into them."""
        result = super().setup(f, tb)
        while self.curindex > 0 and _tool_frame(self.stack[self.curindex][0]):
            self.curindex -= 1
        self.curframe = self.stack[self.curindex][0]
        self.curframe_locals = self.curframe.f_locals
        return result

    def stop_here_now(self, frame) -> None:
        """The prompt at once, at ``frame``'s current line (pdb's set_trace stops at the
        next event instead): c goes on untraced; n, s or r stop again as asked; q quits."""
        import bdb

        self.reset()
        here = frame
        while frame is not None:  # as bdb's set_trace: every frame up to the outermost
            frame.f_trace = self.trace_dispatch
            self.botframe, frame = frame, frame.f_back
        self.interaction(here, None)
        if self.quitting:
            raise bdb.BdbQuit
        if not (self.stopframe is self.botframe and self.stoplineno == -1):
            sys.settrace(self.trace_dispatch)

    def cmdloop(self, intro=None):
        saved = builtins.input
        builtins.input = self._ask
        try:
            super().cmdloop(intro)
        finally:
            builtins.input = saved

    def _ask(self, prompt: str = "") -> str:
        frame = getattr(self, "curframe", None)
        where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
        try:
            return ask(prompt, "pdb", where)
        except KeyboardInterrupt:  # the stop button: leave the debugger, end the cell
            return "q"


def _tool_frame(frame) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("notebook_dist.")


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` and ``breakpoint()`` on a rank: stop here, asked from the notebook."""
    debugger = RankPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe(1))


#: how often each torch.distributed.breakpoint() call site was reached (for ``skip``)
_reached: dict[tuple[str, int], int] = {}


def dist_breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """``torch.distributed.breakpoint(rank, skip, timeout_s)`` as torch's own (which opens
    /dev/stdin instead): ``rank`` stops in the debugger and the others wait for it in a
    barrier; the first ``skip`` times this call site is reached pass by; every group's
    collective timeout is raised to ``timeout_s`` first, never lowered, so the barrier
    outlasts the session."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)
    _reached[site] = _reached.get(site, 0) + 1
    if _reached[site] <= skip:
        return
    if timeout_s is not None and (STATE.timeout_s or 0) < timeout_s:
        for group in list(getattr(c10d, "_pg_map", {})):
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    if dist.get_rank() == rank:
        RankPdb().stop_here_now(caller)
    dist.barrier()


def post_mortem(tb=None, cell_file: str | None = None) -> None:
    """The debugger where a cell raised, its frames from the cell's own down (never the
    tool's): ``tb`` (default: the last failed cell's on this rank)."""
    if tb is None:
        saved = STATE.extras.get("post_mortem")
        if saved is None:
            raise RuntimeError("no cell has raised on this rank: there is nothing to debug")
        tb, cell_file = saved
    while tb is not None and cell_file and tb.tb_frame.f_code.co_filename != cell_file:
        tb = tb.tb_next
    if tb is None:
        return
    debugger = RankPdb()
    debugger.reset()
    debugger.interaction(None, tb)


def install() -> None:
    """breakpoint(), pdb.set_trace, torch.distributed.breakpoint and input() ask the notebook."""
    sys.breakpointhook = set_trace
    os.environ.pop("PYTHONBREAKPOINT", None)
    pdb.set_trace = set_trace
    builtins.input = lambda prompt="": ask(str(prompt), "input")
    try:
        import torch.distributed as dist

        dist.breakpoint = dist_breakpoint
    except ImportError:
        pass
