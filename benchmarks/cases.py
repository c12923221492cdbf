"""The benchmark cases. Each returns a dict of named measurements and ratios.

Every ratio compares two things measured side by side in the same run, alternating,
so machine noise hits both alike. Absolute times are reported only for context.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

TRAIN_SETUP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(nd.rank)
X, Y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
"""

TRAIN_LOOP = """
for step in range(1, STEPS + 1):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X), Y)
    loss.backward()
    opt.step()
    nd.report(step=step, total=STEPS, loss=loss.item(), samples=64)
"""

# timed as torchrun_job.py times it: from a barrier, on rank 0; the value also says how
# many steps ran, so a loop that stopped early is never timed as a fast one
TIMED_LOOP = (
    "import time as _t\ndist.barrier()\n_t0 = _t.perf_counter()\n"
    + TRAIN_LOOP
    + "(STEPS / (_t.perf_counter() - _t0), step)\n"
)


def check_steps(values: dict, steps: int) -> None:
    """Every rank ran every step it was timed for."""
    ran = {rank: v[-1] for rank, v in values.items()}
    assert len(ran) == 2 and set(ran.values()) == {steps}, f"steps run: {ran}, wanted {steps}"


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio(a: list[float], b: list[float]) -> dict:
    """median(a) / median(b), and the per-pair ratios (a[i] and b[i] ran back to back, so
    their ratio cancels the machine's slow drifts: its median is the steadier figure)."""
    pairs = [x / y for x, y in zip(a, b)]
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "pair_median": statistics.median(pairs),
        "pair_median_ci95": bootstrap_ci95(pairs),
        "pair_geomean": geomean(pairs),
        "pair_geomean_ci95": bootstrap_ci95(pairs, stat=geomean),
        "pair_min": min(pairs),
        "pair_max": max(pairs),
    }


def geomean(xs: list[float]) -> float:
    """The geometric mean: the efficient estimate of a multiplicative effect from ratios."""
    import math

    return math.exp(statistics.fmean(math.log(x) for x in xs))


