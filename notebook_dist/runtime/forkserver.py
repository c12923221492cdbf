"""The fork server: one process that imports torch and the engine's modules once, then
forks a cluster's local engines from itself (``python -m notebook_dist.runtime.forkserver``).

Each engine otherwise imports torch on its own (about 1.5 s of CPU here): on a machine
with fewer cores than ranks, starting 16 engines cost 16 imports side by side. A forked
engine shares the server's imported pages until it writes them, so it starts in the time
of an ipyparallel engine's own start-up and costs less memory while idle.

The server is started by the kernel (``notebook_dist.cluster.forks``) and speaks JSON
lines over its stdin and stdout:

- ``{"ready": pid}`` once the imports are done (with ``"failed"``, the essential ones that
  failed, and the server ends: the kernel then starts each engine itself);
- ``{"fork": ID, "argv": [...], "env": {...}, "cwd": DIR, "out": FILE}`` asks for an
  engine; the answer is ``{"forked": ID, "pid": PID}`` (or ``"error"``);
- ``{"exited": PID, "code": CODE}`` is said when an engine ends (negative: the signal
  that ended it, as ``subprocess`` says it);
- ``{"preload": true}`` imports what ranks load later (an optimizer's first use, DDP,
  a heal's fake group), for the engines forked after it: asked before the first spare,
  and before the ranks when they outnumber the cores.
- Started with ``--preload-when-idle S`` (a server started ahead, while the user reads
  on), it does that by itself once it has waited ``S`` seconds after its imports with
  nothing asked, and says ``{"preloaded": pid}``; anything asked first cancels it
  (``{"taken": true}``, sent when a cluster takes the server, asks for nothing else).
- Started with ``--remove-at-end FOLDER`` (the folder of a server started ahead, where
  its log is until a cluster takes it), it removes that folder as it ends, however it
  ends: a kernel killed before any cluster took the server cannot.

Nothing is forked while a thread runs or a ZeroMQ context exists (the server makes
neither); an engine starts a session of its own, as ipyparallel's launcher starts one,
with its output in its log file and nothing on stdin. The server ends when its stdin
closes (the cluster stopped, or the kernel is gone); its engines are not its to end.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time

from .imports import frozen_after

#: the module a forked engine runs, as ``python -m`` would
ENGINE_MODULE = "notebook_dist.runtime.engine"


#: what every engine imports before it is a rank (an engine's start, measured: these
#: are all but a few dozen small modules of what it has loaded once it has registered)
PREIMPORTS = (
    "torch",
    "torch.distributed",
    "ipyparallel.engine.app",
    "ipykernel.ipkernel",
    "ipykernel.debugger",  # without debugpy: see NOT_IMPORTED
    "IPython.core.completerlib",
    "IPython.core.oinspect",  # (the kernel's shell imports it as the engine registers)
    "IPython.extensions.storemagic",
    "sqlite3",  # the shell's history
    "importlib.readers",  # (the shell's colours are read as a package's resource: 8 ms)
    "tornado.gen",
    "tornado.platform.asyncio",  # (the kernel's event loop, as the engine registers)
    "tornado.queues",
    "faulthandler",
    "notebook_dist.signals",
    "notebook_dist.runtime.engine",
    "notebook_dist.runtime.exits",
    "notebook_dist.runtime.host",
    "notebook_dist.runtime.agent",
    "notebook_dist.runtime.bootstrap",
    "notebook_dist.runtime.debugger",
    "notebook_dist.runtime.launch",
    "notebook_dist.runtime.recover",
    "notebook_dist.runtime.subgroups",
    "notebook_dist.runtime.outstream",
    "notebook_dist.runtime.streams",
    "notebook_dist.runtime.tracker",
)


#: without these the server is of no use: the kernel starts each engine itself, and the
#: engine says why it cannot be a rank as it would without the server
ESSENTIAL = ("torch", "torch.distributed", "ipyparallel.engine.app")


#: kept out of the imports: ipykernel's Jupyter debugger imports debugpy (0.1 s here) to
#: serve a frontend's debug requests, which no engine is sent (a rank's debugger is
#: notebook_dist's own); a cell can still import debugpy
NOT_IMPORTED = ("debugpy",)


def preimport() -> list[str]:
    """:data:`PREIMPORTS`, without :data:`NOT_IMPORTED`; the essential ones that failed,
    with why."""
    import importlib

    failed = []
    hidden = [name for name in NOT_IMPORTED if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))  # (None: an ImportError to whoever asks)
    try:
        for name in PREIMPORTS:
            try:
                importlib.import_module(name)
            except Exception as exc:
                if name in ESSENTIAL:
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    shell_colours()
    return failed + cuda_started()


def shell_colours() -> None:
    """An engine's IPython shell reads its colour theme from a file in IPython's package
    the first time a process asks for it (in IPython 9): read here once, for every engine
    (in a forked engine, 4 ms of its start)."""
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
        from IPython.utils.PyColorize import theme_table

        theme_table[ZMQInteractiveShell.class_traits()["colors"].default_value]
    except Exception:  # (another IPython: each engine reads it, if it must)
        pass


def cuda_started() -> list[str]:
    """CUDA cannot be used in a child forked after it was initialised (torch then refuses:
    "Cannot re-initialize CUDA in forked subprocess"): nothing here may initialise it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return ["torch.cuda: CUDA was initialised in the fork server"]
    return []


