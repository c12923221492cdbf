"""What runs on the ranks: cells (streamed, watched, their values collected), functions
(``apply``), values sent and fetched, and the ranks' status. Each takes the
:class:`~notebook_dist.cluster.DistCluster` it runs on."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import time
import uuid
from typing import Any, TextIO

from ..errors import ClusterError, OptionError, TransferError
from ..execute import CellResult, PreparedCell, collect, prepare_cell
from ..phrases import rank_list
from ..runtime import bootstrap as rt_bootstrap
from ..runtime import cell as rt_cell
from ..ui.bars import OFF as NO_BARS
from ..ui.bars import GroupedBars, grouping
from ..values import RankValues, pack, pack_named, through_file, unpack
from ..watch import CellWatch
from . import engines
from .ranks import remote_message
from .recovery import regain_group


def cell_request(
    prepared, gather, token, shm_dir, profile, check, argv, post_mortem, group_bars=False
) -> tuple:
    """What a rank's ``runtime.cell.run_cell_request`` is sent: one tuple, options last;
    ``group_bars``: the notebook shows the ranks' alike progress bars as one."""
    options = {
        "profile": profile,
        "check_collectives": check,
        "argv": list(argv) if argv else None,
        "post_mortem": post_mortem,
        **workspace(),
    }
    if group_bars:
        options["group_bars"] = True
    p = prepared
    return (
        p.code,
        p.filename,
        p.source,
        p.first_line,
        gather,
        p.want_value,
        token,
        shm_dir,
        options,
    )


#: the cells run by the Python API, numbered: the ranks know a cell's code by its name's
#: ``Cell In[`` (where a collective was called, a fatal signal's line, the hint at an
#: error's line), as they know IPython's cells
_RUNS = itertools.count(1)


def _prepared(cell: str, filename: str | None, header: str | None) -> PreparedCell:
    return prepare_cell(cell, filename or f"Cell In[run {next(_RUNS)}]", header)


def check_options(hang_after: float | None = None, on_hang: str = "show") -> None:
    """A cell's options, refused with a sentence before anything is sent."""
    if on_hang not in ("show", "stop"):
        raise OptionError(f"--on-hang {on_hang!r}: use show or stop")
    if hang_after is not None and (not math.isfinite(hang_after) or hang_after <= 0):
        raise OptionError(f"--hang-after {hang_after}: give a positive number of seconds")


