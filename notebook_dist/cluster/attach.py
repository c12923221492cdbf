"""Ranks on an ipyparallel cluster that is already running.

``ipcluster start --profile P --cluster-id C -n N --daemonize`` (with any of ipyparallel's
engine launchers: local, MPI, SSH, Slurm, ...) starts engines; ``%dist_init --profile P
--cluster-id C`` makes them ranks: torchrun's environment, a device each, the default
process group. notebook_dist starts no process here and ends none: ``%dist_shutdown``
ends the process group and leaves the engines to whoever started them.

Rank order and MASTER_ADDR: :func:`notebook_dist.plan.rank_order` and
:func:`notebook_dist.plan.master_address`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

from ..config import DistConfig
from ..errors import ClusterError, PreflightError
from ..plan import rank_order
from ..reaper import Reaper
from ..runtime import bootstrap as rt_bootstrap
from ..runtime import host as rt_host
from . import DistCluster, engines
from .engines import connection_file
from .processes import Processes, open_lane, stop_loop_thread
from .ranks import remote_message


class AttachedProcesses(Processes):
    """Engines someone else started: nothing to start, and nothing of theirs to stop."""

    def __init__(self, config: DistConfig, launcher, client, engine_order: list[int], attached):
        super().__init__(config, launcher)
        self.client = client
        self._order = engine_order
        #: (profile, profile_dir, cluster_id) of the ipcluster attached to
        self._attached = attached
        self.notes: list[str] = []

    def start(self, n: int, first_registered=None) -> None:
        """The engines registered before: nothing to wait for, and rank 0's port is asked for
        as the ranks join (``first_registered`` is not called)."""
        # a private folder for the control files, removed if the kernel dies
        self.profile_dir = tempfile.mkdtemp(prefix="notebook_dist-")
        self.reaper = Reaper()
        self.reaper.remove_on_exit(self.profile_dir)
        self.engine_ids = list(self._order)
        if self.config.direct_lane:  # (no engine file here: its controller runs elsewhere)
            self.lane = open_lane(self, n, connection_file(*self._attached, "engine"), 0.0)
        return None

    def controller_alive(self) -> bool:
        return self.client is not None and not getattr(self.client, "_closed", False)

    def spares_possible(self) -> bool:
        return False  # the engines are whoever started them's

    def stop(self, also_remove=()) -> None:
        """End the process group on every rank; the engines keep running."""
        client = self.client
        if client is not None:
            alive = [r.engine_id for r in self.ranks if r.rank not in self.dead_ranks()]
            if alive:
                try:
                    client[alive].apply_sync(rt_bootstrap.detach)
                except Exception as exc:  # a busy or lost engine: it keeps its group
                    self.notes.append(f"could not detach every rank: {remote_message(exc)}")
            if self.lane is not None:
                self.lane.close()
            with contextlib.suppress(Exception):
                client.close()
            stop_loop_thread(client)
        if self.reaper is not None:
            self.reaper.release()
        for path in (self.profile_dir, *also_remove):
            if path:
                shutil.rmtree(path, ignore_errors=True)


class AttachedCluster(DistCluster):
    """A :class:`~notebook_dist.DistCluster` on the engines of a running ipyparallel cluster.

    Connecting, counting the engines and finding their hosts happen at construction
    (a missing cluster or a request that cannot work raises
    :class:`~notebook_dist.errors.PreflightError`); :meth:`~notebook_dist.DistCluster.start`
    makes them ranks.
    """

    def __init__(
        self,
        profile: str | None = None,
        cluster_id: str | None = None,
        n: int | None = None,
        backend: str = "auto",
        gpus: str | list[int] | None = None,
        timeout: float | None = None,
        *,
        profile_dir: str | None = None,
        network: bool = False,
        config: DistConfig | None = None,
        connect_timeout: float = 10.0,
    ):
        config = config or DistConfig()
        config.loopback_only = not network
        self._attach = (profile, profile_dir, cluster_id)
        client = _connect(profile, profile_dir, cluster_id, connect_timeout)
        try:
            ids = _engines(client, n, config.start_timeout_s)
            probes = engines.answered(
                client[ids],
                rt_host.probe,
                within=config.start_timeout_s,
                what="where it runs and which rank its launcher made it",
            )
            probes = dict(zip(ids, probes))
            self._engine_order = rank_order(probes)
            self._client_ready = client
            ordered = [probes[e] for e in self._engine_order]
            super().__init__(
                n=len(ordered),
                backend=backend,
                gpus=gpus,
                timeout=timeout,
                config=config,
                placement=(ordered, rt_host.machine_id()),
            )
        except BaseException:
            client.close()
            stop_loop_thread(client)
            raise
        self.attached_to = {
            "profile": profile,
            "cluster_id": cluster_id,
            "profile_dir": profile_dir,
        }
        self.request.update(attach=self._attach, network=network)

    def _processes(self) -> Processes:
        return AttachedProcesses(
            self.config, self.launcher, self._client_ready, self._engine_order, self._attach
        )

    def discard(self) -> None:
        if self.state == "new" and self.processes.client is not None:
            self.processes.client.close()
            self.processes.client = None
        self.state = "stopped"

    @property
    def cluster_id(self) -> str:
        return self.attached_to["cluster_id"] or "default"

    def restarted(self) -> DistCluster:
        raise ClusterError(
            "this cluster's engines were started outside notebook_dist (ipcluster), so it does "
            "not restart them: restart them with ipcluster, then run the same %dist_init again"
        )

    def shutdown(self) -> None:
        """End the process group on every rank; the engines keep running."""
        super().shutdown()
        self.notes += self.processes.notes

    def __del__(self):
        pass  # nothing of ours runs: the engines belong to their cluster


def _connect(profile, profile_dir, cluster_id, timeout):
    import ipyparallel as ipp

    path = connection_file(profile, profile_dir, cluster_id)
    if not os.path.exists(path):
        raise PreflightError(
            f"no running ipyparallel cluster: {path} does not exist. Start one first, e.g. "
            f"ipcluster start --profile {profile or 'default'} --cluster-id {cluster_id or 'ID'} "
            "-n 2 --daemonize"
        )
    try:
        return ipp.Client(
            profile=profile, profile_dir=profile_dir, cluster_id=cluster_id, timeout=timeout
        )
    except (OSError, TimeoutError) as exc:
        where = profile_dir or f"profile {profile or 'default'!r}"
        raise PreflightError(
            f"no running ipyparallel cluster found in {where} with cluster id "
            f"{cluster_id or '(none)'!r} ({exc}). Start one first, e.g. ipcluster start "
            f"--profile {profile or 'default'} --cluster-id {cluster_id or 'ID'} -n 2 --daemonize"
        ) from None


def _engines(client, n: int | None, wait_s: float, settle_s: float = 2.0) -> list[int]:
    """The engines to use: the first n, or all that registered once their number has
    not changed for ``settle_s`` (engines may still be arriving after ipcluster start)."""
    deadline = time.monotonic() + wait_s
    seen, steady_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(client.ids)
        if count != seen:
            seen, steady_since = count, time.monotonic()
        if n is not None and count >= n:
            break
        if count and time.monotonic() - steady_since >= settle_s:
            break
        time.sleep(0.1)
    ids = sorted(client.ids)
    if not ids:
        raise PreflightError(f"the cluster has no engines (waited {wait_s:.0f} s)")
    if n is not None:
        if n < 1:
            raise PreflightError(f"-n {n}: a cluster needs at least one rank")
        if n > len(ids):
            raise PreflightError(f"-n {n} asked, but the cluster has {len(ids)} engines")
        ids = ids[:n]
    return ids
