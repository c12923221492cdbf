"""Engines become ranks: each is given torchrun's environment, its device and the
interactive-safe settings, and joins the default process group (the rank side of this is
``notebook_dist.runtime.bootstrap``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import DistConfig, scheduling
from ..errors import ClusterError
from ..phrases import alike, rank_numbers
from ..plan import ClusterPlan
from ..runtime import bootstrap as rt_bootstrap
from ..runtime import group as rt_group
from ..watch.progress import engine_error
from .processes import Processes


@dataclass
class RankInfo:
    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    backend: str
    machine: str = ""  # machine_id(): which ranks share a host with the notebook
    start: str = ""  # the process's start time, as the rank read it (with pid: this process)


def grouped_table(ranks: list[RankInfo]) -> str:
    """The rank table for many ranks, as ``%dist_init`` shows it: a row for the ranks on one
    host with one kind of device and backend, their devices' numbers as ranges ('cuda:0-7'),
    and where every rank's own row is (``%dist_status``)."""
    from ..table import format_table

    same_kind = alike(ranks, key=lambda r: (r.host, r.device.partition(":")[0], r.backend))
    rows = [
        {
            "ranks": rank_numbers(r.rank for r in same),
            "host": host,
            "device": _devices([r.device for r in same]),
            "backend": backend,
        }
        for (host, _, backend), same in same_kind.items()
    ]
    table = format_table(("ranks", "host", "device", "backend"), rows)
    return "\n".join([*table, "(every rank's pid and state: %dist_status)"])


def _devices(devices: list[str]) -> str:
    """One kind of device, said once: 'cpu', 'cuda:0-7'."""
    kind = devices[0].partition(":")[0]
    numbers = [d.partition(":")[2] for d in devices]
    if not all(n.isdigit() for n in numbers):
        return ", ".join(dict.fromkeys(devices))
    return f"{kind}:{rank_numbers(int(n) for n in numbers)}"


def rendezvous_port(processes: Processes, plan: ClusterPlan, asked=None) -> int:
    """The port of the store rank 0 is to host: its engine opens the socket now and keeps
    it listening, so no other process can take the port before the store starts.
    ``asked``: what :func:`ask_rendezvous` asked of an engine earlier, used if that engine
    is rank 0's."""
    first = processes.engine_ids[0]
    if asked is not None and asked[0] != first:
        # (not rank 0 after all: its socket is closed, whenever it has answered)
        processes.client[asked[0]].apply_async(rt_group.close_rendezvous)
        asked = None
    _, answer = asked or ask_rendezvous(processes, plan, first)
    return answer.get(timeout=processes.config.start_timeout_s)


def ask_rendezvous(processes: Processes, plan: ClusterPlan, engine_id: int) -> tuple:
    """Ask the engine that is to be rank 0 for the store's port as soon as it has
    registered, so that the answer comes while the other engines still start, not on the
    way to the group (a round trip through the controller: 6-9 ms here)."""
    addr = plan.ranks[0].env["MASTER_ADDR"]
    return engine_id, processes.client[engine_id].apply_async(rt_group.open_rendezvous, addr)


def join(
    processes: Processes,
    plan: ClusterPlan,
    config: DistConfig,
    port: int | None,
    asked: tuple | None = None,
) -> tuple[list[RankInfo], list[dict[str, Any]], list[str]]:
    """Make every engine its rank of the plan. Returns the ranks, what each reported of its
    start (import and init seconds; the benchmarks read them) and notes for the user (an
    environment variable of theirs that the ranks override). ``asked``: rank 0's port,
    asked for early (:func:`ask_rendezvous`)."""
    port = port or rendezvous_port(processes, plan, asked)
    infos = _bootstrap(processes, plan, config, list(range(plan.world_size)), port)
    ranks = [
        RankInfo(
            rank, eid, i["host"], i["pid"], i["device"], i["backend"], i["machine"], i["start"]
        )
        for rank, (i, eid) in enumerate(zip(infos, processes.engine_ids))
    ]
    # values of the user's that the ranks replace: the kernel's own environment is what
    # local engines started with (they are given the ranks' values at start), and a rank
    # says what its host had set
    overrides = config.rank_overrides()
    overridden = {
        k: os.environ[k] for k, v in overrides.items() if k in os.environ and os.environ[k] != v
    }
    for info in infos:
        overridden.update(info["overridden"])
    notes = [
        f"{key} was {old!r} in your environment; ranks use {config.rank_overrides()[key]!r} "
        "(see notebook_dist.config)"
        for key, old in sorted(overridden.items())
    ]
    return ranks, infos, notes


def join_alone(
    processes: Processes, plan: ClusterPlan, config: DistConfig, ranks: list[int]
) -> list[RankInfo]:
    """Stand-ins for dead ``ranks`` (their engines already in ``processes.engine_ids``):
    each its rank of the plan in a group of its own (``runtime.heal``), until the real
    group is made with the survivors."""
    infos = _bootstrap(processes, plan, config, ranks, port=None)
    return [
        RankInfo(
            r,
            processes.engine_ids[r],
            i["host"],
            i["pid"],
            i["device"],
            plan.backend,
            i["machine"],
            i["start"],
        )
        for r, i in zip(ranks, infos)
    ]


def _bootstrap(processes, plan, config, ranks: list[int], port: int | None) -> list[dict]:
    """Each of ``ranks``' engines bootstrapped as that rank, side by side (``port``: the
    real group's rendezvous; None: alone, for stand-ins)."""
    pending = []
    for r in ranks:
        rp = plan.ranks[r]
        env = dict(rp.env, MASTER_PORT=str(port or 0))
        pending.append(
            processes.client[processes.engine_ids[r]].apply_async(
                rt_bootstrap.bootstrap,
                env,
                rp.device,
                plan.backend,
                config.collective_timeout_s(),
                config.rank_overrides(),
                processes.control_file(r),
                config.publish_interval_s,
                config.flight_recorder_entries,
                config.store_timeout_s(),
                alone=port is None,
                scheduling=scheduling(config, plan.backend),
            )
        )
    infos = []
    for rank, ar in zip(ranks, pending):
        try:
            infos.append(ar.get(timeout=config.start_timeout_s))
        except Exception as exc:
            from .launchers import import_hint

            message = remote_message(exc)
            raise ClusterError(
                f"rank {rank} could not join the process group: {message}"
                + import_hint(message, config)
            ) from None
    return infos


def remote_message(exc: BaseException) -> str:
    """The useful line of an ipyparallel RemoteError/CompositeError, or of the express
    route's error (each names the rank's exception: ``ename``, ``evalue``)."""
    try:
        from ipyparallel import error as ipp_error

        if isinstance(exc, ipp_error.CompositeError):
            return "; ".join(f"{e[0]}: {e[1]}" for e in exc.elist)
    except Exception:
        pass
    said = engine_error(exc)
    return f"{said['ename']}: {said['evalue']}"