def run(
    cluster,
    cell: str | PreparedCell,
    ranks: Any = None,
    gather: list[str] | tuple[str, ...] = (),
    *,
    filename: str | None = None,
    header: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    hang_after: float | None = None,
    on_update=None,
    on_hang: str = "show",
    profile: bool = False,
    check_collectives: bool | None = None,
    argv: list[str] | tuple[str, ...] = (),
    raw_output: bool = False,
    post_mortem: bool = False,
    answers: list[str] | tuple[str, ...] = (),
) -> CellResult:
    """Run a cell on the selected ranks at once, streaming their output live.

    Returns a :class:`~notebook_dist.execute.CellResult`; call ``raise_for_errors()`` to
    raise :class:`~notebook_dist.errors.RankError` if any rank raised. A syntax error raises
    before any rank runs. While it runs, a hang longer than ``hang_after`` seconds prints a
    diagnosis, and a rank that raises or dies while others wait in a collective gets them
    released. ``profile``: run it under torch.profiler on every rank; ``result.profile`` is
    then a :class:`notebook_dist.profile.Profile` (where the time went, across ranks).
    ``check_collectives`` (default ``DistConfig.check_collectives``): compare every
    collective's arguments across ranks before it runs, so a mismatch is an error on every
    rank instead of a hang, an abort or wrong numbers. ``argv``: the cell's ``sys.argv[1:]``
    on every rank, as a script's command line (``--args``). ``raw_output``: every rank's
    lines as they are, none folded (``DistConfig.fold_from_ranks``). ``post_mortem``: a rank
    that raises opens the debugger where it raised (``%pdb on``); ``answers``: lines given
    in advance to what the ranks ask (a debugger, ``input()``), in order. ``filename``: its
    name in tracebacks and verdicts (``Cell In[run N]`` by default).
    """
    check_options(hang_after, on_hang)
    cluster.require_running()
    selected = cluster.select(ranks)
    prepared = cell if isinstance(cell, PreparedCell) else _prepared(cell, filename, header)
    cluster.processes.check_alive(selected)
    gather = list(gather)
    regain_group(cluster, out)  # when the last rebuild failed, or it broke between cells
    how_profiled, offsets = _profiling(cluster, selected) if profile else (None, {})
    t0, token = time.perf_counter(), uuid.uuid4().hex
    check = cluster.config.check_collectives if check_collectives is None else check_collectives
    bars = _grouped_bars(cluster, selected, raw_output, out)
    request = cell_request(
        prepared, gather, token, cluster.shm_dir, how_profiled, check, argv, post_mortem, bars.on
    )
    ar = _send(cluster, selected, rt_cell.run_cell_request, request)
    watch = cluster.last_watch = CellWatch(
        cluster,
        ar,
        selected,
        prepared,
        out,
        err,
        cluster.config.hang_after_s if hang_after is None else hang_after,
        bars.following(on_update),
        token=token,
        hang_action=on_hang,
        raw_output=raw_output,
        answers=answers,
    )
    try:
        watch.run_to_end()
    finally:
        bars.finish(watch.views)
    if any(v.status == "dead" for v in watch.views.values()):
        _ended_ranks(cluster, watch)
    results = [watch.views[r].result for r in selected]
    result = _collected(watch, selected, results, gather, out)
    result.elapsed_s = time.perf_counter() - t0
    if profile:
        result.profile = _profile_of(selected, results, offsets, prepared.filename)
    if not result.errors and not watch.released and len(selected) == cluster.world_size:
        cluster.history.append(prepared)
    return result


def _grouped_bars(cluster, selected: list[int], raw_output: bool, out):
    """The cell's ranks' alike progress bars shown as one, from ``phrases.COMPACT_FROM``
    ranks (``ui/bars.py``; off: each rank shows its own)."""
    if not grouping(len(selected), raw_output, cluster.config.fold_from_ranks):
        return NO_BARS
    return GroupedBars(out)


def _send(cluster, selected: list[int], func, *args):
    """``func(*args)`` on the ranks by the lane's express route when every one of them can
    take it, else as any other call; what the cell's watch reads."""
    processes = cluster.processes
    if processes.lane is not None:
        ids = [processes.engine_ids[r] for r in selected]
        ar = processes.lane.express(ids, processes.view, func, *args)
        if ar is not None:
            return ar
    return processes.rank_view(selected).apply_async(func, *args)


#: the import paths the kernel had when notebook_dist was imported: the notebook's own
#: additions are the others
_PATHS_AT_IMPORT = list(sys.path)


def workspace() -> dict[str, Any]:
    """The notebook's folder and the import paths it added, for the ranks to follow."""
    added = [p for p in sys.path if p not in _PATHS_AT_IMPORT and p]
    return {"cwd": os.getcwd(), "paths": [os.path.abspath(p) for p in added] or None}


def push_modules(cluster, names: list[str], ranks: Any = None) -> list[str]:
    """Send the source of the notebook's modules ``names`` to the ranks, which import it
    from there (for ranks on hosts that do not share the notebook's folder)."""
    import importlib.util

    from ..runtime import workspace as rt_workspace

    sent = []
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None) if spec else None
        if spec is None or not origin or not origin.endswith(".py"):
            raise TransferError(
                f"--module {name}: no Python source file for it here (only single-file "
                "modules of .py source can be sent; a package needs a shared folder)"
            )
        if spec.submodule_search_locations:
            raise TransferError(
                f"--module {name} is a package: put it in a folder every rank's host shares"
            )
        with open(origin) as f:
            source = f.read()
        apply(cluster, rt_workspace.install_module, name, source, origin, ranks=ranks)
        sent.append(name)
    return sent


