"""Entry point of an engine process: ``python -m notebook_dist.runtime.engine``.

Starts importing torch in a background thread while the ipyparallel engine starts and
registers, so the two costs overlap instead of adding up (torch's import is ~3 s here).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace


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


class _Modules:
    """``sys.modules`` as ipykernel's kernel module sees it while a kernel starts: its one
    use there, ``copy()`` to list every module's file, answers from the fork server's
    list; anything else is the real ``sys.modules``."""

    def __init__(self, real: dict, files: str):
        self._real = real
        self._listed = {f: SimpleNamespace(__file__=f) for f in files.split("\n") if f}

    def copy(self) -> dict:
        return self._listed

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
    """The ``sys`` of ipykernel's kernel module while a kernel starts: ``modules`` is
    :class:`_Modules`, the rest the real ``sys``."""

    def __init__(self, real, files: str):
        self._real = real
        self.modules = _Modules(real.modules, files)

    def __getattr__(self, name):
        return getattr(self._real, name)


def modules_listed(files: str) -> None:
    """The kernel this engine starts lists the file of every imported module (for its
    debugger) by touching each module object. Forked from the fork server, an engine shares
    those objects' pages with it, and each touch copies one: 16 ms of its start, among
    about 1,500 modules. The server listed the files before it forked (``files``, one a
    line), and the kernel takes that list instead, once."""
    from ipykernel import ipkernel

    kernel_class, real_sys = ipkernel.IPythonKernel, ipkernel.sys
    init = kernel_class.__init__

    def init_from_list(self, *args, **kwargs):
        ipkernel.sys = _Sys(real_sys, files)
        try:
            init(self, *args, **kwargs)
        finally:
            ipkernel.sys = real_sys
            kernel_class.__init__ = init

    kernel_class.__init__ = init_from_list


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


def main(module_files: str | None = None) -> None:
    """The engine; ``module_files``: the fork server's list of imported modules' files
    (:func:`modules_listed`)."""
    threading.Thread(target=_preimport, name="notebook_dist-preimport", daemon=True).start()
    if module_files is not None:
        modules_listed(module_files)
    import sys

    from ipyparallel.engine import app
    from ipyparallel.engine.app import main as engine_main

    controller_file_sooner(app)

    from .outstream import FLAG

    # first, so that an out_stream_factory on the command line still wins
    engine_main(argv=[FLAG, *sys.argv[1:]])


if __name__ == "__main__":
    main()
