"""Run one cell on a rank: compile with notebook line numbers, keep the last value.

Returns a packed result (see ``notebook_dist.values.pack``) so tensors travel out of
band. Exceptions never escape: they come back as a traceback trimmed to the user's
frames, and the exception object stays on the rank for post-mortem inspection.
"""

from __future__ import annotations

import ast
import bdb
import linecache
import sys
import time
import traceback
import types
from typing import Any

from ..values import describe_unpicklable, pack, through_file, unpack
from . import recover, tracker
from .agent import snapshot, sparse
from .group import note_env_changes, note_failure
from .launch import check_children
from .state import STATE, user_namespace
from .streams import drain
from .workspace import follow


def _register_source(filename: str, source: str) -> None:
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def format_exception(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame in the cell down, as Python prints it, without
    the tool's own frames (the tracker's wrapper around a collective)."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    for i, fs in enumerate(frames):
        if fs.filename == filename:
            frames = frames[i:]
            break
    te.stack = traceback.StackSummary.from_list(
        [fs for fs in frames if not tracker.is_tool_frame(fs.filename)]
    )
    return "".join(te.format())


def _error(exc: BaseException, filename: str) -> dict:
    from .hints import gpu_hint

    error = {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": format_exception(exc, filename),
    }
    hint = gpu_hint(exc)
    if hint:  # the error ends with the one sentence that says what to change
        error["hint"] = hint
        error["traceback"] += f"notebook_dist: {hint}\n"
    return error


def run_cell(
    code: str,
    filename: str,
    source: str,
    first_line: int,
    gather: list[str],
    want_value: bool,
    token: str = "",
    shm_dir: str | None = None,
    profile: str | None = None,
    check_collectives: bool = False,
    argv: list[str] | None = None,
    cwd: str | None = None,
    paths: list[str] | None = None,
    post_mortem: bool = False,
    group_bars: bool = False,
) -> list:
    """Execute ``code`` in the rank's namespace; return ``pack(result)``.

    ``source`` is the cell as the notebook shows it (for tracebacks) and ``first_line``
    the notebook line number of ``code``'s first line. ``profile`` (``"aligned"`` when
    every rank runs the cell, ``"alone"`` otherwise) runs it under torch.profiler.
    ``check_collectives`` compares each collective's arguments across ranks first
    (``notebook_dist.runtime.argcheck``). ``sys.argv`` is what a script run with ``argv``
    would have (``--args``; none by default), so argparse takes its defaults. ``cwd`` and
    ``paths``: the notebook's folder and the import paths it added, followed here.
    ``post_mortem``: a rank that raises opens the debugger where it raised (``%pdb on``).
    ``group_bars``: the notebook shows the ranks' alike progress bars as one
    (``runtime/bars.py``).
    """
    follow(cwd, paths)
    _register_source(filename, source)
    prof = _begin(token, filename, profile, check_collectives)
    STATE.group_bars = group_bars
    sys.argv = [filename, *(argv or ())]
    result: dict[str, Any] = {"rank": STATE.rank, "status": "ok", "has_value": False}
    ran = False
    try:
        while True:
            try:
                if not ran:
                    ran = True
                    _execute(code, filename, first_line, want_value, result, prof, post_mortem)
                end_cell(result["status"])
                break
            except recover.CollectiveReleased as exc:
                # a release that landed after the user's code, before the cell ended: the
                # cell's own outcome stands (the notebook rebuilds the group it released),
                # unless it landed while that outcome was being written
                if result["status"] == "error" and "error" not in result:
                    _record_error(exc, filename, result)
    finally:
        if STATE.cell_state == "running":
            # a Ctrl-C that landed in our own handling of the cell's end (a SIGINT that
            # waited while the rank was blocked in Gloo is raised as the collective returns,
            # inside the except clause that records its error) ends the cell all the same: a
            # release asked for it, coming late, must never close the group rebuilt after it
            end_cell("error")
    note_env_changes()
    drain()
    return _reply(result, gather, shm_dir, prof)


def _begin(token: str, filename: str, profile: str | None, check: bool):
    """The rank's state for a new cell; its profiler, started, if it is profiled."""
    TRACKER = tracker.TRACKER
    prof = None
    if profile:
        from .profiler import CellProfile

        prof = CellProfile(align=profile == "aligned")
    TRACKER.reset_cell(keep_all=prof is not None)
    TRACKER.check = check
    STATE.reset_cell(time.time(), token, filename)
    STATE.last_error = None  # %dist_debug looks at the last cell only
    STATE.last_exit = None
    if prof is not None:
        prof.__enter__()
    return prof


def _execute(
    code: str,
    filename: str,
    first_line: int,
    want_value: bool,
    result: dict,
    prof,
    post_mortem: bool = False,
):
    """The user's code, with notebook line numbers; its value or its error into ``result``."""
    ns = user_namespace()
    try:
        # blank lines first give every node its notebook line as it is parsed (moving each
        # node's line afterwards walks the whole tree: 40% of a long cell's compile here)
        tree = ast.parse("\n" * (first_line - 1) + code, filename=filename)
        last = None
        if want_value and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            result["value"] = eval(compile(last, filename, "eval"), ns)
            result["has_value"] = True
        check_children()  # never green when a process the cell started failed
    except SystemExit as exc:  # exit(), quit(), sys.exit(): the cell ends, the rank stays
        from .exits import report

        result["exited"] = STATE.last_exit = report(exc, filename)
    except bdb.BdbQuit:  # q in the debugger: the cell ends here, as an interrupt does
        result["quit"] = True
    except BaseException as exc:  # KeyboardInterrupt included: the engine lives on
        _record_error(exc, filename, result)
        if post_mortem and not isinstance(exc, (KeyboardInterrupt, recover.CollectiveReleased)):
            from .debugger import post_mortem as debug_it

            try:
                debug_it(exc.__traceback__, filename)  # the cell's frames, live, on this rank
            except bdb.BdbQuit:
                pass
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)