def later_imports() -> None:
    """What a rank loads later (its first optimizer, a DDP module, a heal's fake group),
    for the engines forked afterwards (spares, a restart, a heal)."""
    from .heal import preload

    with frozen_after():
        preload()
    torch_caches_cleared()
    assert threading.active_count() == 1, "a thread was started while importing"
    assert not cuda_started(), "CUDA was initialised while importing"


def torch_caches_cleared() -> None:
    """What each rank's ``init_process_group`` clears, cleared once here: the lookups that
    torch._dynamo caches while the preload imports (a map of some 2,800 of torch's
    functions). Freed in each engine, their pages would be copied first (300 of the 7,000
    a forked rank copies)."""
    dynamo = sys.modules.get("torch._dynamo")
    clear = getattr(getattr(dynamo, "trace_rules", None), "clear_lru_cache", None)
    if clear is not None:
        try:
            clear()
        except Exception:
            pass


#: how often the server looks for ended engines without a wake-up (a safety net: every
#: SIGCHLD wakes it at once)
REAP_EVERY_S = 1.0


def main() -> None:
    commands, answers = _private_pipes()
    name_process(b"nd-fork-server")
    with frozen_after():
        failed = preimport()
    say = _sayer(answers)
    if failed:
        say({"ready": os.getpid(), "failed": failed})
        return
    assert threading.active_count() == 1, "a thread was started while importing"
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    say({"ready": os.getpid()})
    idle = _idle_preload_s(sys.argv[1:])
    preload_at = None if idle is None else time.monotonic() + idle
    pending = b""
    while True:
        wait = REAP_EVERY_S
        if preload_at is not None:
            wait = max(0.0, min(wait, preload_at - time.monotonic()))
        readable, _, _ = select.select([commands, wake_r], [], [], wait)
        if commands in readable:
            preload_at = None  # asked for something: the cluster decides from now on
        elif preload_at is not None and time.monotonic() >= preload_at:
            preload_at = None
            later_imports()
            say({"preloaded": os.getpid()})
        # the wake-ups are taken before the exits: an engine that ends after this read
        # leaves a byte for the next select (read after the reap, it could be taken
        # unseen, and that engine's end said only at the next request)
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(say)
        if commands not in readable:
            continue
        data = os.read(commands, 65536)
        if not data:
            return  # the kernel closed us (or is gone)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request.get("preload"):
                later_imports()
                continue
            if request.get("taken"):  # (a cluster took the server: only the wait ends)
                continue
            try:
                pid = _fork_engine(request, keep_fds=(commands, answers, wake_r, wake_w))
            except Exception as exc:  # the kernel says why the engine could not start
                say({"forked": request.get("fork"), "error": f"{type(exc).__name__}: {exc}"})
            else:
                say({"forked": request.get("fork"), "pid": pid})