def _ended_ranks(cluster, watch) -> None:
    """A rank died in the cell: say how, and with ``DistConfig.heal == "auto"`` heal it
    at once (the cell itself still failed: rerun it)."""
    said = (watch.final or watch.verdicts.diagnose()).verdict
    if cluster.config.heal == "auto":
        from ..errors import NotebookDistError

        try:
            said += " " + cluster.heal(cluster.config.heal_copy).text().removeprefix(
                "notebook_dist: "
            ).replace("healed", "Healed at once (--heal auto):", 1)
        except NotebookDistError as exc:
            said += f" Healing at once (--heal auto) failed: {exc}"
    raise ClusterError(said)


def _profiling(cluster, selected: list[int]) -> tuple[str, dict[int, int]]:
    """How a profiled cell's ranks are put on one clock: at the barrier it begins with
    ("aligned", every rank), else by the kernel's estimate of each one's offset ("alone")."""
    if len(selected) == cluster.world_size:
        return "aligned", {}
    return "alone", clock_offsets(cluster, selected)


def _collected(watch, selected: list[int], results: list, gather: list[str], out) -> CellResult:
    """The ranks' results as one CellResult; a released rank's error is a consequence, not
    a cause, and is left out when the cause is shown; the note of ranks that exit()ed."""
    result = collect(selected, results, gather)
    for r in watch.released:
        if r in result.errors and len(result.errors) > 1:
            del result.errors[r]
    result.released = sorted(watch.released)
    result.fold = watch.streamer.folding is not None  # (tracebacks fold as the lines did)
    if result.exits:
        stream = out or sys.stdout
        stream.write(result.exit_note() + "\n")
        stream.flush()
    return result


def _profile_of(selected: list[int], results: list, offsets: dict, cell_file: str):
    """Where the time went (notebook_dist.profile), its merged trace written, or None."""
    from ..profile import analyze

    profiles = {
        r: res["profile"] for r, res in zip(selected, results) if res and res.get("profile")
    }
    if not profiles:
        return None
    profile = analyze(profiles, offsets, cell_file)
    profile.save_trace()
    return profile


def apply(
    cluster, func, *args, ranks: Any = None, timeout: float | None = None, **kwargs
) -> RankValues:
    """Call ``func(*args, **kwargs)`` on the selected ranks; RankValues of the returns.

    Without a ``timeout``, a call takes the express route, as a cell does (more than a MiB
    of function and arguments, and of what a rank returns, through a file in shared
    memory); one with a ``timeout`` (a request not started by then is aborted) takes
    ipyparallel's way, as does one over a MiB where there is no shared memory."""
    cluster.require_running()
    selected = cluster.select(ranks)
    cluster.processes.check_alive(selected)
    if timeout is None:
        values = _express_call(cluster, selected, func, args, kwargs)
        if values is not None:
            return RankValues(dict(zip(selected, values)))
    ar = cluster.processes.rank_view(selected).apply_async(func, *args, **kwargs)
    try:
        results = ar.get(timeout=timeout)
    except Exception as exc:
        if not ar.ready():  # (it timed out) where a rank is still busy, it never starts
            ids = [cluster.processes.engine_ids[r] for r in selected]
            engines.abort_unstarted(cluster.processes.client, ar, ids)
        raise ClusterError(
            f"could not run {getattr(func, '__name__', func)} on the ranks: {remote_message(exc)}"
        ) from None
    return RankValues(dict(zip(selected, results)))


#: how long one wait for an express call's replies lasts between two looks for dead ranks
CALL_POLL_S = 0.05


