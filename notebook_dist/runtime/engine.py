"""Entry point of an engine process: ``python -m notebook_dist.runtime.engine``.

Starts importing torch in a background thread while the ipyparallel engine starts and
registers, so the two costs overlap instead of adding up (torch's import is ~3 s here).
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace
from typing import NamedTuple

from . import witness


def _preimport() -> None:
    import sys

    if "torch.distributed" in sys.modules:  # forked from a server that imported it
        return
    from .imports import frozen_after

    with frozen_after():  # (the engine's own imports meanwhile too)
        try:
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        except Exception:
            # the bootstrap imports torch again and reports the error with its rank
            pass


class Prepared(NamedTuple):
    """What the fork server worked out once for the engines it forks, which each engine
    would otherwise work out as it starts: forked, an engine shares the server's objects
    until it writes them, and a mere read of an object from Python writes its reference
    count, so each look at every module copies hundreds of pages (about 3.5 µs each here)."""

    #: the file of every imported module, one a line (:func:`modules_listed`)
    files: str
    #: the name of every imported module, and how many there were (:func:`modules_known`)
    names: set
    count: int
    #: the engine's command line (:func:`engine_args`), and what it parses to (its
    #: configuration and extra arguments: :func:`parse_command_line`), None if it did not
    args: tuple
    parsed: tuple | None


class _Modules:
    """``sys.modules`` as one of ipykernel's or IPython's start-up functions sees it:
    ``copy()`` or ``keys()`` answered as given; anything else is the real ``sys.modules``."""

    def __init__(self, real: dict, copy: dict | None = None, keys=None):
        self._real = real
        self._copy = copy
        self._keys = keys

    def copy(self) -> dict:
        return self._real.copy() if self._copy is None else self._copy

    def keys(self):
        return self._real.keys() if self._keys is None else self._keys

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __getitem__(self, key):
        return self._real[key]

    def __contains__(self, key) -> bool:
        return key in self._real

    def __iter__(self):
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


class _Sys:
    """The ``sys`` of a module whose start-up function looks at every module: ``modules``
    is a :class:`_Modules`, the rest the real ``sys``."""

    def __init__(self, real, modules: _Modules):
        self._real = real
        self.modules = modules

    def __getattr__(self, name):
        return getattr(self._real, name)


def _once_seeing(module, cls, name: str, modules: _Modules, after=None) -> None:
    """The next call of ``cls.name`` (then as it was) sees ``module``'s ``sys`` with
    ``modules`` for its ``sys.modules``; ``after(self)`` runs once it returned."""
    real_sys, method = module.sys, cls.__dict__[name]

    def once(self, *args, **kwargs):
        module.sys = _Sys(real_sys, modules)
        try:
            result = method(self, *args, **kwargs)
        finally:
            module.sys = real_sys
            setattr(cls, name, method)
        if after is not None:
            after(self)
        return result

    setattr(cls, name, once)


def modules_listed(files: str) -> None:
    """The kernel this engine starts lists the file of every imported module, for
    ipykernel's debugger, by touching each module object: 16 ms of a forked engine's start,
    among about 1,500 modules. The server listed the files before it forked (``files``, one
    a line), and the kernel takes that list instead, once; or an empty one where the
    debugger cannot start (without debugpy, which the server does not import: a rank's
    debugger is notebook_dist's own), as the list is of use to nothing else."""
    from ipykernel import debugger, ipkernel

    usable = getattr(debugger, "_is_debugpy_available", True)
    listed = {f: SimpleNamespace(__file__=f) for f in files.split("\n") if f} if usable else {}
    _once_seeing(
        ipkernel, ipkernel.IPythonKernel, "__init__", _Modules(ipkernel.sys.modules, listed)
    )


def modules_known(names: set, count: int) -> None:
    """IPython's shell notes which modules are imported as it starts (``%reset -a`` drops
    those imported later), as ``set(sys.modules.keys())`` in
    ``InteractiveShellApp.init_code``: in a forked engine, that copies the page of each
    module's name (about 900 pages, 3 ms). The server's set of ``names`` (``count`` of
    them) serves instead, with the modules this engine imported since: the last ones in
    ``sys.modules``, which keeps the order of import."""
    from IPython.core import shellapp

    def noted(app) -> None:
        names.update(imported_since(count))
        app.shell._sys_modules_keys = names

    nothing = _Modules(shellapp.sys.modules, keys=())
    _once_seeing(shellapp, shellapp.InteractiveShellApp, "init_code", nothing, after=noted)


def imported_since(count: int) -> list[str]:
    """The names of the modules imported after the first ``count``, read from the end of
    ``sys.modules`` (so the others are not touched)."""
    import itertools
    import sys

    return list(itertools.islice(reversed(sys.modules), max(0, len(sys.modules) - count)))


def engine_args(argv: list[str]) -> list[str]:
    """The command line the engine's application parses (``argv``: the process's, after
    the program): the rank's output streams first, so that one given after still wins."""
    from .outstream import FLAG

    return [FLAG, *argv]


def parse_command_line(args) -> tuple | None:
    """In the fork server: what the engine's command line ``args`` parses to, for every
    engine it forks with them (:func:`command_line_parsed`): (its configuration, the
    arguments left over), or None if it cannot be parsed (the engine then says why)."""
    import contextlib
    import io

    try:  # (the engine says what it finds wrong: not the server's log)
        with contextlib.redirect_stderr(io.StringIO()):
            from ipyparallel.engine.app import IPEngine

            app = IPEngine()
            app.parse_command_line(list(args))
            return app.cli_config, list(app.extra_args)
    except (Exception, SystemExit):
        return None


def command_line_parsed(args: tuple, parsed: tuple) -> None:
    """The engine's application takes its command line as the server parsed it
    (``parsed``, from :func:`parse_command_line`), once, when it is ``args``. Parsing it
    reads every configurable class's traits, ipyparallel's, IPython's and ipykernel's: in a
    forked engine that copies about 1,400 pages (8 ms of CPU)."""
    from ipyparallel.engine.app import IPEngine

    had = "parse_command_line" in IPEngine.__dict__
    parse = IPEngine.parse_command_line

    def parse_once(self, argv=None):
        if had:
            IPEngine.parse_command_line = parse
        else:
            del IPEngine.parse_command_line
        if argv is None or tuple(argv) != tuple(args):
            return parse(self, argv)
        config, extra = parsed
        self.argv = list(argv)
        self.cli_config = copy.deepcopy(config)
        self.update_config(self.cli_config)
        self.extra_args = list(extra)
        return None

    IPEngine.parse_command_line = parse_once


#: how often an engine that started before its controller looks for the controller's
#: connection file (ipyparallel's engine looks every 0.1 s)
CONTROLLER_FILE_POLL_S = 0.005


def controller_file_sooner(app) -> None:
    """``app`` (``ipyparallel.engine.app``) with its engine seeing its controller's
    connection file within :data:`CONTROLLER_FILE_POLL_S` of its writing, not up to 0.1 s
    later: a local cluster's engines are forked while the controller starts, when the fork
    server is ready (``cluster.processes.Processes.start``). The file is taken once it
    reads whole (the controller writes it in place); past ``wait_for_url_file``, the engine
    says, as ipyparallel's does, that it never arrived."""
    import json
    import time

    init_engine = app.IPEngine.init_engine

    def init_engine_sooner(self):
        if not self.connection_info_env:
            self.find_connection_file()
            end = time.monotonic() + self.wait_for_url_file
            while time.monotonic() < end:
                try:
                    with open(self.url_file) as f:
                        json.load(f)
                    break
                except (OSError, ValueError):  # (not there yet, or not whole)
                    time.sleep(CONTROLLER_FILE_POLL_S)
        return init_engine(self)

    app.IPEngine.init_engine = init_engine_sooner


def take(prepared: Prepared) -> None:
    """What the server worked out, taken where this engine would work it out (each part
    once). Each part that does not fit (ipykernel, IPython or traitlets not as they are
    here) is left out, and the engine works that out itself, as ipyparallel's does."""
    parts = [(modules_listed, prepared.files), (modules_known, prepared.names, prepared.count)]
    if prepared.parsed is not None:
        parts.append((command_line_parsed, prepared.args, prepared.parsed))
    for part, *given in parts:
        try:
            part(*given)
        except Exception:  # (nothing of it was changed: each part checks before it does)
            pass


def main(prepared: Prepared | None = None) -> None:
    """The engine; ``prepared``: what the fork server worked out for it (:class:`Prepared`)."""
    import sys

    if witness.FLAG in sys.argv:  # (a rank on another host: before any thread starts)
        sys.argv.remove(witness.FLAG)
        witness.split()
    threading.Thread(target=_preimport, name="notebook_dist-preimport", daemon=True).start()
    args = engine_args(sys.argv[1:])
    if prepared is not None:
        take(prepared)

    from ipyparallel.engine import app
    from ipyparallel.engine.app import main as engine_main

    controller_file_sooner(app)
    engine_main(argv=args)


if __name__ == "__main__":
    main()
