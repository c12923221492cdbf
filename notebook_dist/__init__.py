"""notebook_dist: interactive distributed PyTorch in Jupyter.

In the notebook::

    %load_ext notebook_dist
    %dist_init -n 2

    %%distributed
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    t

Inside a cell, ``nd.rank``, ``nd.world_size``, ``nd.local_rank``, ``nd.device`` and
``nd.is_main()`` describe the rank (under torchrun they read torchrun's environment).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "DistCluster": ("notebook_dist.cluster", "DistCluster"),
    "DistConfig": ("notebook_dist.config", "DistConfig"),
    "RankValues": ("notebook_dist.values", "RankValues"),
    "RankError": ("notebook_dist.errors", "RankError"),
    "parse_ranks": ("notebook_dist.ranks", "parse_ranks"),
}
_RANK_FIELDS = ("rank", "world_size", "local_rank", "device")

__all__ = [
    *_LAZY,
    *_RANK_FIELDS,
    "__version__",
    "is_main",
    "report",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the installed metadata, read only when asked for
        from .about import version

        return version()
    if name == "faults":
        import importlib

        return importlib.import_module("notebook_dist.faults")
    if name in _RANK_FIELDS:
        from .runtime.state import current

        return getattr(current(), name)
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'notebook_dist' has no attribute {name!r}")


def is_main() -> bool:
    """True on rank 0 (and in a plain, non-distributed process)."""
    from .runtime.state import current

    return current().rank == 0


def report(**metrics: Any) -> None:
    """Inside a cell: ``nd.report(step=i, loss=l, total=n, samples=b)`` feeds the dashboard."""
    from .runtime.report import report as _report

    _report(**metrics)


def load_ipython_extension(ipython) -> None:
    """``%load_ext notebook_dist``: register the magics."""
    from .magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unload_ipython_extension as unload

    unload(ipython)