def _idle_preload_s(argv: list[str]) -> float | None:
    """``--preload-when-idle S``: seconds to wait after the imports before loading what
    ranks load later, unless asked for something first (None: never by itself)."""
    if "--preload-when-idle" in argv:
        return float(argv[argv.index("--preload-when-idle") + 1])
    return None


def name_process(name: bytes) -> None:
    """The name ``ps -e``, ``top`` and ``pgrep`` show (a forked engine keeps the server's
    command line, which ``ps aux`` shows)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _private_pipes() -> tuple[int, int]:
    """The command pipes moved off fds 0 and 1, which become /dev/null and stderr (what
    an import prints must not reach the kernel as an answer)."""
    commands, answers = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return commands, answers


def _sayer(fd: int):
    def say(message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]

    return say


def _reap(say) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork_engine(request: dict, keep_fds: tuple[int, ...]) -> int:
    argv = list(request["argv"])
    if argv[1:3] != ["-m", ENGINE_MODULE]:
        raise ValueError(f"the fork server starts engines only, not {argv!r}")
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    # the engine says when it leads a session of its own: only then is its pid answered
    # (the kernel records it at once, as the leader of its group)
    led_r, led_w = os.pipe()
    prepared = prepared_for(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(out)
        os.close(led_w)
        os.read(led_r, 1)  # (empty if the child died first: its exit is said all the same)
        os.close(led_r)
        return pid
    code = 1
    try:
        os.close(led_r)
        os.setsid()
        os.write(led_w, b"1")
        os.close(led_w)
        _become_engine(request, argv, out, keep_fds)
        from .engine import main as engine_main

        code = 0
        engine_main(prepared)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _exit(code)
    return 0  # not reached


#: [how many modules were imported, their files one a line, their names] when last listed
_LISTED: list = [0, "", set()]
#: an engine's command line -> what it parses to (``engine.parse_command_line``)
_PARSED: dict = {}


def prepared_for(argv: list[str]):
    """What every engine forked with ``argv`` would otherwise work out itself, worked out
    here once (``engine.Prepared``): the file and the name of every imported module (listed
    again once more are imported), and what its command line parses to. In the server,
    whose pages its engines share, the first listing after a fork copies pages too, once; in
    each engine it would every time."""
    from .engine import Prepared, engine_args, parse_command_line

    if _LISTED[0] != len(sys.modules):
        names = list(sys.modules)
        modules = [sys.modules[name] for name in names]
        listed = [m.__file__ for m in modules if getattr(m, "__file__", None)]
        _LISTED[:] = [len(names), "\n".join(listed), set(names)]
    args = tuple(engine_args(argv[3:]))
    if args not in _PARSED:
        _PARSED[args] = parse_command_line(args)
    count, files, names = _LISTED
    return Prepared(files, names, count, args, _PARSED[args])


def _become_engine(request: dict, argv: list[str], out: int, keep_fds: tuple[int, ...]) -> None:
    """In the child: what a fresh ``Popen`` of the engine command would have been."""
    name_process(b"nd-engine")
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    started_in = os.getcwd()
    os.chdir(request.get("cwd") or started_in)
    if sys.path and sys.path[0] == started_in:  # ``python -m`` put the server's folder first
        sys.path[0] = os.getcwd()
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the server read it at import: keep the engine's
        sys.modules["torch"].set_num_threads(int(threads))
    import importlib.util

    spec = importlib.util.find_spec(ENGINE_MODULE)
    sys.argv = [spec.origin if spec and spec.origin else argv[2], *argv[3:]]


def _exit(code: int) -> None:
    """End the engine as an interpreter would: exit handlers, streams flushed."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def remove_at_end(argv: list[str]) -> None:
    """``--remove-at-end FOLDER``: the folder goes (what is left of it: a cluster that took
    the server moved its log out and removed it already)."""
    if "--remove-at-end" in argv:
        import shutil

        shutil.rmtree(argv[argv.index("--remove-at-end") + 1], ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    finally:  # (never in a forked engine: it leaves by os._exit)
        remove_at_end(sys.argv[1:])
