"""Getting the ranks back: interrupting them, releasing them from collectives that cannot
complete (the rank side is ``notebook_dist.runtime.recover``), rebuilding the process
group with every rank's variables kept, reading where a rank that died was, and, when
nothing else helps, fresh engines with the cells replayed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any, TextIO

from ..errors import ClusterError
from ..execute import PreparedCell
from ..phrases import groups_after_rebuild, rank_list
from ..runtime import group as rt_group
from ..runtime import recover as rt_recover
from ..runtime.state import rank_file
from . import engines
from .ranks import remote_message, rendezvous_port


def interrupt(cluster, ranks: Any = None) -> None:
    """SIGINT to the selected ranks (like the notebook's stop button): by pid to the ranks
    this cluster started on this machine, through the controller to the others (an
    attached cluster's engines, ranks on other hosts), whose nanny signals its engine."""
    from ..signals import send

    processes = cluster.processes
    for r in cluster.select(ranks):
        proc = processes.rank_procs.get(r)
        if proc is not None:
            send(proc, signal.SIGINT)
        else:  # through the controller, which asks the engine's host
            processes.client.send_signal(
                signal.SIGINT, targets=[cluster.ranks[r].engine_id], block=False
            )


def stop_ranks(cluster, running, wait, release, config=None) -> list[int]:
    """The stop button, escalated: SIGINT to every running rank; those still running after
    ``interrupt_grace_s`` (blocked in a collective, where SIGINT cannot land) are released;
    those still running ``release_grace_s`` later get a second SIGINT (a release can leave
    a rank in Python code). ``running()`` names the ranks still running, ``wait(s)`` polls
    the cell for ``s`` seconds, ``release(ranks)`` releases them. Returns those that would
    not stop."""
    config = config or cluster.config
    cluster.interrupt(running())
    wait(config.interrupt_grace_s)
    if running():
        release(running())
        wait(config.release_grace_s)
    if running():
        cluster.interrupt(running())  # a rank released into Python code
        wait(config.interrupt_grace_s)
    return running()


def release_collectives(cluster, ranks: list[int], token: str) -> None:
    """Ask the ranks' agents to release them from their collectives, for the cell ``token``
    only: through a control file on each rank's host (here, or written there over ssh)."""
    for el, done in _written(cluster, [(r, "release", token) for r in ranks]):
        if el is None and isinstance(done, Exception):  # (a host that ssh cannot reach: its
            raise done  # rank stays in its collective, and is then said to be stuck)


def tell_ranks(cluster, tells: list[tuple[int, str, str]]) -> None:
    """Each ``(rank, kind, text)``: ``text`` in the rank's control file of ``kind``
    (``answer``: a line it asked for), which its agent watches: here, or written on its
    host over ssh, one call for each host. The first failure is raised, after the
    others were written."""
    for _, done in _written(cluster, tells):
        if isinstance(done, Exception):
            raise done


def _written(cluster, tells: list[tuple[int, str, str]]) -> list[tuple]:
    """Each ``(rank, kind, text)`` written in the rank's control file of ``kind``, one call
    for each host (``engines.write_on_hosts``): each write's host launcher (None here), and
    None or the exception its host's call raised."""
    processes = cluster.processes
    writes = [
        (processes.host_launcher(rank), processes.control_file(rank, kind), text)
        for rank, kind, text in tells
    ]
    return [(el, done) for (el, *_), done in zip(writes, engines.write_on_hosts(writes))]


#: how long ranks wait for each other to meet when the group is rebuilt (they are all
#: alive and idle by then: a rank that is not there in this time is not coming)
REBUILD_RENDEZVOUS_S = 30.0
#: how much longer than that the notebook waits for every rank's answer
REBUILD_ANSWER_MARGIN_S = 30.0


def rebuild_process_group(cluster, attempts: int = 2) -> float:
    """A fresh default process group on every rank (after a release); returns seconds.

    A rebuild that fails on some rank (its port taken meanwhile, say) is tried again on a
    fresh port. Raises :class:`ClusterError` saying what each rank ran into, and naming the
    ranks whose CUDA context cannot be used any more (only fresh engines can have their GPU
    again); until a rebuild succeeds, ``cluster.group_lost`` says why there is no group.
    ``cluster.groups_rebuilt``: what it did to the other groups, in words."""
    t0 = time.perf_counter()
    failed: dict[int, str] = {}
    voided = remade = 0  # of the other groups (a try that failed may have voided them)
    for attempt in range(1, attempts + 1):
        try:
            port = rendezvous_port(cluster.processes, cluster.plan)
            done = cluster.apply(
                rt_recover.reinit,
                port,
                REBUILD_RENDEZVOUS_S,
                timeout=REBUILD_RENDEZVOUS_S + REBUILD_ANSWER_MARGIN_S,
            )
        except Exception as exc:  # no answer from a rank (or an interrupt before reinit ran)
            if attempt < attempts:
                continue
            why = str(exc) if isinstance(exc, ClusterError) else remote_message(exc)
            why += rebuild_steps(cluster)
            cluster.group_lost = f"rebuilding it failed {attempts} times ({why})"
            raise ClusterError(why) from None
        voided = max([voided, *(info.get("groups_lost", 0) for info in done.values())])
        remade = max((info.get("groups_remade", 0) for info in done.values()), default=0)
        broken = {r: info["cuda_unusable"] for r, info in done.items() if info.get("cuda_unusable")}
        if broken:
            said = "; ".join(f"rank {r}: {why}" for r, why in sorted(broken.items()))
            cluster.group_lost = f"the GPU cannot be used any more ({said})"
            raise ClusterError(
                f"the GPU cannot be used any more on {rank_list(broken)} ({said}). %dist_restart starts fresh "
                "engines: every rank's variables are lost (add --replay to re-run your setup cells)"
            )
        failed = {r: info["error"] for r, info in done.items() if info.get("error")}
        if not failed:
            cluster.group_lost = None
            cluster.groups_rebuilt = groups_after_rebuild(voided, remade)
            return time.perf_counter() - t0
    said = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
    cluster.group_lost = f"rebuilding it failed {attempts} times ({said})"
    raise ClusterError(said)


def rebuild_steps(cluster) -> str:
    """Where each rank still in a rebuild of its group is, and since when (each says so in
    its control file: ``runtime.state.rebuild_step``), as a clause ("" when none is)."""
    processes, now, said = cluster.processes, time.time(), []
    reads = [
        (processes.host_launcher(r.rank), processes.control_file(r.rank, "rebuild", r.pid))
        for r in cluster.ranks
    ]
    for r, text in zip(cluster.ranks, engines.read_on_hosts(reads)):
        since, _, step = text.partition(" ") if isinstance(text, str) else ("", "", "")
        with contextlib.suppress(ValueError):  # (no file: that rank is not in a rebuild)
            said.append(f"rank {r.rank} was {step} for {now - float(since):.0f} s")
    return f" ({'; '.join(said)})" if said else ""


def broken_marks(processes) -> dict[int, str]:
    """Ranks on this machine whose process group broke since it was last made, and why
    (each rank marks it in a folder of its own: ``runtime.group``)."""
    if not processes.profile_dir:
        return {}
    folder = broken_folder(processes)
    try:  # one look at the folder before each cell: it holds only marks (most often none)
        names = set(os.listdir(folder))
    except OSError:  # (not made until a rank marks its group broken)
        return {}
    marks: dict[int, str] = {}
    for r in range(len(processes.ranks)):
        path = rank_file(folder, "broken", r)
        if os.path.basename(path) in names and processes.local(r):
            with contextlib.suppress(OSError), open(path) as f:
                marks[r] = f.read()
    return marks


def broken_folder(processes) -> str:
    """The folder of the ranks' marks of a broken group (``runtime.group``)."""
    return rt_group.broken_folder(os.path.dirname(processes.control_file(0)))


def regain_group(cluster, out: TextIO | None = None) -> None:
    """Before a cell, when the last rebuild failed or the group broke between cells (a
    thread of the user's ran into torch's timeout): rebuild the group now (every rank keeps
    its variables), or refuse the cell at once, saying what to do, rather than let it fail
    on every rank, or wait in a rendezvous, for want of a group."""
    if cluster.replaying_alone:  # a heal: the group is made after its replay
        return
    if not cluster.group_lost:
        marks = broken_marks(cluster.processes)
        if not marks:
            return
        r = min(marks)
        cluster.group_lost = f"it broke after the last cell: rank {r} met {marks[r]!r}"
    why = cluster.group_lost
    try:
        took = rebuild_process_group(cluster)
    except ClusterError as exc:
        raise ClusterError(
            f"the ranks have no process group: rebuilding it failed ({exc}). %dist_restart "
            "starts fresh ranks (add --replay to re-run your setup cells)."
        ) from None
    stream = out or sys.stdout
    stream.write(
        f"notebook_dist: the process group was missing ({why}); rebuilt before this cell "
        f"({took:.2f} s), every rank kept its variables.\n"
    )
    stream.flush()


def restarted(cluster):
    """Fresh ranks with the same request (and history). A local cluster whose controller
    lives keeps it: its ranks' engines are ended and engines from the warm pool (started
    now when it holds too few) become the ranks. Otherwise the cluster is stopped and a
    fresh one started."""
    if cluster.running and cluster.processes.spares_possible() and cluster.controller_alive():
        return _restarted_in_place(cluster)
    fresh = type(cluster)(
        n=cluster.request["n"],
        backend=cluster.request["backend"],
        gpus=cluster.request["gpus"],
        timeout=cluster.request["timeout"],
        port=cluster.request["port"],
        launcher=cluster.launcher.name,
        config=cluster.config,
        ssh_hosts=getattr(cluster.launcher, "hosts", None),
    )
    history = list(cluster.history)
    cluster.shutdown()
    fresh.start()
    fresh.history = history
    return fresh


def _restarted_in_place(cluster):
    from . import ranks as rank_setup
    from .processes import stop_note
    from .spares import retire_ranks, stand_in

    processes = cluster.processes
    dead = retire_ranks(processes)
    cluster.stop_note = stop_note(cluster.world_size, dead, controller_gone=True)
    for r, spare in enumerate(processes.pool.take(cluster.world_size)):
        stand_in(processes, r, spare)
    cluster.ranks, cluster.bootstrap_info, _ = rank_setup.join(
        processes, cluster.plan, cluster.config, cluster.port
    )
    processes.ranks_joined(cluster.ranks)
    cluster.group_lost, cluster.last_watch, cluster.healed = None, None, {}
    return cluster


def stand_in_for(cluster, ranks: list[int], clock=None) -> None:
    """A fresh engine from the warm pool for each of ``ranks`` (dead ones), joined alone as
    that rank, the survivors untouched (the first step of ``notebook_dist.heal``);
    ``clock(phase)`` is told when the engines are taken and when they have joined."""
    from . import ranks as rank_setup
    from .spares import stand_in

    processes = cluster.processes
    spares = processes.pool.take(len(ranks))
    if clock is not None:
        clock("engines")
    for r, spare in zip(ranks, spares):
        stand_in(processes, r, spare)
    infos = rank_setup.join_alone(processes, cluster.plan, cluster.config, ranks)
    if clock is not None:
        clock("join")
    for r, info in zip(ranks, infos):
        cluster.ranks[r] = info
    processes.ranks_joined(cluster.ranks)


def replay(
    cluster,
    cells: list[PreparedCell],
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Re-run recorded cells in order; stops at (and raises) the first failure."""
    done = 0
    cluster.history = []
    for prepared in cells:
        cluster.run(prepared, out=out, err=err).raise_for_errors()
        done += 1
    return done
