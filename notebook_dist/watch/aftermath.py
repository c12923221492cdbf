"""After a cell on the ranks: the process group rebuilt where the cell left it unusable,
with every rank's variables kept (after ranks were released; after torch's timeout or a
peer's closed connections broke it), and what the cell says of it."""

from __future__ import annotations

from .inputs import broken, timed_out


def rebuild(cluster) -> tuple[float, str | None]:
    """(seconds, None), or (0, why) when the rebuild failed (the next cell tries again)."""
    from ..errors import ClusterError

    try:
        return cluster.rebuild_process_group(), None
    except ClusterError as exc:
        return 0.0, str(exc)


def after_release(watch) -> str:
    took, why = rebuild(watch.cluster)
    if why is not None:
        return watch.report.rebuild_failed(why)
    return watch.report.released(sorted(watch.released), took, watch.cluster.groups_rebuilt)


def after_broken_group(watch) -> str | None:
    """The group broke under the cell (torch's timeout ended a collective, or a peer's
    connections closed): say why in plain words, with the doctor's verdict on a timeout."""
    gone = broken(watch.views)
    if not gone:
        return None
    timed = timed_out(watch.views)
    why = watch.verdicts.diagnose(before_release=True).verdict if timed else None
    said = watch.report.broke(timed, gone, watch.config.timeout_s, why)
    took, failed = rebuild(watch.cluster)
    if failed is not None:
        return watch.report.rebuild_failed(failed, said)
    return watch.report.rebuilt_broken(said, took, watch.cluster.groups_rebuilt)
