"""The notebook's current cluster: at most one, stopped when the kernel exits."""

from __future__ import annotations

import atexit

from .cluster import DistCluster

_current: DistCluster | None = None

#: In[N] -> the distributed cell that ran there (notebook_dist.export.ExportCell), for %dist_export
cell_records: dict = {}

#: the last profile (%%distributed --profile), for %dist_profile
last_profile = None


def current() -> DistCluster | None:
    """The running cluster, or None (a cluster that stopped is forgotten)."""
    global _current
    if _current is not None and not _current.running:
        _current = None
    return _current


def set_current(cluster: DistCluster | None) -> None:
    global _current
    _current = cluster


def shutdown() -> str | None:
    """Stop the current cluster; what it stopped (a sentence), or None if there was none."""
    global _current
    cluster, _current = _current, None
    if cluster is None:
        return None
    return cluster.shutdown() or "the cluster"


# kernel shutdown and restart end the Python process: stop the cluster cleanly then.
# (A SIGKILLed kernel cannot run this; the reaper process covers that case.)
atexit.register(shutdown)