def _express_call(cluster, selected: list[int], func, args: tuple, kwargs: dict) -> list | None:
    """``func(*args, **kwargs)`` on the ranks by the lane's express route
    (``runtime.cell.call_packed``): their values in the order of ``selected``, or None when
    the route cannot carry it (no lane, a rank not on it, a call over a MiB without shared
    memory, or one that only ipyparallel's own serialisation can send)."""
    processes = cluster.processes
    if processes.lane is None:
        return None
    files: list[str] = []  # read by every rank: removed here once all have answered
    try:
        try:
            frames = pack((func, args, kwargs), cluster.shm_dir, files, _by_code)
        except Exception:  # (ipyparallel's queue tries its own way, and says what fails)
            return None
        # a MiB or more goes through a file; without shared memory, by ipyparallel's way,
        # whose frames are not copied into one message
        frames = through_file(frames, cluster.shm_dir, files)
        if frames is None:
            return None
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]  # (pickled as bytes)
        ids = [processes.engine_ids[r] for r in selected]
        ar = processes.lane.express(
            ids, processes.view, rt_cell.call_packed, frames, cluster.shm_dir
        )
        if ar is None:
            return None
        try:
            return _express_values(cluster, ar, selected, getattr(func, "__name__", func))
        finally:
            ar.forget()
    finally:
        for path in files:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _by_code(func) -> tuple:
    """A function the notebook defined, sent as its code alone: the rank makes it with its
    own namespace (``runtime.cell.rank_function``), so its names mean the rank's variables,
    as through ipyparallel's own calls, and the notebook's values of them are not sent."""
    made = (func.__code__, func.__name__, func.__defaults__, func.__closure__)
    more = (func.__kwdefaults__, func.__qualname__, func.__dict__ or None)
    return (rt_cell.rank_function, (*made, *more))


def _express_values(cluster, ar, selected: list[int], name) -> list:
    """An express call's values, once every rank answered; a rank that raised, or whose
    process ended meanwhile, fails the call with a sentence naming it."""
    processes = cluster.processes
    while not ar.wait(CALL_POLL_S):
        dead = {r: how for r, how in processes.dead_ranks().items() if r in selected}
        if dead:
            said = "; ".join(f"rank {r} {how}" for r, how in sorted(dead.items()))
            raise ClusterError(f"could not run {name} on the ranks: {said}")
    values, failed = [], {}
    for rank, reply in zip(selected, ar._children):
        try:
            values.append(unpack(reply.result()))
        except Exception as exc:  # (the same failure on many ranks is said once)
            failed.setdefault(remote_message(exc), []).append(rank)
    if failed:
        said = "; ".join(f"{rank_list(ranks)}: {why}" for why, ranks in failed.items())
        raise ClusterError(f"could not run {name} on the ranks: {said}")
    return values


def push(cluster, values: dict[str, Any], ranks: Any = None) -> None:
    """Bind ``values`` (name -> object) in every selected rank's namespace."""
    cluster.require_running()
    for name in values:
        if not name.isidentifier():
            raise TransferError(f"{name!r} is not a valid Python name")
    for name, value in values.items():
        pack_named(name, value, "the notebook")  # precise error before sending anything
    files: list[str] = []  # read by every rank: removed here once all have
    frames = pack_named(", ".join(values), dict(values), "the notebook", cluster.shm_dir, files)
    try:
        apply(cluster, rt_cell.push_values, *frames, ranks=ranks)
    finally:
        for path in files:
            with contextlib.suppress(OSError):
                os.unlink(path)


def pull(cluster, names: list[str] | str, ranks: Any = None) -> dict[str, RankValues]:
    """Fetch variables from the selected ranks: name -> RankValues."""
    if isinstance(names, str):
        names = [names]
    results = apply(cluster, rt_cell.pull_values, list(names), cluster.shm_dir, ranks=ranks)
    out: dict[str, dict[int, Any]] = {n: {} for n in names}
    missing: dict[str, list[int]] = {}
    problems = []
    for rank, frames in results.items():
        res = unpack(frames)
        for name in res["missing"]:
            missing.setdefault(name, []).append(rank)
        for name, why in res["unpicklable"].items():
            problems.append(f"{name!r} on rank {rank}: {why}")
        for name, value in res["values"].items():
            out[name][rank] = value
    for name, where in missing.items():
        problems.insert(0, f"{name!r} is not defined on {rank_list(where)}")
    if problems:
        raise TransferError("; ".join(problems))
    return {name: RankValues(v, name=name) for name, v in out.items()}


