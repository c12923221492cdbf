"""What ``%dist_init`` asks for: checked without starting anything, compared with the
running cluster's, and made into a :class:`~notebook_dist.DistCluster` (not started).

>>> ClusterRequest(n=2).check()
>>> ClusterRequest(network=True).check()
Traceback (most recent call last):
...
notebook_dist.errors.PreflightError: --network is for ranks on other hosts: ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import SCHEDULING
from .errors import PreflightError

#: ``%dist_init --preload``: DistConfig.preload_ranks
PRELOAD = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class ClusterRequest:
    """The options of ``%dist_init``, as the user gave them (None: the default)."""

    n: int | None = None
    backend: str = "auto"
    gpus: str | None = None
    timeout: float | None = None
    port: int | None = None
    launcher: str = "local"
    hosts: str | None = None  # --launcher ssh: "node1:2,me@node2"
    ssh: str | None = None  # --launcher ssh: options for ssh and scp, one string
    sbatch: str | None = None  # --launcher slurm: more #SBATCH options
    profile: str | None = None  # attach: the ipcluster's profile
    cluster_id: str | None = None  # attach: the ipcluster's cluster id
    network: bool = False
    #: not part of what the cluster is: a running cluster takes new ones as they are
    hang_after: float | None = field(default=None, compare=False)
    spares: int | None = field(default=None, compare=False)  # DistConfig.spare_engines
    heal: str | None = field(default=None, compare=False)  # "auto" or "off": DistConfig.heal
    heal_copy: str | None = field(default=None, compare=False)  # "model,opt"
    #: "on", "off" or "auto": DistConfig.preload_ranks (for the starts from now on)
    preload: str | None = field(default=None, compare=False)
    #: "auto", "batch" or "normal": DistConfig.rank_scheduling (for the starts from now on)
    scheduling: str | None = field(default=None, compare=False)

    @property
    def attach(self) -> bool:
        return self.profile is not None or self.cluster_id is not None

    def check(self) -> None:
        """Refuse, with a sentence, options that cannot go together; starts nothing."""
        ssh = self.launcher.lower() == "ssh"
        if self.network and not (self.attach or ssh):
            raise PreflightError(
                "--network is for ranks on other hosts: --launcher ssh --hosts ..., or attach "
                "to a cluster with --profile/--cluster-id (other launchers run on this machine)"
            )
        for option, value in (("--hosts", self.hosts), ("--ssh", self.ssh)):
            if value is not None and not ssh:
                raise PreflightError(f"{option} is for --launcher ssh")
        if self.attach and (self.port is not None or self.launcher != "local"):
            option = "--port" if self.port is not None else "--launcher"
            raise PreflightError(f"{option} is for clusters %dist_init starts, not attached ones")
        if self.sbatch is not None and self.launcher != "slurm":
            raise PreflightError("--sbatch is for --launcher slurm")
        for option, value in (("--hang-after", self.hang_after), ("--timeout", self.timeout)):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise PreflightError(f"{option} {value}: give a positive number of seconds")
        if self.spares is not None and self.spares < 0:
            raise PreflightError(f"--spares {self.spares}: give 0 or more engines")
        if self.preload not in (None, *PRELOAD):
            raise PreflightError(f"--preload {self.preload}: give auto, on or off")
        if self.scheduling not in (None, *SCHEDULING):
            raise PreflightError(f"--scheduling {self.scheduling}: give auto, batch or normal")
        if self.heal not in (None, "auto", "off"):
            raise PreflightError(f"--heal {self.heal}: give auto or off")
        for name in (self.heal_copy or "").split(","):
            if name.strip() and not name.strip().isidentifier():
                raise PreflightError(f"--heal-copy {name.strip()!r}: not a valid Python name")

    def settings(self, cluster) -> None:
        """The options a cluster takes as they are, new or running: the hang's seconds,
        the warm pool's size, healing."""
        config = cluster.config
        if self.hang_after is not None:
            config.hang_after_s = self.hang_after
        if self.heal is not None:
            config.heal = self.heal
        if self.heal_copy is not None:
            config.heal_copy = tuple(n.strip() for n in self.heal_copy.split(",") if n.strip())
        if self.preload is not None:
            config.preload_ranks = PRELOAD[self.preload]
        if self.scheduling is not None:
            config.rank_scheduling = self.scheduling
        if self.spares is not None:
            config.spare_engines = self.spares
            cluster.processes.pool.resize(self.spares)

    def cluster(self):
        """The cluster this asks for, planned and checked (its preflight errors raised as
        :class:`PreflightError`), not started. An attached one connects to its ipcluster."""
        from .config import DistConfig

        self.check()
        common = dict(n=self.n, backend=self.backend, gpus=self.gpus, timeout=self.timeout)
        if self.attach:
            from .cluster.attach import AttachedCluster

            made = AttachedCluster(
                profile=self.profile, cluster_id=self.cluster_id, network=self.network, **common
            )
        else:
            from .cluster import DistCluster

            config = DistConfig(slurm={"options": self.sbatch} if self.sbatch else {})
            hosts = None
            if self.launcher.lower() == "ssh":
                from .cluster.hosts import parse_hosts, ssh_options

                hosts = parse_hosts(self.hosts or "")
                options = ssh_options(self.ssh or "")
                config.ssh = {"ssh_args": options, "scp_args": list(options)}
                config.loopback_only = not self.network
            made = DistCluster(
                port=self.port, launcher=self.launcher, config=config, ssh_hosts=hosts, **common
            )
        self.settings(made)
        made.asked = self
        return made
