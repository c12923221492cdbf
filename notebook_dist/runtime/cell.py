"""Run one cell on a rank: compile with notebook line numbers, keep the last value.

Returns a packed result (see ``notebook_dist.values.pack``) so tensors travel out of
band. Exceptions never escape: they come back as a traceback trimmed to the user's
frames, and the exception object stays on the rank for post-mortem inspection.
"""

from __future__ import annotations

import ast
import linecache
import sys
import traceback
from typing import Any

from ..values import describe_unpicklable, pack
from .state import STATE, user_namespace


def _drain_fd(stream, timeout: float = 5.0) -> None:
    """Wait until what the cell wrote to the stream's file descriptor (os.write, C
    libraries, subprocesses) has been read by ipykernel's pipe thread, so it is part of
    this cell's output and not the next one's."""
    import fcntl
    import termios
    import time

    fid, thread = getattr(stream, "_fid", None), getattr(stream, "watch_fd_thread", None)
    if fid is None or thread is None or not thread.is_alive():
        return
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fid, termios.FIONREAD, buf)
        except OSError:
            return
        frame = sys._current_frames().get(thread.ident)
        # empty pipe, and the thread back in os.read: everything read has been written
        if int.from_bytes(buf, sys.byteorder) == 0 and _reading(frame):
            return
        time.sleep(0.001)


def _reading(frame) -> bool:
    if frame is None or frame.f_code.co_name != "_watch_pipe_fd":
        return True  # not the thread we know: nothing to wait for
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return "os.read(" in line


def _register_source(filename: str, source: str) -> None:
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def format_exception(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame in the cell down, as Python prints it, without
    the tool's own frames (the tracker's wrapper around a collective)."""
    from .tracker import is_tool_frame

    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    for i, fs in enumerate(frames):
        if fs.filename == filename:
            frames = frames[i:]
            break
    te.stack = traceback.StackSummary.from_list(
        [fs for fs in frames if not is_tool_frame(fs.filename)]
    )
    return "".join(te.format())


def _error(exc: BaseException, filename: str) -> dict:
    return {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": format_exception(exc, filename),
    }


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
) -> list:
    """Execute ``code`` in the rank's namespace; return ``pack(result)``.

    ``source`` is the cell as the notebook shows it (for tracebacks) and ``first_line``
    the notebook line number of ``code``'s first line. ``profile`` (``"aligned"`` when
    every rank runs the cell, ``"alone"`` otherwise) runs it under torch.profiler.
    ``check_collectives`` compares each collective's arguments across ranks first
    (``notebook_dist.runtime.argcheck``).
    """
    import time

    from .tracker import TRACKER

    ns = user_namespace()
    _register_source(filename, source)
    result: dict[str, Any] = {"rank": STATE.rank, "status": "ok", "has_value": False}
    prof = None
    if profile:
        from .profiler import CellProfile

        prof = CellProfile(align=profile == "aligned")
    TRACKER.reset_cell(keep_all=prof is not None)
    TRACKER.check = check_collectives
    STATE.reset_cell(time.time(), token, filename)
    STATE.last_error = None  # %dist_debug looks at the last cell only
    STATE.last_exit = None
    if prof is not None:
        prof.__enter__()
    try:
        tree = ast.parse(code, filename=filename)
        ast.increment_lineno(tree, first_line - 1)
        last = None
        if want_value and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            result["value"] = eval(compile(last, filename, "eval"), ns)
            result["has_value"] = True
    except SystemExit as exc:  # exit(), quit(), sys.exit(): the cell ends, the rank stays
        from .exits import report

        result["exited"] = STATE.last_exit = report(exc, filename)
    except BaseException as exc:  # KeyboardInterrupt included: the engine lives on
        STATE.last_error = (exc, exc.__traceback__)
        result["status"] = "error"
        result["error"] = _error(exc, filename)
        failed = TRACKER.last
        in_collective = failed is not None and bool(failed.get("failed"))
        if in_collective:
            seq = f" #{failed['seq']}" if "seq" in failed else ""
            result["error"]["collective"] = f"{failed['op']}{seq}"
            result["error"]["record"] = dict(failed)
        from .group import note_failure

        note_failure(exc, in_collective)
        result.pop("value", None)
        result["has_value"] = False
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
        STATE.cell_state = result["status"] if result["status"] == "error" else "done"
        for stream in (sys.stdout, sys.stderr):
            _drain_fd(stream)
            stream.flush()
    result["collectives"] = TRACKER.count
    result["group_broken"] = STATE.group_broken
    if prof is not None:
        result["profile"] = prof.collect(list(TRACKER.history))
    result["wait_s"] = TRACKER.wait_s
    from .agent import snapshot

    final = snapshot(with_stack=False)  # the state at the end, even if the agent never reported
    result["final"] = final
    gathered, missing = {}, []
    for name in gather:
        if name in ns:
            gathered[name] = ns[name]
        else:
            missing.append(name)
    result["gather"] = gathered
    result["missing"] = missing
    try:
        return pack(result, shm_dir)
    except Exception:
        pass
    # find exactly what cannot travel, and say so
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
    return pack(result, shm_dir)


def run_cell_request(request: tuple) -> list:
    """:func:`run_cell` with its arguments in one tuple: one object for ipyparallel to
    serialise per message instead of seven (this is on every cell's critical path)."""
    return run_cell(*request)


def push_values(*frames: Any) -> list[str]:
    """Bind the names in a packed ``{name: value}`` into the rank's namespace."""
    from ..values import unpack

    values = unpack(list(frames))
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
    return pack(
        {"rank": STATE.rank, "values": found, "missing": missing, "unpicklable": bad}, shm_dir
    )
