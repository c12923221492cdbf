"""``exit()``, ``quit()`` and ``sys.exit()`` in a cell end the cell on that rank, not the rank.

Code pasted from a script calls them to stop (FSDP2's example does when it finds no GPU).
In a script they raise ``SystemExit``; in an ipyparallel engine IPython's ``exit()`` raises
nothing, lets the rest of the cell run, and then ends the engine. Here the ranks behave as
the script meant, and keep their variables:

- ``exit``/``quit`` in the rank's namespace raise ``SystemExit`` as in a script;
- the engine's shell keeps the engine when anything asks it to exit;
- :func:`report` says where the cell ended, for the notebook's one note
  (``notebook_dist.execute.CellResult.exit_note``).
"""

from __future__ import annotations

from typing import Any


class ScriptExit:
    """What ``exit``/``quit`` are in a script (``site.Quitter``): calling raises SystemExit."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() to end this cell on this rank (the rank stays)"

    def __call__(self, code: Any = None):
        exc = SystemExit(code)
        exc.called = f"{self.name}()"  # type: ignore[attr-defined]
        raise exc


def install(ns: dict) -> None:
    """Script-like ``exit`` and ``quit`` in the namespace, and an engine that never ends on
    ``ask_exit`` (IPython's ``exit`` held elsewhere, ``get_ipython().ask_exit()``)."""
    ns["exit"], ns["quit"] = ScriptExit("exit"), ScriptExit("quit")
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and hasattr(shell, "keepkernel_on_exit"):
        shell.keepkernel_on_exit = True  # ask_exit then leaves exit_now False


def report(exc: SystemExit, filename: str) -> dict:
    """How and where a cell ended itself: {"called", "code", "message", "line"}."""
    code = exc.code
    message = ""
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        message, code = str(code), 1
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return {
        "called": getattr(exc, "called", "sys.exit()"),
        "code": code,
        "message": message,
        "line": line,
    }