def _record_error(exc: BaseException, filename: str, result: dict) -> None:
    STATE.last_error = (exc, exc.__traceback__)
    STATE.extras["post_mortem"] = (exc.__traceback__, filename)  # for %debug, later
    result["status"] = "error"
    result["error"] = _error(exc, filename)
    failed = tracker.TRACKER.last
    in_collective = failed is not None and bool(failed.get("failed"))
    if in_collective:
        seq = f" #{failed['seq']}" if "seq" in failed else ""
        result["error"]["collective"] = f"{failed['op']}{seq}"
        result["error"]["record"] = dict(failed)
    note_failure(exc, in_collective)
    result.pop("value", None)
    result["has_value"] = False


def end_cell(status: str) -> None:
    """The cell is over on this rank: under the lock a release takes, so a release either
    happened while the cell ran or sees it ended and does nothing; an exception a release
    had already scheduled for the main thread is cancelled."""
    with recover._GROUP_LOCK:
        STATE.cell_state = "error" if status == "error" else "done"
        recover.cancel_pending_release()


def _reply(result: dict, gather: list[str], shm_dir: str | None, prof) -> list:
    """The packed result: counts, the profile, the final snapshot, the gathered variables;
    what cannot travel is said exactly."""
    TRACKER = tracker.TRACKER
    ns = user_namespace()
    result["collectives"] = TRACKER.count
    result["group_broken"] = STATE.group_broken
    if prof is not None:
        result["profile"] = prof.collect(list(TRACKER.history))
    result["wait_s"] = TRACKER.wait_s
    result["final"] = sparse(snapshot(with_stack=False))  # the state at the end, always
    gathered = {name: ns[name] for name in gather if name in ns}
    result["gather"] = gathered
    result["missing"] = [name for name in gather if name not in ns]
    try:
        frames = pack(result, shm_dir)
    except Exception:
        frames = pack(_without_unpicklable(result, gathered), shm_dir)
    return _for_notebook(frames, shm_dir)


def _for_notebook(frames: list, shm_dir: str | None) -> list:
    """A rank's packed reply for the notebook on its machine: a MiB or more of it through a
    file in ``shm_dir`` where there is room, otherwise the frames as they are."""
    return through_file(frames, shm_dir) or frames


def _without_unpicklable(result: dict, gathered: dict) -> dict:
    """``result`` without what cannot be pickled, each part named in its error."""
    problems = []
    if result.get("has_value"):
        try:
            pack(result["value"])
        except Exception as exc:
            problems.append(f"the cell's value: {describe_unpicklable(result['value'], exc)}")
            result["value"] = None
            result["has_value"] = False
    for name in list(gathered):
        try:
            pack(gathered[name])
        except Exception as exc:
            problems.append(f"variable {name!r}: {describe_unpicklable(gathered[name], exc)}")
            del gathered[name]
    if result["status"] == "ok":
        result["status"] = "error"
        msg = "cannot send to the notebook: " + "; ".join(problems)
        result["error"] = {
            "ename": "TransferError",
            "evalue": msg,
            "traceback": f"TransferError: {msg}\n",
        }
    return result


def run_cell_request(request: tuple) -> list:
    """:func:`run_cell` with its arguments in one tuple, the options last as a dict: one
    object for ipyparallel to serialise per message (this is on every cell's critical path)."""
    *args, options = request
    return run_cell(*args, **options)


def push_values(*frames: Any) -> list[str]:
    """Bind the names in a packed ``{name: value}`` into the rank's namespace."""
    values = unpack(list(frames), consume=False)  # (every rank reads the same)
    user_namespace().update(values)
    return sorted(values)


def pull_values(names: list[str], shm_dir: str | None = None) -> list:
    """Pack ``{name: value}`` for the names asked; missing or unpicklable ones are reported."""
    ns = user_namespace()
    found, missing, bad = {}, [], {}
    for name in names:
        if name not in ns:
            missing.append(name)
            continue
        try:
            pack(ns[name])
        except Exception as exc:
            bad[name] = describe_unpicklable(ns[name], exc)
            continue
        found[name] = ns[name]
    frames = pack(
        {"rank": STATE.rank, "values": found, "missing": missing, "unpicklable": bad}, shm_dir
    )
    return _for_notebook(frames, shm_dir)


def call_packed(frames: list, shm_dir: str | None = None) -> list:
    """A packed ``(func, args, kwargs)`` called (``DistCluster.apply`` by the express
    route), its return packed as a cell's value is: a MiB or more of it through a file in
    ``shm_dir``, for the notebook on this machine to read. A function the notebook
    defined comes made by :func:`rank_function`."""
    func, args, kwargs = unpack(list(frames), consume=False)  # (every rank reads the same)
    value = func(*args, **kwargs)
    try:
        out = pack(value, shm_dir)
    except Exception as exc:
        raise TypeError(
            f"{getattr(func, '__name__', func)} returned what cannot be sent to the notebook: "
            + describe_unpicklable(value, exc)
        ) from None
    return _for_notebook(out, shm_dir)


def rank_function(code, name: str, defaults, closure, kwdefaults, qualname: str, attrs):
    """A function the notebook defined (its module ``__main__``), made with the rank's
    namespace as its globals: a name in it means the rank's variable, as through
    ipyparallel's own calls (the notebook sends its code, not its values of the names it
    reads: ``cluster.cells``)."""
    made = types.FunctionType(code, user_namespace(), name, defaults, closure)
    made.__kwdefaults__, made.__qualname__ = kwdefaults, qualname
    made.__dict__.update(attrs or {})
    return made
