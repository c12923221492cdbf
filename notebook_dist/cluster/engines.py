"""The engine processes: ipyparallel's launchers, taught to remember how each engine
ended, and what can be asked of an engine's host (its log, a control file, a folder to
remove), here or over ssh.

ipyparallel reports an engine's exit through its event loop, which does not run while a
cell blocks the kernel; these launchers record the exit code in the waiting thread itself,
so a dead rank is reported with its exit code or signal at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from ..runtime.witness import FLAG as WITNESS_FLAG


# No nanny process per engine: ranks are signalled by pid (one process fewer per rank
# to start and to clean up).
def engine_cmd(
    python: str = sys.executable,
    remote: bool = False,
    wait_s: float | None = None,
    witness: bool = False,
) -> list[str]:
    """``wait_s``: how long an engine waits for its controller's connection file (a local
    cluster's engines can start while the controller does: ``processes.Processes.start``);
    ipyparallel's engine gives up after 10 s. ``witness``: the engine's exit status is
    kept where it ran, for a verdict to say (``runtime/witness.py``): for engines that
    ``mpiexec``, Slurm or ssh start, whose exit the notebook cannot see."""
    cmd = [python, "-m", "notebook_dist.runtime.engine", "--IPEngine.enable_nanny=False"]
    # a rank's cells are run by notebook_dist (``runtime.cell``), not as the shell's
    # history: its SQLite database (in memory, ipyparallel's choice) would stay empty, and
    # making it is 4 ms of a forked engine's start
    cmd.append("--HistoryManager.enabled=False")
    if wait_s is not None:
        cmd.append(f"--IPEngine.wait_for_url_file={wait_s:g}")
    if remote:
        # on another host no reaper of ours can end the engine: it ends itself when the
        # controller's heartbeat is gone for 15 checks (9 s at our 100 ms period; 40 s
        # by ipyparallel's default). A busy cell does not count: the pings queue up.
        cmd.append(f"--IPEngine.max_heartbeat_misses={REMOTE_HEARTBEAT_MISSES}")
    if witness:
        cmd.append(WITNESS_FLAG)
    return cmd


REMOTE_HEARTBEAT_MISSES = 15


def connection_file(
    profile: str | None, profile_dir: str | None, cluster_id: str | None, kind: str = "client"
) -> str:
    """Where ipyparallel writes a running cluster's connection file for its clients
    (``kind`` "client") or for its engines ("engine")."""
    if profile_dir is None:
        from IPython.paths import get_ipython_dir

        profile_dir = os.path.join(get_ipython_dir(), f"profile_{profile or 'default'}")
    name = f"ipcontroller-{cluster_id}-{kind}.json" if cluster_id else f"ipcontroller-{kind}.json"
    return os.path.join(profile_dir, "security", name)


def engines_address(path: str, wait_s: float = 5.0) -> tuple[str, str]:
    """Where a cluster's controller listens for its engines, and where they reach it:
    ``(ip, host)``, from its engine connection file at ``path`` (written just after the
    clients'; when it listens on every interface, ``*``, the engines reach it at its
    ``location``). OSError when the file does not come within ``wait_s``."""
    import json

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                info = json.load(f)
            break
        except (OSError, ValueError):  # (not there yet, or not whole)
            if time.monotonic() > deadline:
                raise OSError(f"no engine connection file at {path}") from None
            time.sleep(0.005)
    ip = info["interface"].partition("://")[2]
    return ip, (info.get("location") or ip) if ip in ("*", "0.0.0.0") else ip


def start_recorded(processes, n: int) -> tuple:
    """``n`` engines asked of the cluster's ipyparallel cluster (``processes``: its
    ``cluster.processes.Processes``), each process recorded and watched at once: their
    engine set, its launchers, and (launcher, record) for each process this machine
    started."""
    launcher, cluster = processes.launcher, processes.ipp
    try:
        engine_set = cluster.engines[cluster.start_engines_sync(n)]
    except Exception as exc:
        said = launcher.start_failed(exc, cluster)
        if said is None:
            raise
        raise said from None
    launchers = list(getattr(engine_set, "launchers", {}).values())
    recorded = []
    for el in launcher.started_processes(engine_set, launchers):
        proc = processes.record(el, "engine")
        if proc is not None:
            recorded.append((el, proc))
            if processes.reaper is not None:
                processes.reaper.watch(proc)
    return engine_set, launchers, recorded


def answered(view, func, *args, within: float, what: str) -> list:
    """``func(*args)`` on each engine of ``view``, its answers in the view's order, waited
    for at most ``within`` seconds: engines that have not answered by then are named in a
    :class:`~notebook_dist.errors.ClusterError` saying ``what`` they were asked, so no
    wait of the kernel's on an engine lasts for ever (Ctrl-C ends it sooner). An engine
    still busy with something else then never runs the request (:func:`abort_unstarted`)."""
    ar = view.apply_async(func, *args)
    try:
        return ar.get(timeout=within)
    except TimeoutError:
        from ..errors import ClusterError

        targets = view.targets
        targets = [targets] if isinstance(targets, int) else list(targets)
        silent = abort_unstarted(view.client, ar, targets)
        if not silent:  # (the last answer came as the wait ended)
            return ar.get(timeout=within)
        raise ClusterError(
            f"engine{'s' if len(silent) != 1 else ''} {', '.join(map(str, silent))} did not "
            f"answer {what} within {within:g} s; a rank that is busy or stuck can be "
            "stopped with %dist_shutdown"
        ) from None


def abort_unstarted(client, ar, targets: list[int]) -> list[int]:
    """The engines among ``targets`` (``ar``'s, one request each, in order) whose request
    in ``ar`` is still outstanding, told to drop it: one not yet started never runs, so an
    engine busy with something else does not run, long after the notebook gave up on it,
    what it was asked (one already running carries on). Returns those engines."""
    outstanding = client.outstanding
    late = [(e, m) for e, m in zip(targets, ar.msg_ids) if m in outstanding]
    if late:
        with contextlib.suppress(Exception):  # (the controller gone: nothing runs anyway)
            client.abort([m for _, m in late], targets=[e for e, _ in late], block=False)
    return [e for e, _ in late]


def by_ssh(el) -> bool:
    """Whether a launcher started its engine over ssh (ipyparallel's ``SSHLauncher``)."""
    from ipyparallel.cluster.launcher import SSHLauncher

    return isinstance(el, SSHLauncher)


def is_local(el) -> bool:
    """Whether a launcher's ``pid`` is a process on this machine (not one ssh started)."""
    return not by_ssh(el)


def has_ended(el) -> bool:
    exited = getattr(el, "exited", None)
    if exited is not None:
        return exited.is_set()
    return by_ssh(el) and el.state == "after"


def end_report(el) -> tuple[int | None, str, str, str]:
    """How a launcher's engine ended: exit code, " on HOST" (ssh), its log, the log's end."""
    if by_ssh(el):
        code = (getattr(el, "stop_data", None) or {}).get("exit_code")
        try:
            text = el.get_output() or "(no log)"
        except Exception as exc:
            text = f"(could not fetch its log: {exc})"
        return code, f" on {el.location}", el.remote_output_file, last_lines(text)
    return el.exit_code, "", el.output_file, tail(el.output_file)


def last_lines(text: str, num_lines: int = 20) -> str:
    return "".join(text.splitlines(keepends=True)[-num_lines:])


def tail(path: str, num_lines: int = 20) -> str:
    """The end of a log file, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return last_lines(f.read(), num_lines)
    except OSError:
        return "(no log)"


def write_on_host(el, files: dict[str, str]) -> None:
    """Write each text to its path with a fresh mtime (the agents watch them): on this
    machine when ``el`` is None, else on the ssh launcher's host, with one ssh call."""
    if el is None:
        for path, text in files.items():
            with open(path, "w") as f:
                f.write(text)
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        return
    el.ssh_sender.check_output_python_code(
        f"import os, time\nfor p, text in {files!r}.items():\n"
        "    with open(p, 'w') as f:\n        f.write(text)\n"
        "    t = time.time_ns()\n    os.utime(p, ns=(t, t))\n"
    )


def write_on_hosts(writes: list[tuple]) -> list:
    """Each ``(el, path, text)`` written, one call for each host (:func:`write_on_host`),
    the hosts side by side (:func:`on_hosts`): 16 ranks' files on 2 hosts are 2 ssh calls,
    not 16 one after another. Returns, for each write, None or the exception its host's
    call raised."""
    return per_host(writes, lambda el, parts: [write_on_host(el, dict(parts))] * len(parts))


def read_on_host(el, paths: list[str]) -> list[str | None]:
    """The text of each file (None for one that cannot be read, as one not there): on this
    machine when ``el`` is None, else on the ssh launcher's host, with one ssh call."""
    if el is None:
        texts = []
        for path in paths:
            try:
                with open(path, errors="replace") as f:
                    texts.append(f.read())
            except OSError:
                texts.append(None)
        return texts
    return json.loads(el.ssh_sender.check_output_python_code(READ_ON_HOST.format(paths=paths)))


#: :func:`read_on_host`'s reading, run on the host (its answer in JSON: ASCII whatever
#: the files hold)
READ_ON_HOST = """
import json, sys
texts = []
for path in {paths!r}:
    try:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    except OSError:
        texts.append(None)
sys.stdout.write(json.dumps(texts))
"""


def read_on_hosts(reads: list[tuple]) -> list:
    """Each ``(el, path)`` read, one call for each host (:func:`read_on_host`), the hosts
    side by side. Returns, for each read, its text, None (not there), or the exception its
    host's call raised."""
    return per_host(reads, lambda el, parts: read_on_host(el, [path for (path,) in parts]))


def per_host(items: list[tuple], call) -> list:
    """``call(el, parts)`` once for each host of ``items`` (each ``(el, *part)``; ``el``
    None for this machine), the hosts side by side (:func:`on_hosts`); ``call`` returns one
    answer for each part, in order. Returns each item's answer, or the exception its host's
    call raised."""
    hosts: dict = {}  # (its launcher, the items' places, their parts) by host
    for i, (el, *part) in enumerate(items):
        _, where, parts = hosts.setdefault(None if el is None else el.location, (el, [], []))
        where.append(i)
        parts.append(part)
    done = on_hosts([(el, call, parts) for el, _, parts in hosts.values()])
    out: list = [None] * len(items)
    for (_, where, _), answers in zip(hosts.values(), done):
        for k, i in enumerate(where):
            out[i] = answers if isinstance(answers, Exception) else answers[k]
    return out


def on_hosts(calls: list) -> list:
    """Each ``(el, func, *args)`` called, in order: those on this machine (``el`` None) here,
    one after another, those on other hosts side by side (each waits on ssh). Returns each
    call's result, or the exception it raised."""

    def one(call):
        try:
            return call[1](call[0], *call[2:])
        except Exception as e:  # (said by the caller, which knows what it asked)
            return e

    done = {i: one(c) for i, c in enumerate(calls) if c[0] is None}
    remote = [i for i, c in enumerate(calls) if c[0] is not None]
    if remote:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(remote)) as pool:
            done.update(zip(remote, pool.map(one, [calls[i] for i in remote])))
    return [done[i] for i in range(len(calls))]


def remove_remote_dirs(launchers, also: str | None = None) -> None:
    """Remove the folders ssh launchers made on each host, the hosts side by side: its
    profile folder and ``also`` (the cluster's own folder, which the ranks make there for
    their control files). A folder gone already (a shared filesystem), or a host that no
    longer answers, is passed over; one found not answering before (``el.dark``) is not
    asked."""
    calls, done = [], set()
    for el in launchers:
        if not by_ssh(el) or el._ssh_sender is None or el.location in getattr(el, "dark", ()):
            continue
        for path in (el.remote_profile_dir, also):
            if path and (el.location, path) not in done:
                done.add((el.location, path))
                calls.append((el, lambda el, path: el.ssh_sender.cmd_rmdir(path), path))
    on_hosts(calls)  # (what failed is returned, not raised)


def stop_watching(launchers) -> list:
    """Tell ipyparallel's watch on each engine on another host to stop: a thread that asks
    the host over ssh, again and again, whether the engine still runs, and that ipyparallel
    ends only once it saw the engine end. Told at the start of a cluster's stop, each ends
    once its ssh call under way returns (bounded by ``hosts.SSH_BOUNDS`` for a host that
    stopped answering) while the cluster stops. Returns the watches' threads, for
    :func:`watches_ended`."""
    threads = []
    for el in launchers:
        if by_ssh(el) and getattr(el, "_stop_waiting", None) is not None:
            el._stop_waiting.set()
            threads.append(getattr(el, "_wait_thread", None))
    return [t for t in threads if t is not None]


def watches_ended(threads: list, wait_s: float) -> bool:
    """Wait for the watches :func:`stop_watching` stopped, ``wait_s`` at most in all: no
    ssh of a stopped cluster is left running, nor started as the kernel ends. Whether they
    all ended."""
    end = time.monotonic() + wait_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in threads)
