"""The notebook's session: at most one cluster, the cells that ran on it, the last profile.

:class:`Session` is what every magic calls (``magics/`` only parses its line and shows
what comes back): it starts or reuses a cluster, runs and records cells, restarts,
exports. One per kernel, :data:`SESSION`, stopped when the kernel exits; the module's
functions (``current()``, ``shutdown()``, ...) are its methods, for scripts and tests.
"""

from __future__ import annotations

import atexit
from typing import Any

from .cluster import DistCluster
from .errors import NoClusterError
from .request import ClusterRequest


class Session:
    def __init__(self) -> None:
        self._cluster: DistCluster | None = None
        #: In[N] -> the distributed cell that ran there (export.ExportCell), for %dist_export
        self.records: dict = {}
        #: the last profile (%%distributed --profile), for %dist_profile
        self.last_profile = None

    # ---- the cluster --------------------------------------------------------------------

    def current(self) -> DistCluster | None:
        """The running cluster, or None (a cluster that stopped is forgotten)."""
        if self._cluster is not None and not self._cluster.running:
            self._cluster = None
        return self._cluster

    def set_current(self, cluster: DistCluster | None) -> None:
        self._cluster = cluster

    def live(self) -> DistCluster:
        """The running cluster; :class:`NoClusterError` when there is none."""
        cluster = self.current()
        if cluster is None:
            raise NoClusterError("no cluster is running: start one with %dist_init")
        return cluster

    def init(self, request: ClusterRequest) -> list[str]:
        """``%dist_init``: reuse the running cluster if it is what ``request`` asks for,
        else replace it (its ranks' variables go) or start one. Returns what to say."""
        request.check()
        live = self.current()
        if live is not None and getattr(live, "asked", None) == request:
            said = _again(self, live, request)
            request.settings(self.live())
            return said
        wanted = request.cluster()  # checked and planned before anything is stopped
        said = []
        if live is not None:
            said.append(
                f"notebook_dist: replacing the running cluster ({live.world_size} ranks, "
                f"{live.backend}) with {wanted.world_size} ranks, {wanted.backend}; its ranks' "
                "variables are lost."
            )
            self.shutdown()
        return said + self._start(wanted)

    def ahead(self, on: bool = True) -> None:
        """When the extension loads and no cluster runs: start the process local engines
        are forked from, so that ``%dist_init`` need not wait for torch's import, then
        import here what starting a cluster imports (``on=False``: end it, when the
        extension unloads)."""
        from .cluster import forks

        if not on:
            forks.end_ahead()
        elif self.current() is None:
            from .cluster.processes import fork_ahead, prepare_first_call
            from .config import DistConfig

            fork_ahead(DistConfig())
            # ipyparallel (0.25 s here) and what its first call imports: paid now, while
            # the server imports torch, not by the next cell's %dist_init
            import ipyparallel  # noqa: F401

            prepare_first_call()

    def ensure(self) -> tuple[DistCluster, list[str]]:
        """The running cluster, or one started as ``%dist_init`` would: (it, what to say)."""
        cluster = self.current()
        if cluster is not None:
            return cluster, []
        cluster = ClusterRequest().cluster()
        said = [
            f"notebook_dist: no cluster was running; starting {cluster.world_size} ranks "
            f"({cluster.backend}), as %dist_init would."
        ]
        return cluster, said + self._start(cluster)

    def _start(self, cluster: DistCluster) -> list[str]:
        from .about import versions_line

        cluster.start()
        self._cluster = cluster
        return [versions_line(cluster), cluster.table(), *(f"note: {n}" for n in cluster.notes)]

    def shutdown(self) -> str | None:
        """Stop the current cluster; what to say of what it stopped (None: none ran)."""
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            return None
        stopped = cluster.shutdown() or "the cluster"
        attached = getattr(cluster, "attached_to", None)
        if attached is None:
            return f"notebook_dist: cluster stopped: {stopped}."
        where = " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in attached.items() if v is not None
        )
        return (
            "notebook_dist: the ranks left their process group; the engines keep running "
            f"(they are not ours to stop: ipcluster stop {where})."
        )

    def status(self):
        """``%dist_status``: every rank's host, pid, device, backend, state and group health,
        as a record (HTML in a notebook, text elsewhere); a sentence when no cluster runs."""
        from .about import versions_line
        from .ui.html import DashboardRecord, render_html
        from .ui.state import cluster_state

        cluster = self.current()
        if cluster is None:
            return "notebook_dist: no cluster is running (start one with %dist_init)."
        rows = cluster.status()
        columns = ("rank", "host", "pid", "device", "backend", "state", "process_group")
        if any(row["gpu"] for row in rows):  # GPU ranks: the GPU and its CUDA memory
            columns += ("gpu",)
        title = versions_line(cluster)
        text = title + "\n" + cluster.table(rows, columns)
        note = cluster.dead_note()
        if note:
            text += "\n" + note
        return DashboardRecord(render_html(cluster_state(cluster, rows, title)), text)

    def restart(self, replay: bool) -> list[str]:
        """``%dist_restart``: fresh engines and group, the same request; ``replay`` runs the
        cells that ran on every rank again."""
        import time

        cluster = self.live()
        t0 = time.perf_counter()
        history = list(cluster.history)
        fresh = cluster.restarted()
        fresh.asked = getattr(cluster, "asked", None)
        self._cluster = fresh
        said = (
            f"notebook_dist: restarted {fresh.world_size} ranks ({fresh.backend}) in "
            f"{time.perf_counter() - t0:.1f} s (stopped: {cluster.stop_note})"
        )
        plural = "s" if len(history) != 1 else ""
        if not replay:
            more = f"; {len(history)} earlier cell{plural} can be replayed with --replay."
            return [said + (more if history else ".")]
        out = [said + f"; replaying {len(history)} cell{plural}."]
        n = fresh.replay(history)
        out.append(
            f"notebook_dist: replayed {n} cell{'s' if n != 1 else ''}; the ranks are where they were."
        )
        return out

    def heal(self, copy: list[str], source: int | None) -> str:
        """``%dist_heal``: every dead rank replaced, the survivors' variables kept."""
        return self.live().heal(copy, source).text()

    # ---- cells ----------------------------------------------------------------------------

    def run_cell(
        self,
        cell: str,
        number: int,
        ranks: str = "all",
        gather: list[str] | tuple[str, ...] = (),
        header: str | None = None,
        dashboard: bool = True,
        **options: Any,
    ):
        """A ``%%distributed`` cell, In[``number``], on the running cluster (started as
        ``%dist_init`` would if none runs), with the live dashboard; recorded for export.
        ``options``: ``DistCluster.run``'s (hang_after, on_hang, profile, check_collectives).
        Returns the CellResult."""
        from .cluster.cells import check_options
        from .export import ExportCell
        from .plan import plan_cluster
        from .ranks import parse_ranks
        from .ui import DashboardFeed, make_dashboard

        check_options(options.get("hang_after"), options.get("on_hang", "show"))
        options["argv"] = command_line(options.pop("args", None))
        options["answers"] = [unquoted(a) for a in options.get("answers") or ()]
        cluster = self.current()
        # a bad spec is refused before anything starts (against the cluster that would)
        parse_ranks(ranks, cluster.world_size if cluster else plan_cluster().world_size)
        cluster, said = self.ensure()
        for line in said:
            print(line)
        config = cluster.config
        board = make_dashboard(
            config.dashboard if dashboard else "off",
            config.dashboard_quiet_s,
            config.dashboard_full_table,
        )
        feed = DashboardFeed(board) if board is not None else None
        before = cluster.last_watch
        try:
            result = cluster.run(
                cell,
                ranks,
                gather,
                filename=f"Cell In[{number}]",
                header=header,
                on_update=feed,
                **options,
            )
        finally:
            # only this cell's watch: a cell refused before it ran (a syntax error, a dead
            # rank) has none, and must not show the previous cell's dashboard
            if feed is not None and cluster.last_watch not in (None, before):
                feed.close(cluster.last_watch.view())
        self.records[number] = ExportCell(number, "distributed", cell, ranks, ok=not result.errors)
        if result.profile is not None:
            self.last_profile = result.profile
        return result

    def post_mortem(self, rank: int):
        """``%debug`` after a failed cell: the debugger on ``rank`` where it raised, its
        frames as they were (the rank kept them), asked through the notebook."""
        cluster = self.live()
        result = cluster.run(
            '__import__("notebook_dist.runtime.debugger", fromlist=["_"]).post_mortem();',
            ranks=[rank],
            filename="<post-mortem>",
        )
        result.raise_for_errors()

    # ---- after a cell ----------------------------------------------------------------------

    def stacks(self, ranks: str = "all") -> str:
        """Every rank's stack: while a cell runs, now; after one, when it hung or ended."""
        cluster = self.live()
        chosen = cluster.select(ranks)
        watch = cluster.last_watch
        if watch is None:
            return "notebook_dist: no cell has run yet; every rank is idle."
        return watch.view().stacks(chosen)

    def diagnose(self) -> str:
        cluster = self.live()
        watch = cluster.last_watch
        if watch is None:
            return "notebook_dist: no cell has run yet."
        return watch.view().diagnosis_now().text(cluster.config.dashboard_full_table)

    def export(self, path: str, cells: str | None, raw_history: list[str]) -> str:
        """``%dist_export``: the cells that ran, in order, as a torchrun script at ``path``
        (``raw_history``: the notebook's inputs, In[0] first)."""
        from .export import write_script

        cluster = self.current()
        world_size = cluster.world_size if cluster is not None else 2
        return write_script(path, cells, raw_history, self.records, world_size)