#: how long a profiled cell waits for the ranks' clocks (seconds; ranks between cells answer
#: in milliseconds)
CLOCK_S = 30.0


def clock_offsets(cluster, ranks: list[int], samples: int = 3) -> dict[int, int]:
    """Each rank's clock minus the kernel's, in ns. A rank on the kernel's machine reads the
    kernel's clock: 0, exactly (an estimate from a round trip through the controller could
    only add its error, up to half of a round trip of milliseconds, and that error, the same
    at every collective, reads as a rank arriving late at each). For another machine, the
    round trip with the least delay among all its ranks."""
    from ..runtime.host import clock_id
    from ..runtime.profiler import clock

    here = clock_id()
    view = cluster.processes.rank_view(ranks)
    where: dict[int, str] = {}
    best: dict[str, tuple[int, int]] = {}  # clock: (round trip, offset)
    for _ in range(samples):
        t0 = time.time_ns()
        stamps = engines.answered(view, clock, within=CLOCK_S, what="its clock's reading")
        t1 = time.time_ns()
        for r, (m, stamp) in zip(ranks, stamps):
            where[r] = m
            if m != here and (m not in best or t1 - t0 < best[m][0]):
                best[m] = (t1 - t0, stamp - (t0 + t1) // 2)
        if not best:
            break  # every rank is on this machine
    return {r: 0 if where[r] == here else best[where[r]][1] for r in ranks}


def _answering(processes, engine_id: int) -> bool:
    """Whether a request of ours to this engine waits for its reply (through the queue or
    the lane: the controller counts only what passed through its queue)."""
    uuid = processes.client._engines.get(engine_id)
    lane = processes.lane
    return bool(uuid) and bool(
        processes.client._outstanding_dict.get(uuid) or (lane and lane.route.outstanding(uuid))
    )


def status(cluster) -> list[dict[str, Any]]:
    """One dict per rank: rank, engine_id, host, pid, device, backend, state,
    process_group, gpu."""
    from ..phrases import memory_text as fmt_bytes

    rows = []
    running = cluster.running
    dead = cluster.dead_ranks() if running else {}
    queue = {}
    if running:
        try:
            queue = cluster.processes.client.queue_status()
        except Exception:
            queue = {}
    idle = [
        r.rank
        for r in cluster.ranks
        if r.rank not in dead
        and queue.get(r.engine_id, {}).get("queue", 0) == 0
        and not _answering(cluster.processes, r.engine_id)
    ]
    health: dict[int, Any] = {}
    if idle:
        try:
            health = dict(apply(cluster, rt_bootstrap.health, ranks=idle, timeout=5))
        except Exception:
            health = {}
    for r in cluster.ranks:
        if not running:
            state = cluster.state
        elif r.rank in dead:
            state = f"dead ({dead[r.rank]})"
        elif r.rank in idle:
            exit_ = (health.get(r.rank) or {}).get("last_exit")
            state = (
                f"idle (its last cell called {exit_['called']}, code {exit_['code']})"
                if exit_
                else "idle"
            )
        else:
            state = "busy"
        h = health.get(r.rank)
        pg = (
            "-"
            if r.rank in dead
            else "unknown (busy)"
            if h is None
            else ("ok" if h.get("initialized") else "not initialised")
        )
        gpu = (h or {}).get("gpu")
        rows.append(
            dict(
                rank=r.rank,
                engine_id=r.engine_id,
                host=r.host,
                pid=r.pid,
                device=r.device,
                backend=r.backend,
                state=state,
                process_group=pg,
                gpu=(
                    f"{gpu['device']} {gpu['name']}, {fmt_bytes(gpu['allocated'])} / "
                    f"{fmt_bytes(gpu['reserved'])} (peak {fmt_bytes(gpu['peak'])})"
                    if gpu
                    else ("" if not r.device.startswith("cuda") else "-")
                ),
            )
        )
    return rows