def bootstrap_ci95(
    xs: list[float], draws: int = 2000, stat=statistics.median
) -> tuple[float, float]:
    """A bootstrap 95% interval of ``stat`` (the median unless told; fixed seed: the same
    data, the same answer)."""
    import random

    rng = random.Random(0)
    meds = sorted(stat(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def _torchrun(
    args: list[str], timeout: float = 300, retry: bool = True, batch: bool = False
) -> tuple[float, str]:
    """torchrun_job.py under torchrun on 2 workers: its time and its output. ``batch``:
    torchrun and its workers under Linux's SCHED_BATCH, as ``chrt -b 0 torchrun`` runs
    them (what notebook_dist's CPU ranks run under, ``DistConfig.rank_scheduling``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(HERE / "torchrun_job.py"), *args]
    if batch:  # (set by the child before it becomes torchrun: no Python between fork and exec)
        cmd = [sys.executable, "-c", _AS_BATCH, *cmd]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        if retry:  # a rare Gloo abort in torchrun's own children on this 2-core machine
            print(
                f"torchrun failed ({out.returncode}); once more. Its stderr began:\n{out.stderr[:1500]}",
                file=sys.stderr,
            )
            return _torchrun(args, timeout, retry=False, batch=batch)
        raise RuntimeError(out.stderr[:1500] + "\n...\n" + out.stderr[-1500:])
    return elapsed, out.stdout


#: ``python -c``: this process under SCHED_BATCH, then the command after it in its place
_AS_BATCH = (
    "import os, sys; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def startup(reps: int) -> dict:
    """A cold ``DistCluster(n=2).start()`` (engines forked from one process that imported
    torch once), the same with each engine a fresh Python (``fork_engines=False``), the
    same once that process was started ahead (as ``%load_ext notebook_dist`` does, and
    ready: a notebook's next cell), and torchrun's start to a first all_reduce, in turn
    (the order rotates each round)."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster.processes import fork_ahead
    from notebook_dist.config import DistConfig

    memory: dict[str, list[dict]] = {"forked": [], "fresh": [], "fork server ahead": []}

    def ours(fork: bool, ahead: bool = False) -> float:
        config = DistConfig(fork_engines=fork)
        if ahead:  # (not timed) the extension loaded, the user reads the next cell
            server = fork_ahead(config)
            server.wait_ready(120)
            memory["fork server ahead"].append(rank_memory(server.pid))
        t0 = time.perf_counter()
        # returns once every rank's process group is usable
        c = DistCluster(n=2, config=config).start()
        elapsed = time.perf_counter() - t0
        if ahead:
            assert c.processes.forks is server, "the cluster did not take the server started ahead"
        else:
            memory["forked" if fork else "fresh"] += [rank_memory(r.pid) for r in c.ranks]
        try:  # (not timed) the group is usable: an all_reduce sums
            summed = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
            assert dict(summed.values) == {0: 2.0, 1: 2.0}, summed.values
        finally:
            c.shutdown()
        return elapsed

    def theirs() -> float:
        elapsed, stdout = _torchrun(["startup"])
        assert "RESULT 2.0" in stdout, stdout  # its all_reduce summed
        return elapsed

    arms = {
        "forked": lambda: ours(True),
        "fresh": lambda: ours(False),
        "ahead": lambda: ours(True, ahead=True),
        "torchrun": theirs,
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for i in range(reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(arms[name]())
    return {
        "dist_init_s": summarize(times["forked"]),
        "dist_init_fresh_engines_s": summarize(times["fresh"]),
        "dist_init_fork_server_ahead_s": summarize(times["ahead"]),
        "torchrun_s": summarize(times["torchrun"]),
        "startup_vs_torchrun": ratio(times["forked"], times["torchrun"]),
        "fork_server_ahead_vs_torchrun": ratio(times["ahead"], times["torchrun"]),
        "fresh_engines_vs_torchrun": ratio(times["fresh"], times["torchrun"]),
        "forked_vs_fresh_engines": ratio(times["forked"], times["fresh"]),
        "idle_rank_mib": {
            k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in memory.items()
        },
    }


def rank_memory(pid: int) -> dict:
    """A rank's memory, MiB: resident, its own (private pages), and its proportional share
    of the pages it shares (PSS), from /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {
        "rss": fields["Rss"],
        "own": fields["Private_Clean"] + fields["Private_Dirty"],
        "pss": fields["Pss"],
    }


def monarch(reps: int, calls: int = 200) -> dict:
    """notebook_dist and Monarch (torchmonarch) side by side, each in a plain script of its
    own (``ours_job.py``, ``monarch_job.py``), alternating: from nothing to a Gloo group of
    2 with a checked all_reduce, then an empty call on both ranks with values returned.
    Monarch runs in ``MONARCH_PYTHON`` (a Python with torchmonarch and the same torch), or
    this Python if it has it."""
    import json

    python = os.environ.get("MONARCH_PYTHON") or sys.executable
    probe = subprocess.run([python, "-c", "import monarch.actor"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {
            "skipped": f"torchmonarch cannot be imported by {python} ({probe.stderr.strip()[-200:]}): "
            "pip install torchmonarch beside the same torch, or set MONARCH_PYTHON"
        }

    def job(exe: str, script: str) -> dict:
        done = subprocess.run(
            [exe, str(HERE / script), str(calls)], capture_output=True, text=True, timeout=300
        )
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not line:
            raise RuntimeError(f"{script} failed ({done.returncode}): {done.stderr[-1500:]}")
        return json.loads(line[0][len("RESULT ") :])

    ours, theirs = [], []
    for i in range(reps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            if which == 0:
                ours.append(job(sys.executable, "ours_job.py"))
            else:
                theirs.append(job(python, "monarch_job.py"))
    pick = lambda rows, key: [r[key] for r in rows]  # noqa: E731
    return {
        "ours": {k: summarize(pick(ours, k)) for k in ours[0]},
        "monarch": {k: summarize(pick(theirs, k)) for k in theirs[0]},
        "start_vs_monarch": ratio(pick(ours, "start_s"), pick(theirs, "start_s")),
        "cell_vs_monarch_call": ratio(pick(ours, "cell_s"), pick(theirs, "call_s")),
        "apply_vs_monarch_call": ratio(pick(ours, "apply_s"), pick(theirs, "call_s")),
    }


def empty_cells(cluster, cells: int, source: str = "pass") -> tuple[list[float], list[float]]:
    """``cells`` empty cells (or cells of ``source``) after 3 to warm up: each one's wall
    time and the kernel's CPU."""
    for _ in range(3):
        cluster.run(source).raise_for_errors()
    wall, cpu = [], []
    for _ in range(cells):
        w0, c0 = time.perf_counter(), time.process_time()
        cluster.run(source).raise_for_errors()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return wall, cpu


def cells_from_idle(cluster, cells: int, idle_s: float = 0.05) -> list[float]:
    """The kernel's CPU for each of ``cells`` empty cells, each run ``idle_s`` after the last
    ended, as a user's cells come. On a virtual machine whose idle CPU halts (Linux's
    haltpoll), what the kernel does after a wait runs with cold caches: the same empty cell
    at 2 ranks took 0.44 ms back to back, 0.69 ms 5 ms after the last and 1.2 ms 20 ms after
    (2026-12-05), so cells back to back favour the size whose cell is shorter."""
    cpu = []
    for _ in range(cells):
        time.sleep(idle_s)
        c0 = time.process_time()
        cluster.run("pass").raise_for_errors()
        cpu.append(time.process_time() - c0)
    return cpu


SCALE_SIZES = (2, 4, 8, 16, 32)


def scale(reps: int, cells: int, sizes=SCALE_SIZES) -> dict:
    """Start, an empty cell (wall, and the kernel's CPU), a gather of 1 MB from every rank,
    and the time to the doctor's verdict when one rank skips a collective, at each size;
    every size's round runs beside one at 2 ranks (alternating which starts first), so each
    ratio to 2 ranks is of pairs measured back to back. Each round also measures the floor
    under an empty cell with as many bare processes (``echo_floor.py``), by zmq and by
    pipes: the best ratio one process per rank can reach on this machine."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    def measure(n: int, alone: bool) -> dict:
        ahead = start_after_load_ext(n)
        t0 = time.perf_counter()
        c = DistCluster(n=n, config=DistConfig(spare_engines=0)).start()
        start = time.perf_counter() - t0
        try:
            wall, cpu = empty_cells(c, cells)
            c.run("x = torch.zeros(2**18)").raise_for_errors()  # 1 MiB of float32
            gather = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = c.run("pass", gather=["x"])
                gather.append(time.perf_counter() - t0)
                assert len(r.gathered["x"]) == n
            odd = n // 3
            skipped = f"t = torch.ones(1)\nif nd.rank != {odd}:\n    dist.all_reduce(t)\n"
            verdict = time_to_verdict(c, skipped, f"rank {odd} finished the cell")
            printed, printing = print_lines(c, n)
            # the same lines printed by one process alone, right after (the cluster idle);
            # at the larger size only: against 2 ranks it would be compared with itself
            by_itself = (
                {
                    "alone_printing_all_s": _printing_process(n * 1000),
                    "alone_printing_1000_s": _printing_process(1000),
                }
                if alone
                else {}
            )
        finally:
            c.shutdown()
        floor = echo_floor(n, 1000)  # the same number of bare processes, the cluster gone
        piped = echo_floor(n, 1000, pipes=True)  # (and through pipes, as cells go)
        return {
            **by_itself,
            "echo_floor_s": floor["wall_s"],
            "echo_floor_cpu_s": floor["cpu_s"],
            "pipe_floor_s": piped["wall_s"],
            "pipe_floor_cpu_s": piped["cpu_s"],
            "start_s": start,
            "start_ahead_s": ahead,
            "cell_s": statistics.median(wall),
            "cell_cpu_s": statistics.median(cpu),
            "gather_1MB_each_s": statistics.median(gather),
            "verdict_s": verdict,
            "print_1000_lines_each_s": printed,
            "rank_printing_s": printing,
        }

    keys = (
        "start_s",
        "start_ahead_s",
        "cell_s",
        "cell_cpu_s",
        "echo_floor_s",
        "echo_floor_cpu_s",
        "pipe_floor_s",
        "pipe_floor_cpu_s",
        "gather_1MB_each_s",
        "verdict_s",
        "print_1000_lines_each_s",
        "rank_printing_s",
    )
    alone_keys = ("alone_printing_all_s", "alone_printing_1000_s")
    out: dict = {}
    for n in sizes[1:]:
        small: dict[str, list[float]] = {k: [] for k in keys}
        big: dict[str, list[float]] = {k: [] for k in keys + alone_keys}
        for i in range(reps):
            for which in [small, big] if i % 2 == 0 else [big, small]:
                got = measure(2 if which is small else n, alone=which is big)
                for k in got:
                    which[k].append(got[k])
        out[f"{n}_ranks"] = {
            **{k: summarize(big[k]) for k in keys + alone_keys},
            **{f"{k}_vs_2": ratio(big[k], small[k]) for k in keys},
            **printing_alone(n, big),
        }
    return out


def start_after_load_ext(n: int) -> float:
    """``DistCluster(n=n).start()`` as in the cell a user runs after ``%load_ext
    notebook_dist``, having read on: the fork server was started ahead and, waiting, has
    loaded by itself what ranks load later. Checked: the cluster took that server, and its
    group sums."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster.processes import fork_ahead
    from notebook_dist.config import DistConfig

    config = DistConfig(spare_engines=0)
    server = fork_ahead(config)
    assert server.idle_preloaded.wait(120), "the server started ahead did not load by itself"
    t0 = time.perf_counter()
    c = DistCluster(n=n, config=config).start()
    elapsed = time.perf_counter() - t0
    try:
        assert c.processes.forks is server, "the cluster did not take the server started ahead"
        summed = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        assert set(dict(summed.values).values()) == {float(n)}, summed.values
    finally:
        c.shutdown()
    return elapsed


#: how a cell reaches the ranks: (DistConfig.lane_pipes, DistConfig.relay_from)
ROUTES = {"pipes": (True, None), "socket": (False, None), "relay": (False, 2)}
#: how long the ranks wait in the cell that shows what waiting alone costs the kernel:
#: about as long as an empty cell takes at 16 ranks on these 2 cores
WAITING_S = 0.003


def routes(reps: int, cells: int, n: int = 16) -> dict:
    """An empty cell's wall time and kernel CPU at 2 and ``n`` ranks by each of the
    express route's ways (:data:`ROUTES`: the ranks' pipes, the default; the socket
    alone; the relay, at ``n`` ranks), with cells back to back and with cells from an idle
    kernel (:func:`cells_from_idle`); the five kinds alternate in each round, each round in
    another order."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    def measure(size: int, route: str) -> dict:
        pipes, relay_from = ROUTES[route]
        config = DistConfig(spare_engines=0, lane_pipes=pipes, relay_from=relay_from)
        c = DistCluster(n=size, config=config).start()
        try:
            wall, cpu = empty_cells(c, cells)
            from_idle = cells_from_idle(c, max(10, cells // 4))
            # the same reply, after a wait as long as 16 ranks' cell takes: the kernel's
            # thread sleeps, and what it does next costs more than after a short wait
            waiting = (
                empty_cells(c, cells, f"__import__('time').sleep({WAITING_S})")[1]
                if size == 2 and route == "pipes"
                else []
            )
            taken = c.processes.lane.route
            assert len(taken.via_relay) == (size if route == "relay" else 0)
            assert len(taken.pipes.to if taken.pipes else ()) == (size if pipes else 0)
        finally:
            c.shutdown()
        # the median cell, and the mean (all the CPU over all the cells: what a median
        # leaves out, such as a garbage collection every few cells, is in it)
        return {
            "cell_s": statistics.median(wall),
            "cell_cpu_s": statistics.median(cpu),
            "cell_cpu_mean_s": statistics.fmean(cpu),
            "idle_cell_cpu_s": statistics.median(from_idle),
            **({"waiting_cell_cpu_s": statistics.median(waiting)} if waiting else {}),
        }

    kinds = {
        "2_pipes": (2, "pipes"),
        "2_socket": (2, "socket"),
        f"{n}_pipes": (n, "pipes"),
        f"{n}_socket": (n, "socket"),
        f"{n}_relay": (n, "relay"),
    }
    keys = ("cell_s", "cell_cpu_s", "cell_cpu_mean_s", "idle_cell_cpu_s")
    got: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in kinds}
    got["2_pipes"]["waiting_cell_cpu_s"] = []
    order = list(kinds)
    for i in range(reps):
        for kind in order[i % len(order) :] + order[: i % len(order)]:
            m = measure(*kinds[kind])
            for key, value in m.items():
                got[kind][key].append(value)
    out: dict = {k: {key: summarize(v) for key, v in got[k].items()} for k in kinds}
    for key in keys:
        base = got["2_pipes"][key]
        for route in ROUTES:
            out[f"{key}_{n}_{route}_vs_2"] = ratio(got[f"{n}_{route}"][key], base)
        out[f"{key}_{n}_socket_vs_2_socket"] = ratio(got[f"{n}_socket"][key], got["2_socket"][key])
        out[f"{key}_{n}_pipes_vs_socket"] = ratio(got[f"{n}_pipes"][key], got[f"{n}_socket"][key])
        out[f"{key}_2_pipes_vs_socket"] = ratio(got["2_pipes"][key], got["2_socket"][key])
    out[f"cell_cpu_s_{n}_pipes_vs_2_waiting"] = ratio(
        got[f"{n}_pipes"]["cell_cpu_s"], got["2_pipes"]["waiting_cell_cpu_s"]
    )
    return out


PRINTING = (
    "import time\n_t0 = time.perf_counter()\n"
    "for i in range(1000):\n    print(f'r{nd.rank} line {i}')\n"
    "time.perf_counter() - _t0"
)


def echo_floor(n: int, rounds: int, pipes: bool = False) -> dict:
    """``echo_floor.py``'s rounds of ``n`` bare processes, in a process of its own (by
    zmq, or by ``pipes``)."""
    got = subprocess.run(
        [sys.executable, str(HERE / "echo_floor.py"), str(n), str(rounds)]
        + (["pipes"] if pipes else []),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(got.stdout)


def print_lines(cluster, n: int) -> tuple[float, float]:
    """A cell in which every rank prints 1000 lines: seconds until the notebook has them
    all (checked: whole, and in order per rank), and the slowest rank's own time in its
    loop of prints."""
    import io

    out = io.StringIO()
    t0 = time.perf_counter()
    r = cluster.run(PRINTING, out=out, raw_output=True)
    wall = time.perf_counter() - t0
    r.raise_for_errors()
    lines = out.getvalue().splitlines()
    for rank in range(n):
        mine = [ln.split("] ", 1)[1] for ln in lines if ln.startswith(f"[rank {rank}] ")]
        assert mine == [f"r{rank} line {i}" for i in range(1000)], (rank, len(mine))
    return wall, max(dict(r.values).values())


def printing_alone(n: int, ours: dict) -> dict:
    """A cell of ``n`` ranks printing 1000 lines each against one Python process printing
    the same lines alone (``n`` x 1000, to a pipe, timed by itself) right after it: the
    lines a second of each, and a rank's own loop of prints against the same 1000 prints
    alone (how much the notebook slows a rank that prints)."""
    cell, alone = ours["print_1000_lines_each_s"], ours["alone_printing_all_s"]
    return {
        "alone_lines_per_s": n * 1000 / statistics.median(alone),
        "lines_per_s": n * 1000 / statistics.median(cell),
        "lines_per_s_vs_alone": ratio([1 / t for t in cell], [1 / t for t in alone]),
        "rank_printing_vs_alone": ratio(ours["rank_printing_s"], ours["alone_printing_1000_s"]),
    }


def _printing_process(lines: int) -> float:
    code = (
        "import sys, time\nt0 = time.perf_counter()\n"
        f"for i in range({lines}):\n    print(f'r0 line {{i}}')\n"
        "sys.stdout.flush()\nsys.stderr.write(repr(time.perf_counter() - t0))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.count("\n") == lines
    return float(r.stderr)


def dispatch(cluster, shell, reps: int) -> dict:
    """An (almost) empty cell: ours against ipyparallel's own execute. Both count their
    runs on the ranks, and the counts are checked: a failure is never timed."""
    view = cluster.processes.client.direct_view(cluster.processes.engine_ids)
    cluster.run("_bench_n = 0").raise_for_errors()
    ours, raw = [], []
    for _ in range(5):  # warm up both paths
        shell.run_cell_magic("distributed", "--no-dashboard", "_bench_n += 1")
        view.execute("_bench_n += 1", block=True).get()
    for _ in range(reps):
        t0 = time.perf_counter()
        shell.run_cell_magic("distributed", "", "_bench_n += 1")
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        view.execute("_bench_n += 1", block=True).get()
        raw.append(time.perf_counter() - t0)
    counts = dict(cluster.run("_bench_n").values)
    expected = 2 * (5 + reps)
    assert counts == {r: expected for r in counts} and len(counts) == 2, counts
    return {
        "cell_s": summarize(ours),
        "view_execute_s": summarize(raw),
        "cell_vs_view_execute": ratio(ours, raw),
    }


def nbdistributed_dispatch(reps: int) -> dict | None:
    """nbdistributed 0.1.0 installed beside us (benchmarks/.nbd), in its own process."""
    target = HERE / ".nbd"
    if not (target / "nbdistributed").exists():
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(target),
                "nbdistributed==0.1.0",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            return {"skipped": "nbdistributed 0.1.0 could not be installed: " + r.stderr[-300:]}
    # its workers start `python` from PATH: this venv's, or they cannot import zmq
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1", PATH=path)
    out = subprocess.run(
        [sys.executable, str(HERE / "nbd_dispatch.py"), str(reps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    import json

    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("SKIPPED "):
            return {"skipped": "nbdistributed: " + json.loads(line[8:])}
    return {"skipped": "nbdistributed run failed: " + (out.stderr or out.stdout)[-500:]}


def nbdistributed_against_ours(cluster, shell, rounds: int, reps: int) -> dict:
    """nbdistributed's cell against ours, in alternated rounds (its process and workers
    started anew each round, ours the same cluster throughout): per round, the median of
    ``reps`` cells on each side, so its ratio comes from pairs measured back to back. Our
    cells count their runs on the ranks, and the counts are checked."""
    cluster.run("_vs_nbd_n = 0").raise_for_errors()
    theirs, ours, their_times = [], [], []
    for i in range(rounds):
        for side in ("theirs", "ours") if i % 2 == 0 else ("ours", "theirs"):
            if side == "theirs":
                got = nbdistributed_dispatch(reps)
                if "median" not in got:
                    return got  # skipped, with why
                theirs.append(got["median"])
                their_times += got["times"]
                continue
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                shell.run_cell_magic("distributed", "", "_vs_nbd_n += 1")
                times.append(time.perf_counter() - t0)
            ours.append(statistics.median(times))
    counts = dict(cluster.run("_vs_nbd_n").values)
    assert counts == {0: rounds * reps, 1: rounds * reps}, counts
    return {
        **summarize(their_times),
        "rounds": rounds,
        "ours_s": summarize(ours),
        "vs_ours": ratio(theirs, ours),
    }


# an exact checksum of a tensor's bytes (integer sums do not round)
CHECKSUM = "int({0}.view(torch.int32 if {0}.element_size() == 4 else torch.int16).long().sum())"


def _pair_median(r: dict, name: str) -> dict:
    """A ratio's pair median as ``name`` and its 95% interval as ``name_ci95``."""
    return {name: r["pair_median"], f"{name}_ci95": r["pair_median_ci95"]}


class _Kind:
    """One kind of value :func:`transfer` moves: how the ranks make ``x`` (``n`` elements of
    ``mb`` MB), the notebook's own copy, a fresh copy of it, and an exact checksum."""

    def __init__(self, name: str, element_size: int):
        self.name, self.element_size = name, element_size
        self.numpy = name.startswith("numpy")

    def count(self, mb: int) -> int:
        return mb * 2**20 // self.element_size

    def made(self, n: int) -> str:
        if self.numpy:
            return f"import numpy as np\nx = np.random.default_rng(0).standard_normal({n})"
        return f"x = torch.randn({n}).to(torch.{self.name})"

    def local(self, n: int):
        if self.numpy:
            import numpy as np

            return np.random.default_rng(1).standard_normal(n)
        import torch

        return torch.randn(n).to(getattr(torch, self.name))

    def copy(self, local):
        if self.numpy:
            return local.copy()
        import torch

        return torch.empty_like(local).copy_(local)

    def checksum(self, name: str) -> str:
        if self.numpy:  # (the float64's bits, summed as integers: no rounding)
            return f"int({name}.view(np.int64).sum())"
        return CHECKSUM.format(name)


#: torch's two common dtypes, and a numpy array (pickled out of band, not as tensor files)
TRANSFER_KINDS = (_Kind("float32", 4), _Kind("bfloat16", 2), _Kind("numpy_float64", 8))


def transfer(cluster, sizes_mb=(1, 16, 256), reps: int = 5) -> dict:
    import numpy as np
    import torch

    view = cluster.processes.client.direct_view(cluster.processes.engine_ids)
    out = {}
    for kind in TRANSFER_KINDS:
        for mb in sizes_mb if not kind.numpy else [m for m in sizes_mb if m <= 16]:
            n = kind.count(mb)
            cluster.run(kind.made(n)).raise_for_errors()
            local = kind.local(n)
            r_reps = reps if mb < 256 else max(3, reps - 2)
            value, gather, pull_ipp, push, copy = [], [], [], [], []
            for _ in range(r_reps):
                # the same bytes (2 ranks' worth) copied into fresh allocations: the median
                # of 5, since one cold copy (page faults) can be several times slower
                one = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    [kind.copy(local) for _ in range(2)]
                    one.append(time.perf_counter() - t0)
                copy.append(statistics.median(one))
                t0 = time.perf_counter()
                r = cluster.run("x")
                value.append(time.perf_counter() - t0)
                assert r.values[1].dtype == local.dtype and len(r.values[1]) == n
                t0 = time.perf_counter()
                cluster.run("pass", gather=["x"])
                gather.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                cluster.push({"y": local})
                push.append(time.perf_counter() - t0)
                if mb <= 16:  # ipyparallel's own path pickles tensors in band: slow at 256 MB
                    t0 = time.perf_counter()
                    pulled = view.pull("x", block=True)
                    pull_ipp.append(time.perf_counter() - t0)
                    assert len(pulled[1]) == n
            # (not timed) what was timed arrived whole: the gathered and the pushed values
            got = cluster.run("pass", gather=["x"]).gathered["x"]
            assert (got[1] == r.values[1]).all() and len(got[0]) == n
            sums = cluster.run(kind.checksum("y")).values
            mine = eval(kind.checksum("local"), {"np": np, "torch": torch, "local": local})
            assert set(sums.values()) == {mine}, sums
            key = f"{kind.name}_{mb}MB"
            out[key] = {
                **_pair_median(ratio(copy, value), "value_vs_copy"),
                **_pair_median(ratio(copy, gather), "gather_vs_copy"),
                **_pair_median(ratio(copy, push), "push_vs_copy"),
                "value_GBps": 2 * mb / 1024 / statistics.median(value),
                "copy_GBps": 2 * mb / 1024 / statistics.median(copy),
            }
            if pull_ipp:  # (each pull right after the value it is paired with)
                out[key].update(
                    _pair_median(ratio(pull_ipp, value[: len(pull_ipp)]), "vs_ipyparallel_pull")
                )
            cluster.run("del x, y").raise_for_errors()
    return out


TRACKING_CELL = """
import time
raw = dist.all_reduce._notebook_dist_original
tracked = dist.all_reduce
check = torch.ones(1)  # both paths sum (1 + 1, then 2 + 2): what is timed works
tracked(check)
raw(check)
assert float(check) == 4.0, check
t = torch.zeros(8)
res = {"tracked": [], "raw": []}
dist.barrier()
for rnd in range(ROUNDS):
    for name, fn in (("tracked", tracked), ("raw", raw)) if rnd % 2 == 0 else (("raw", raw), ("tracked", tracked)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(1000):
            fn(t)
        res[name].append(time.perf_counter() - t0)
res
"""


def tracking_overhead(cluster, rounds: int = 7) -> dict:
    r = cluster.run(TRACKING_CELL.replace("ROUNDS", str(rounds)))
    r.raise_for_errors()
    res = r.values[0]
    return {
        "tracked_1000_s": summarize(res["tracked"]),
        "raw_1000_s": summarize(res["raw"]),
        "tracked_vs_raw": ratio(res["tracked"], res["raw"]),
    }


CHECKED_LOOP = """
import time
t = torch.zeros(NUMEL)
dist.barrier()
_t0 = time.perf_counter()
for _ in range(CALLS):
    dist.all_reduce(t)
(time.perf_counter() - _t0) / CALLS
"""


def check_collectives(cluster, reps: int, calls: int = 200) -> dict:
    """The price of ``--check-collectives``: one all_reduce per call with the arguments
    compared first (one all_gather of 512 bytes) / without, alternated, for a small
    tensor (where the check costs most) and a 4 MB one."""
    out = {}
    for name, numel in (("small_8_floats", 8), ("large_4MB", 1 << 20)):
        cell = CHECKED_LOOP.replace("NUMEL", str(numel)).replace("CALLS", str(calls))
        plain, checked = [], []
        for i in range(reps):
            order = [(False, plain), (True, checked)]
            for flag, into in order if i % 2 == 0 else order[::-1]:
                r = cluster.run(cell, check_collectives=flag)
                r.raise_for_errors()
                into.append(r.values[0])
        out[name] = {
            "plain_s": summarize(plain),
            "checked_s": summarize(checked),
            "checked_vs_plain": ratio(checked, plain),
            "added_us": (statistics.median(checked) - statistics.median(plain)) * 1e6,
        }
    return out


class _Sink:
    def update(self, st):
        pass

    def close(self, st):
        pass


def _widget_feed():
    """A real WidgetDashboard whose comms go nowhere (no front end in a benchmark)."""
    import ipywidgets.comm as ipw_comm
    from comm.base_comm import BaseComm

    from notebook_dist.ui import DashboardFeed
    from notebook_dist.ui.widget import WidgetDashboard

    class NullComm(BaseComm):
        def publish_msg(self, *a, **k):
            pass

    ipw_comm.create_comm = lambda **kw: NullComm(**kw)

    class NoFrontEnd:  # the display handle of a page nobody looks at
        def update(self, obj):
            pass

    return DashboardFeed(WidgetDashboard(display=lambda obj: NoFrontEnd()))


def training(cluster, steps: int, reps: int) -> dict:
    """DDP steps/s under ``%%distributed`` with the dashboard fed, and under torchrun, its
    workers under the policy the cluster's ranks run under (``scheduling`` compares the
    policies)."""
    cluster.run(TRAIN_SETUP).raise_for_errors()
    batch = {i["scheduling"] for i in cluster.bootstrap_info} == {"batch"}
    ours, theirs = [], []
    for _ in range(reps):
        feed = _widget_feed()
        r = cluster.run(TIMED_LOOP.replace("STEPS", str(steps)), on_update=feed)
        r.raise_for_errors()
        check_steps(r.values, steps)
        assert feed.updates > 0, "the dashboard was never fed"
        ours.append(r.values[0][0])
        _, stdout = _torchrun(["train", str(steps)], batch=batch)
        rate, ran = stdout.split("RESULT ")[1].split()[:2]
        assert int(ran) == steps, stdout
        theirs.append(float(rate))
    return {
        "scheduling": "batch" if batch else "normal",
        "notebook_steps_per_s": summarize(ours),
        "torchrun_steps_per_s": summarize(theirs),
        "notebook_vs_torchrun": ratio(ours, theirs),
    }


def folded_output(reps: int, n: int = 8) -> dict:
    """A cell in which each of ``n`` ranks prints 1000 lines, in a real kernel (its
    streams flush by a round trip to their IO thread, and what reaches the front end is
    messages), folded (the default from 4 ranks) against the same cell with
    ``--raw-output``, alternated: seconds from the request to the kernel's idle, and the
    stream messages the front end got. Every line is checked to have come. Then a cell that
    prints one line on each rank against an empty cell, alternated (10 cells a kind a
    round, their median)."""
    import tempfile

    from jupyter_client.manager import start_new_kernel

    folder = tempfile.mkdtemp(prefix="nd-bench-kernel-")
    env = dict(os.environ, IPYTHONDIR=os.path.join(folder, "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=folder)

    def run(code: str) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        msg_id = kc.execute(code)
        messages = lines = 0
        while True:
            msg = kc.get_iopub_msg(timeout=300)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "error":
                raise RuntimeError(content["evalue"])
            if kind == "stream":
                messages += 1
                lines += content["text"].count("\n")
            if kind == "status" and content["execution_state"] == "idle":
                return time.perf_counter() - t0, messages, lines

    cell = "for i in range(1000):\n    print(f'rank {nd.rank} line {i}')"
    got: dict[str, list] = {"folded": [], "raw": []}
    try:
        run(f"%load_ext notebook_dist\n%dist_init -n {n}")
        run(f"%%distributed --no-dashboard\n{cell}")  # (warm)
        for i in range(reps):
            for how in ("folded", "raw") if i % 2 == 0 else ("raw", "folded"):
                opt = " --raw-output" if how == "raw" else ""
                wall, messages, lines = run(f"%%distributed --no-dashboard{opt}\n{cell}")
                assert lines == n * 1000, (how, lines)
                got[how].append((wall, messages))
        # a cell that prints a line on each rank against an empty one: the line comes in
        # the rank's reply (what that saves is the notebook's wait for the rank's messages)
        cells = {"line": "print('hello from', nd.rank)", "empty": "pass"}
        for i in range(reps):
            for how in ("line", "empty") if i % 2 == 0 else ("empty", "line"):
                walls = []
                for _ in range(10):
                    wall, _, lines = run(f"%%distributed --no-dashboard\n{cells[how]}")
                    assert lines == (n if how == "line" else 0), (how, lines)
                    walls.append(wall)
                got.setdefault(how, []).append(statistics.median(walls))
        run("%dist_shutdown")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    walls = {how: [w for w, _ in got[how]] for how in ("folded", "raw")}
    return {
        "ranks": n,
        "folded_s": summarize(walls["folded"]),
        "raw_s": summarize(walls["raw"]),
        "folded_vs_raw": ratio(walls["folded"], walls["raw"]),
        "folded_messages": statistics.median(m for _, m in got["folded"]),
        "raw_messages": statistics.median(m for _, m in got["raw"]),
        "line_s": summarize(got["line"]),
        "empty_s": summarize(got["empty"]),
        "line_vs_empty": ratio(got["line"], got["empty"]),
    }


def scheduling(steps: int, reps: int) -> dict:
    """DDP steps/s of 2 CPU ranks under SCHED_BATCH (the default on CPU,
    ``DistConfig.rank_scheduling``) and under the normal policy: two clusters, their cells
    alternated, the order flipped every round; and torchrun's same loop under each policy
    in the same rounds. No widget is fed: the loop alone, with its nd.report each step."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    loop = TIMED_LOOP.replace("STEPS", str(steps))
    policies = ("batch", "normal")
    clusters = {}
    try:
        for policy in policies:
            config = DistConfig(spare_engines=0, rank_scheduling=policy)
            c = clusters[policy] = DistCluster(n=2, config=config).start()
            assert [i["scheduling"] for i in c.bootstrap_info] == [policy] * 2, policy
            c.run(TRAIN_SETUP).raise_for_errors()
            c.run(TIMED_LOOP.replace("STEPS", "20")).raise_for_errors()  # (its first steps)
        got: dict[str, list[float]] = {k: [] for k in ("batch", "normal", "tr_batch", "tr_normal")}
        for i in range(reps):
            for policy in policies if i % 2 == 0 else policies[::-1]:
                r = clusters[policy].run(loop)
                r.raise_for_errors()
                check_steps(r.values, steps)
                got[policy].append(r.values[0][0])
                _, stdout = _torchrun(["train", str(steps)], batch=policy == "batch")
                rate, ran = stdout.split("RESULT ")[1].split()[:2]
                assert int(ran) == steps, stdout
                got[f"tr_{policy}"].append(float(rate))
    finally:
        for c in clusters.values():
            c.shutdown()
    return {
        **{f"{k}_steps_per_s": summarize(v) for k, v in got.items()},
        "batch_vs_normal": ratio(got["batch"], got["normal"]),
        "torchrun_batch_vs_normal": ratio(got["tr_batch"], got["tr_normal"]),
        "batch_vs_torchrun_batch": ratio(got["batch"], got["tr_batch"]),
        "normal_vs_torchrun_normal": ratio(got["normal"], got["tr_normal"]),
    }


# the timed loop, also returning the CPU seconds the rank's process spent (all threads:
# the agent that publishes the dashboard's state included)
CPU_TIMED_LOOP = (
    "import time as _t\ndist.barrier()\n_t0, _c0 = _t.perf_counter(), _t.process_time()\n"
    + TRAIN_LOOP
    + "(STEPS / (_t.perf_counter() - _t0), _t.process_time() - _c0, step)\n"
)


REPORT_COST = """
import time as _t, statistics as _s
_loss = torch.tensor(1.5)
_us = []
for _ in range(5):
    _a = _t.perf_counter()
    for _i in range(1, 20001):
        nd.report(step=_i, total=20000, loss=_loss.item(), samples=64)
    _b = _t.perf_counter()
    for _i in range(1, 20001):
        _loss.item()
    _us.append(((_b - _a) - (_t.perf_counter() - _b)) / 20000 * 1e6)
_s.median(_us)
"""


def dashboard_overhead(cluster, steps: int, reps: int) -> dict:
    """DDP steps/s with the dashboard (nd.report every step, a live widget fed at 4 Hz and
    closed into its record) and without (no report, no widget), in ``reps`` back-to-back
    pairs of cells, the order flipped every pair.

    Single pairs swing by +-15% on this 2-core machine (Gloo's wake-ups on a busy box; the
    same under torchrun), so the figure needs hundreds of pairs: the geometric mean of the
    pair ratios, with a bootstrap interval. Cells of ~1 s charge the dashboard's per-cell
    costs (building the widget, closing it into its record) to few steps; shorter ones
    give more pairs a minute but weigh those costs more (200-step cells: 0.981x).
    """
    cluster.run(TRAIN_SETUP).raise_for_errors()
    on, off = [], []
    cpu_on, cpu_off = [], []  # steps per CPU-second, ranks and kernel together
    quiet = CPU_TIMED_LOOP.replace(
        "    nd.report(step=step, total=STEPS, loss=loss.item(), samples=64)\n", "    loss.item()\n"
    )
    codes = (CPU_TIMED_LOOP.replace("STEPS", str(steps)), quiet.replace("STEPS", str(steps)))
    kernel: dict[int, list[float]] = {0: [], 1: []}  # the kernel's CPU seconds per cell
    for i in range(reps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            c0 = time.process_time()  # every thread of this process, to the nanosecond
            if which == 0:
                feed = _widget_feed()
                r = cluster.run(codes[0], on_update=feed)
                feed.close(cluster.last_watch)
            else:
                r = cluster.run(codes[1])
            r.raise_for_errors()
            check_steps(r.values, steps)
            assert which == 1 or feed.updates > 0, "the dashboard was never fed"
            kernel[which].append(time.process_time() - c0)
            wall = min(v[0] for v in r.values.values())
            per_cpu = steps / (sum(v[1] for v in r.values.values()) + kernel[which][-1])
            (on if which == 0 else off).append(wall)
            (cpu_on if which == 0 else cpu_off).append(per_cpu)
    # the steadier, direct figure: what one nd.report costs inside a rank, against a step
    r = cluster.run(REPORT_COST)
    r.raise_for_errors()
    report_us = statistics.median(r.values.values())
    step_us = 1e6 / statistics.median(off)
    cell_s = steps / statistics.median(off)
    return {
        "steps_per_cell": steps,
        "pairs": reps,
        "report_us_per_call": report_us,
        "step_us_off": step_us,
        "report_share_of_step": report_us / step_us,
        "with_dashboard_steps_per_s": summarize(on),
        "without_steps_per_s": summarize(off),
        "on_vs_off": ratio(on, off),
        "steps_per_cpu_s_on": summarize(cpu_on),
        "steps_per_cpu_s_off": summarize(cpu_off),
        "on_vs_off_per_cpu": ratio(cpu_on, cpu_off),
        "kernel_cpu_ms_per_cell_on": 1e3 * statistics.median(kernel[0]),
        "kernel_cpu_ms_per_cell_off": 1e3 * statistics.median(kernel[1]),
        "kernel_extra_cpu_share": (statistics.median(kernel[0]) - statistics.median(kernel[1]))
        / cell_s,
    }


def growth(reps: int) -> dict:
    from notebook_dist import DistCluster

    out = {}
    for n in (1, 2, 4):
        with DistCluster(n=n) as c:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r = c.run("pass")
                times.append(time.perf_counter() - t0)
                r.raise_for_errors()
            c.run("x = torch.randn(4 * 2**20)").raise_for_errors()
            g = []
            for _ in range(3):
                t0 = time.perf_counter()
                c.run("pass", gather=["x"])
                g.append(time.perf_counter() - t0)
            out[f"{n}_ranks"] = {
                "dispatch_ms": 1000 * statistics.median(times),
                "gather_16MB_each_ms": 1000 * statistics.median(g),
            }
    return out


BENCH_SIZES = (64 << 10, 1 << 20, 4 << 20)


def bench_vs_torchrun(cluster, reps: int) -> dict:
    """%dist_bench's all_reduce bus bandwidth against the same timing loop under torchrun,
    alternating; per size, the ratio of medians, and their geometric mean."""
    from notebook_dist.bench import bench

    ours: dict[int, list[float]] = {s: [] for s in BENCH_SIZES}
    theirs: dict[int, list[float]] = {s: [] for s in BENCH_SIZES}
    spec = ",".join(f"{s // 1024}K" for s in BENCH_SIZES)
    for i in range(reps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            if which == 0:
                result = bench(cluster, ["all_reduce"], spec)
                for s, bw in result.busbw("all_reduce").items():
                    ours[s].append(bw)
            else:
                import json

                _, stdout = _torchrun(["bench", ",".join(map(str, BENCH_SIZES))])
                for row in json.loads(stdout.split("RESULT ", 1)[1]):
                    bytes_, secs = row["bytes"], row["seconds"]
                    theirs[bytes_].append(bytes_ / secs / 1e9 * 2 * (2 - 1) / 2)
    per_size = {
        str(s): {
            "notebook_busbw_GBps": statistics.median(ours[s]),
            "torchrun_busbw_GBps": statistics.median(theirs[s]),
            "ratio": statistics.median(ours[s]) / statistics.median(theirs[s]),
            "pairs": ratio(ours[s], theirs[s]),
        }
        for s in BENCH_SIZES
    }
    # each round's two runs were back to back: their ratio over the sizes (geometric mean)
    rounds = [geomean([ours[s][i] / theirs[s][i] for s in BENCH_SIZES]) for i in range(reps)]
    return {
        "per_size": per_size,
        "bench_vs_torchrun": geomean([v["ratio"] for v in per_size.values()]),
        "rounds_vs_torchrun": ratio(rounds, [1.0] * reps),
    }


PROFILED = """
import time
t = torch.ones(1 << 16)
direct = 0.0
for step in range(20):
    if nd.rank == 1:
        time.sleep(0.02)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    direct += time.perf_counter() - t0
direct
"""

PROFILER_LOOP = TRAIN_LOOP.replace(
    "    nd.report(step=step, total=STEPS, loss=loss.item(), samples=64)\n", ""
)
BY_HAND = (
    "import time as _t\n_t0 = _t.perf_counter()\n"
    "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n"
    + "".join("    " + line + "\n" for line in PROFILER_LOOP.strip("\n").splitlines())
    + "_t.perf_counter() - _t0\n"
)
BY_FLAG = (
    "import time as _t\n_t0 = _t.perf_counter()\n" + PROFILER_LOOP + "_t.perf_counter() - _t0\n"
)


def profile_accuracy_and_cost(cluster, reps: int) -> dict:
    """The profile's time in collectives on rank 0 against rank 0 timing each all_reduce
    itself; and a DDP loop under --profile against the same loop under a torch.profiler the
    cell starts by hand (the profile's cost is torch.profiler's own)."""
    accuracy = []
    for _ in range(reps):
        r = cluster.run(PROFILED, profile=True)
        r.raise_for_errors()
        accuracy.append(r.profile.ranks[0].collectives_s / r.values[0])
    cluster.run(TRAIN_SETUP).raise_for_errors()
    flag, hand = [], []
    steps = "100"
    for i in range(reps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            if which == 0:
                r = cluster.run(BY_FLAG.replace("STEPS", steps), profile=True)
            else:
                r = cluster.run(BY_HAND.replace("STEPS", steps))
            r.raise_for_errors()
            (flag if which == 0 else hand).append(max(r.values.values()))
    return {
        "collectives_vs_direct": ratio(accuracy, [1.0] * len(accuracy)),
        "flag_vs_by_hand": ratio(flag, hand),
    }


# rank 1 skips the all_reduce that rank 0 waits in: the classic mismatch
HANG_CELL = "t = torch.ones(4)\nif nd.rank == 0:\n    dist.all_reduce(t)\n"
HANG_AFTER_S = 3.0


class _Verdict(KeyboardInterrupt):
    """The user's Ctrl-C, pressed once the verdict shows."""


def time_to_verdict(cluster, cell: str, names: str) -> float:
    """Seconds from the start of ``cell`` (which hangs) to the doctor's verdict, which must
    contain ``names``; the hang is then released with Ctrl-C, as a user would, and the
    ranks carry on (checked)."""
    import io

    seen: dict = {}
    t0 = time.monotonic()

    def on_update(watch):
        if "s" in seen:  # pressed once; the interrupt that follows polls here too
            return
        if watch.shown_verdict or time.monotonic() - t0 > 10 * HANG_AFTER_S:
            seen["s"], seen["verdict"] = time.monotonic() - t0, watch.shown_verdict or ""
            raise _Verdict()

    try:
        cluster.run(cell, hang_after=HANG_AFTER_S, on_update=on_update, out=io.StringIO())
    except KeyboardInterrupt:
        pass
    if names not in seen.get("verdict", "").lower():
        raise RuntimeError(f"no verdict naming {names}: {seen.get('verdict')!r}")
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)").raise_for_errors()  # carried on
    return seen["s"]


def doctor_latency(cluster, reps: int) -> dict:
    """From the start of a cell that hangs to the doctor's verdict, against hang-after (the
    quiet time it waits for by design: 1.0 would be a verdict the instant it may give one)."""
    took = [time_to_verdict(cluster, HANG_CELL, "rank 0") for _ in range(reps)]
    return {"verdict_vs_hang_after": ratio(took, [HANG_AFTER_S] * len(took))}


HEAL_SETUP = (
    "torch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),"
    " torch.nn.Linear(64, 8))\nopt = torch.optim.Adam(model.parameters())\n"
)


def heal_and_restart(reps: int) -> dict:
    """Getting ranks back, against a cold ``%dist_init -n 2`` in the same run: ``%dist_heal``
    of a killed rank (model and optimizer copied from a survivor) and ``%dist_restart
    --replay`` (the setup replayed), both from a warm pool of 2 spares. Each checks its
    work: the copied model equals the survivor's, the restarted ranks' group sums."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    def pool_full(c):
        deadline = time.monotonic() + 120
        while len(c.processes.pool.spares) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(c.processes.pool.spares) == 2, c.processes.pool.error

    cold, heal, restart, phases = [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        c = DistCluster(n=2, config=DistConfig(spare_engines=2)).start()
        cold.append(time.perf_counter() - t0)
        try:
            summed = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
            assert dict(summed.values) == {0: 2.0, 1: 2.0}, summed.values
            c.run(HEAL_SETUP).raise_for_errors()
            pool_full(c)
            try:
                c.run("import os\nif nd.rank == 1:\n    os._exit(1)\ndist.barrier()")
            except ClusterError:
                pass
            t0 = time.perf_counter()
            healed = c.heal(["model", "opt"])
            heal.append(time.perf_counter() - t0)
            phases.append(healed.phases)
            assert c.compare("model").agree, "the healed rank's model differs"
            pool_full(c)
            history = list(c.history)
            t0 = time.perf_counter()
            c.restarted().replay(history)
            restart.append(time.perf_counter() - t0)
            summed = c.run("t = torch.ones(1)\ndist.all_reduce(t)\n(float(t), 'opt' in globals())")
            assert dict(summed.values) == {0: (2.0, True), 1: (2.0, True)}, summed.values
        finally:
            c.shutdown()
    return {
        "dist_init_s": summarize(cold),
        "heal_s": summarize(heal),
        "restart_replay_s": summarize(restart),
        "heal_phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "heal_vs_init": ratio(heal, cold),
        "restart_vs_init": ratio(restart, cold),
    }