def _again(session: Session, live: DistCluster, request: ClusterRequest) -> list[str]:
    """The running cluster asked for again: reused, or, when one of its ranks (or the
    controller) has ended, as when the %dist_init cell runs again after a crash: its ranks
    restarted, or attached to the cluster's engines afresh (engines the user started, and
    restarts). What to say."""
    ended = _ended(live)
    if not ended:
        return [
            f"notebook_dist: reusing the running cluster ({live.world_size} ranks, {live.backend})."
        ]
    if getattr(live, "attached_to", None) is None:
        said = f"notebook_dist: {ended}; restarting the cluster's ranks (their variables are lost)."
        return [said, *session.restart(replay=False)]
    wanted = request.cluster()  # the engines there now
    session.shutdown()
    said = f"notebook_dist: {ended}; attaching to the cluster's engines again (the ranks' variables are lost)."
    return [said, *session._start(wanted)]


def _ended(cluster: DistCluster) -> str:
    """What of a running cluster has ended ("" when nothing has): its controller, or
    which ranks and how."""
    if not cluster.controller_alive():
        return "the cluster's controller has ended"
    dead = cluster.dead_ranks()
    return "; ".join(f"rank {r} {how}" for r, how in sorted(dead.items()))


def unquoted(word: str) -> str:
    """``"p x"`` as IPython's parser hands a quoted word over: without its quotes."""
    if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"":
        return word[1:-1]
    return word


def command_line(text: str | None) -> list[str]:
    """``--args "--epochs 3"`` as sys.argv[1:]."""
    from .cmdline import split_quoted
    from .errors import OptionError

    try:
        return split_quoted(text)
    except ValueError as exc:
        raise OptionError(f"--args {text!r}: {exc}") from None


SESSION = Session()

current = SESSION.current
set_current = SESSION.set_current
shutdown = SESSION.shutdown


def __getattr__(name: str):
    if name == "cell_records":  # the record %dist_export reads
        return SESSION.records
    if name == "last_profile":
        return SESSION.last_profile
    raise AttributeError(name)


# kernel shutdown and restart end the Python process: stop the cluster cleanly then.
# (A SIGKILLed kernel cannot run this; the reaper process covers that case.)
atexit.register(SESSION.shutdown)
