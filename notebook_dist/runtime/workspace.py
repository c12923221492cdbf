"""The notebook's folder stays the ranks' folder, and its modules theirs.

Engines start in the notebook's folder, so a module beside the notebook imports on every
rank. Each cell also carries the kernel's working folder and the ``sys.path`` entries the
notebook added: a rank follows them where they exist on its host (ranks on other hosts
see the same files on a shared filesystem). ``%dist_push --module NAME`` sends a module's
source instead, for hosts that do not share the folder.
"""

from __future__ import annotations

import os
import sys
import types


def follow(cwd: str | None, paths: list[str] | None) -> None:
    """The kernel's folder and its added import paths, where this host has them."""
    if cwd and cwd != os.getcwd() and os.path.isdir(cwd):
        os.chdir(cwd)
    for path in reversed(paths or ()):
        if path not in sys.path and os.path.isdir(path):
            sys.path.insert(0, path)


def install_module(name: str, source: str, filename: str) -> str:
    """The module ``name`` from its ``source``, as if imported (``import name`` finds it;
    ``importlib.reload`` runs the new source sent next)."""
    module = sys.modules.get(name)
    if module is None or getattr(module, "__notebook_dist_source__", False) is False:
        module = types.ModuleType(name)
    module.__file__ = filename
    module.__notebook_dist_source__ = True
    exec(compile(source, filename, "exec"), module.__dict__)
    sys.modules[name] = module
    return name
