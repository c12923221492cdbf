"""What a bug report needs: the versions of notebook_dist, torch, ipyparallel and Python,
and the backend, in one line (``%dist_init`` and ``%dist_status`` print it)."""

from __future__ import annotations

import platform


def installed_version(name: str, default: str = "not installed") -> str:
    """A distribution's version from its installed metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return default


def version() -> str:
    """notebook_dist's own version ("0+unknown" when imported from a checkout that was
    never installed)."""
    return installed_version("notebook-dist", "0+unknown")


def versions(cluster=None) -> dict[str, str]:
    """Package -> version. torch is the ranks' own when a cluster is given: the engines'
    Python can differ from the kernel's (DistConfig.python)."""
    import ipyparallel

    infos = getattr(cluster, "bootstrap_info", None) or []
    ranks_torch = " / ".join(sorted({i["torch"] for i in infos if i.get("torch")}))
    return {
        "notebook_dist": version(),
        "torch": ranks_torch or installed_version("torch"),
        "ipyparallel": ipyparallel.__version__,
        "Python": platform.python_version(),
    }


def versions_line(cluster=None) -> str:
    """``notebook_dist 0.1.0 · torch 2.13.0+cpu · ipyparallel 9.2.0 · Python 3.11.7 · 2 ranks, gloo``"""
    line = " · ".join(f"{name} {v}" for name, v in versions(cluster).items())
    if cluster is not None:
        line += f" · {cluster.world_size} ranks, {cluster.backend}"
    return line
