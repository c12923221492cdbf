"""Run every benchmark in one go; print a table of ratios and write a JSON file.

    python -m benchmarks.run [--quick] [--out benchmarks/results/latest.json]

Ratios are of two things measured side by side in this run (these machines are noisy:
absolute times are context, not claims). Targets are from the project's issues.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402

TARGETS = [
    # (label, path in results, how the ratio must compare, bound)
    (
        "startup: %dist_init -n 2 / torchrun init+all_reduce",
        ("startup", "startup_vs_torchrun", "pair_median"),
        "<=",
        0.4,
    ),
    (
        "startup: %dist_init -n 2 after %load_ext (its fork server ready) / torchrun",
        ("startup", "fork_server_ahead_vs_torchrun", "pair_median"),
        "<=",
        0.4,
    ),
    (
        "startup: engines forked / each a fresh Python",
        ("startup", "forked_vs_fresh_engines", "pair_median"),
        "<=",
        1.0,
    ),
    (
        "monarch: start to a checked Gloo group, ours / Monarch's",
        ("monarch", "start_vs_monarch", "pair_median"),
        "<=",
        1.0,
    ),
    (
        "monarch: empty cell on 2 ranks / Monarch's empty call",
        ("monarch", "cell_vs_monarch_call", "pair_median"),
        "<=",
        3.0,
    ),
    (
        "monarch: apply of a function on 2 ranks / Monarch's empty call",
        ("monarch", "apply_vs_monarch_call", "pair_median"),
        "<=",
        3.0,
    ),
    (
        "scale: %dist_init -n 16 / -n 2",
        ("scale", "16_ranks", "start_s_vs_2", "pair_median"),
        "<=",
        2.0,
    ),
    (
        "scale: %dist_init -n 32 / -n 2",
        ("scale", "32_ranks", "start_s_vs_2", "pair_median"),
        "<=",
        3.0,
    ),
    (
        "scale: %dist_init -n 16 / -n 2, the cell after %load_ext",
        ("scale", "16_ranks", "start_ahead_s_vs_2", "pair_median"),
        "<=",
        2.0,
    ),
    (
        "scale: %dist_init -n 32 / -n 2, the cell after %load_ext",
        ("scale", "32_ranks", "start_ahead_s_vs_2", "pair_median"),
        "<=",
        3.0,
    ),
    (
        "scale: empty cell, kernel CPU, 16 ranks / 2",
        ("scale", "16_ranks", "cell_cpu_s_vs_2", "pair_median"),
        "<=",
        1.5,
    ),
    (
        "scale: empty cell, wall, 16 ranks / 2",
        ("scale", "16_ranks", "cell_s_vs_2", "pair_median"),
        "<=",
        2.0,
    ),
    (
        "routes: empty cell, kernel CPU, 16 ranks / 2, both by the ranks' pipes",
        ("routes", "cell_cpu_s_16_pipes_vs_2", "pair_median"),
        "<=",
        1.5,
    ),
    (
        "routes: the same, each cell 50 ms after the last (from an idle kernel)",
        ("routes", "idle_cell_cpu_s_16_pipes_vs_2", "pair_median"),
        "<=",
        1.5,
    ),
    (
        "routes: the same back to back, / 2 ranks whose cell waits 3 ms (as 16 ranks' takes)",
        ("routes", "cell_cpu_s_16_pipes_vs_2_waiting", "pair_median"),
        "<=",
        1.5,
    ),
    (
        "routes: empty cell, wall, 16 ranks / 2, both by the ranks' pipes",
        ("routes", "cell_s_16_pipes_vs_2", "pair_median"),
        "<=",
        2.0,
    ),
    (
        "routes: empty cell, kernel CPU, 16 ranks through the relay / 2 by the pipes",
        ("routes", "cell_cpu_s_16_relay_vs_2", "pair_median"),
        "<=",
        1.5,
    ),
    (
        "routes: empty cell, wall, 16 ranks through the relay / 2 by the pipes",
        ("routes", "cell_s_16_relay_vs_2", "pair_median"),
        "<=",
        2.0,
    ),
    (
        "dispatch: empty cell / view.execute",
        ("dispatch", "cell_vs_view_execute", "pair_median"),
        "<=",
        1.2,
    ),
    (
        "dispatch: nbdistributed cell / ours",
        ("dispatch", "nbdistributed", "vs_ours", "pair_median"),
        ">=",
        10,
    ),
    (
        "tracking: 1000 all_reduce tracked / raw",
        ("tracking", "tracked_vs_raw", "pair_median"),
        "<=",
        1.02,
    ),
    (
        "training: %%distributed+dashboard / torchrun steps/s",
        ("training", "notebook_vs_torchrun", "pair_median"),
        ">=",
        0.97,
    ),
    (
        "scheduling: DDP steps/s, CPU ranks under SCHED_BATCH / normal",
        ("scheduling", "batch_vs_normal", "pair_median"),
        ">=",
        1.0,
    ),
    (
        "scheduling: the same, / torchrun's workers under SCHED_BATCH",
        ("scheduling", "batch_vs_torchrun_batch", "pair_median"),
        ">=",
        0.97,
    ),
    (
        "dashboard: DDP steps/s on / off (geometric mean of pairs)",
        ("dashboard", "on_vs_off", "pair_geomean"),
        ">=",
        0.98,
    ),
    (
        "bench: %dist_bench all_reduce busbw / torchrun's",
        ("bench", "rounds_vs_torchrun", "pair_median"),
        ">=",
        0.95,
    ),
    (
        # the bound: the verdict within hang-after + 5 s, for hang-after 3 s
        "doctor: hang to verdict / hang-after (3 s)",
        ("doctor", "verdict_vs_hang_after", "pair_median"),
        "<=",
        2.67,  # (3 + 5) / 3
    ),
    (
        "heal: %dist_heal of a killed rank / %dist_init -n 2",
        ("heal", "heal_vs_init", "pair_median"),
        "<=",
        0.3,
    ),
    (
        "heal: %dist_restart --replay (warm pool) / %dist_init -n 2",
        ("heal", "restart_vs_init", "pair_median"),
        "<=",
        0.3,
    ),
    (
        "profile: rank 0's time in collectives / its own timing",
        ("profile", "collectives_vs_direct", "pair_median"),
        ">=",
        0.9,
    ),
    (
        "profile: DDP loop --profile / torch.profiler by hand",
        ("profile", "flag_vs_by_hand", "pair_median"),
        "<=",
        1.1,
    ),
]


def _get(results, path):
    for key in path:
        if not isinstance(results, dict) or key not in results:
            return None
        results = results[key]
    return results


def _with_ci(results: dict, name: str) -> str:
    """``results[name]`` as a ratio, with its 95% interval (``name_ci95``) when it has one."""
    ci = results.get(f"{name}_ci95")
    return f"{results[name]:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def _skipped(results, path) -> str | None:
    """Why a side of a comparison could not run: the "skipped" of a dict on the path."""
    for key in path:
        if not isinstance(results, dict):
            return None
        if "skipped" in results:
            return results["skipped"]
        results = results.get(key)
    return None


CASE_NAMES = (
    "startup",
    "dispatch",
    "transfer",
    "tracking",
    "training",
    "scheduling",
    "dashboard",
    "growth",
    "bench",
    "profile",
    "doctor",
    "checks",
    "heal",
    "scale",
    "routes",
    "monarch",
    "output",
)


def _dispatch(cluster, shell, capture_output, quick: bool) -> dict:
    with capture_output():
        out = cases.dispatch(cluster, shell, 40 if quick else 100)
        # (skipped, with why, when it could not run or did not do the work it timed)
        out["nbdistributed"] = cases.nbdistributed_against_ours(
            cluster, shell, 2 if quick else 5, 10 if quick else 30
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "latest.json")
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated: "
        + ",".join(CASE_NAMES)
        + " (refreshes them in --out, keeps the rest)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quick = args.quick
    only = set(args.only.split(",")) if args.only else set(CASE_NAMES)
    t_all = time.perf_counter()
    results: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    import torch

    results["torch"] = torch.__version__
    if "startup" in only:
        print("startup ...", flush=True)
        results["startup"] = cases.startup(3 if quick else 9)

    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from IPython.utils.capture import capture_output

    from notebook_dist import DistCluster, session

    on_cluster = {
        "dispatch": lambda c: _dispatch(c, shell, capture_output, quick),
        "transfer": lambda c: cases.transfer(c, (1, 16) if quick else (1, 16, 256), reps=3),
        "tracking": lambda c: cases.tracking_overhead(c, 5 if quick else 9),
        "training": lambda c: cases.training(c, 200 if quick else 1200, 2 if quick else 7),
        # hundreds of back-to-back pairs of ~1 s cells: single pairs swing +-15% here
        "dashboard": lambda c: cases.dashboard_overhead(c, 500, 4 if quick else 400),
        "bench": lambda c: cases.bench_vs_torchrun(c, 2 if quick else 6),
        "profile": lambda c: cases.profile_accuracy_and_cost(c, 3 if quick else 10),
        "doctor": lambda c: cases.doctor_latency(c, 3 if quick else 8),
        "checks": lambda c: cases.check_collectives(c, 4 if quick else 12),
    }
    if only & set(on_cluster):
        shell = TerminalInteractiveShell.instance()
        shell.run_line_magic("load_ext", "notebook_dist")
        cluster = DistCluster(n=2).start()
        session.set_current(cluster)
        try:
            for name, fn in on_cluster.items():
                if name in only:
                    print(f"{name} ...", flush=True)
                    results[name] = fn(cluster)
        finally:
            session.shutdown()
    if "scheduling" in only:
        print("scheduling ...", flush=True)
        results["scheduling"] = cases.scheduling(200 if quick else 1200, 2 if quick else 7)
    if "heal" in only:
        print("heal ...", flush=True)
        results["heal"] = cases.heal_and_restart(3 if quick else 9)
    if "scale" in only:
        print("scale ...", flush=True)
        sizes = (2, 4, 16) if quick else cases.SCALE_SIZES
        results["scale"] = cases.scale(2 if quick else 9, 10 if quick else 30, sizes)
    if "routes" in only:
        print("routes ...", flush=True)
        results["routes"] = cases.routes(2 if quick else 9, 30 if quick else 100)
    if "monarch" in only:
        print("monarch ...", flush=True)
        results["monarch"] = cases.monarch(3 if quick else 9)
    if "output" in only:
        print("output ...", flush=True)
        results["output"] = cases.folded_output(3 if quick else 9)
    if "growth" in only:
        print("growth ...", flush=True)
        results["growth"] = cases.growth(20 if quick else 50)
    results["total_s"] = time.perf_counter() - t_all

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dates = {}
    if args.only and out.exists():  # refresh those cases; keep the others, with their dates
        earlier = json.loads(out.read_text())
        dates = earlier.get("dates") or {n: earlier["date"] for n in CASE_NAMES if n in earlier}
        results = {**earlier, **results}
    dates.update({n: results["date"] for n in CASE_NAMES if n in only and n in results})
    results["dates"] = dates
    out.write_text(json.dumps(results, indent=2))
    print()
    print(f"{'benchmark':55s} {'ratio':>26s}  {'target':>8s}  met")
    for label, path, op, bound in TARGETS:
        why = _skipped(results, path)
        if why is not None:  # no ratio for a side that could not run
            print(f"{label:55s} skipped: {why[:200]}")
            continue
        value = _get(results, path)
        text = "n/a" if value is None else f"{value:.3f}"
        interval = _get(results, path[:-1] + (path[-1] + "_ci95",))
        if interval:
            text += f" (95% {interval[0]:.3f}-{interval[1]:.3f})"
        ok = value is not None and (value <= bound if op == "<=" else value >= bound)
        met = "-" if value is None else ("yes" if ok else "NO")
        target = f"{op} {bound:g}x"
        print(f"{label:55s} {text:>26s}  {target:>8s}  {met}")
    for key, t in results.get("transfer", {}).items():
        extra = (
            f", {_with_ci(t, 'vs_ipyparallel_pull')} ipyparallel's pull"
            if "vs_ipyparallel_pull" in t
            else ""
        )
        print(
            f"transfer {key:14s} value {_with_ci(t, 'value_vs_copy')} copy, gather "
            f"{_with_ci(t, 'gather_vs_copy')}, push {_with_ci(t, 'push_vs_copy')} "
            f"(target >= 0.5x){extra}"
        )
    for key, t in results.get("checks", {}).items():
        print(
            f"--check-collectives, all_reduce of {key}: {t['checked_vs_plain']['pair_median']:.2f}x "
            f"without it, +{t['added_us']:.0f} us a call"
        )
    for n, g in results.get("scale", {}).items():
        print(
            f"scale {n}: start {g['start_s']['median']:.2f} s ({g['start_s_vs_2']['pair_median']:.2f}x 2 ranks), "
            + (
                f"after %load_ext {g['start_ahead_s']['median']:.2f} s "
                f"({g['start_ahead_s_vs_2']['pair_median']:.2f}x), "
                if "start_ahead_s" in g
                else ""
            )
            + f"empty cell {1000 * g['cell_s']['median']:.1f} ms ({g['cell_s_vs_2']['pair_median']:.2f}x), "
            f"kernel CPU {1000 * g['cell_cpu_s']['median']:.1f} ms ({g['cell_cpu_s_vs_2']['pair_median']:.2f}x), "
            + (
                f"the floor of {n.split('_')[0]} bare processes answering one frame each: wall "
                f"{g['echo_floor_s_vs_2']['pair_median']:.2f}x, sender's CPU "
                f"{g['echo_floor_cpu_s_vs_2']['pair_median']:.2f}x 2 of them; "
                if "echo_floor_s_vs_2" in g
                else ""
            )
            + (
                f"through pipes: wall {g['pipe_floor_s_vs_2']['pair_median']:.2f}x, sender's "
                f"CPU {g['pipe_floor_cpu_s_vs_2']['pair_median']:.2f}x; "
                if "pipe_floor_s_vs_2" in g
                else ""
            )
            + f"gather 1 MB each {1000 * g['gather_1MB_each_s']['median']:.0f} ms "
            f"({g['gather_1MB_each_s_vs_2']['pair_median']:.2f}x)"
            + (
                f", verdict {g['verdict_s']['median']:.1f} s ({g['verdict_s_vs_2']['pair_median']:.2f}x)"
                if "verdict_s" in g
                else ""
            )
            + (
                f"; 1000 lines printed by each rank {g['lines_per_s']:.0f} lines/s "
                f"({g['lines_per_s_vs_alone']['pair_median']:.2f}x one process alone, "
                f"{g['alone_lines_per_s']:.0f}/s), a rank's own prints "
                f"{g['rank_printing_vs_alone']['pair_median']:.2f}x alone"
                if "lines_per_s" in g
                else ""
            )
        )
    for n, g in results.get("growth", {}).items():
        print(
            f"growth {n}: dispatch {g['dispatch_ms']:.1f} ms, gather 16 MB per rank {g['gather_16MB_each_ms']:.0f} ms"
        )
    o = results.get("output")
    if o:
        print(
            f"output: {o['ranks']} ranks print 1000 lines each in a kernel, folded "
            f"{o['folded_s']['median']:.2f} s / --raw-output {o['raw_s']['median']:.2f} s: "
            f"{_with_ci(o['folded_vs_raw'], 'pair_median')}; stream messages {o['folded_messages']:.0f} "
            f"and {o['raw_messages']:.0f}"
        )
        if "line_vs_empty" in o:
            print(
                f"output: a cell printing a line on each rank {o['line_s']['median'] * 1e3:.1f} ms"
                f" / an empty cell {o['empty_s']['median'] * 1e3:.1f} ms: "
                f"{_with_ci(o['line_vs_empty'], 'pair_median')}"
            )
    print(f"\nwritten to {args.out} ({results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
