"""Two checkouts side by side in one run: start-up and the dispatch of an empty cell, for a
structural change that must not slow either.

    python -m benchmarks.ab OLD_CHECKOUT [NEW_CHECKOUT] [--rounds 6] [--cells 100]

Each round starts a 2-rank cluster from each checkout in turn (the order flips every
round), times ``DistCluster(n=2).start()`` and ``--cells`` empty cells; the kernel and its
engines import that checkout's code (PYTHONPATH). The ratios are new / old, of medians and
per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROBE = """
import json, statistics, time
import notebook_dist
from notebook_dist import DistCluster
t0 = time.perf_counter()
c = DistCluster(n=2).start()
startup = time.perf_counter() - t0
try:
    cells = []
    for _ in range(5):
        c.run("pass")
    for _ in range(CELLS):
        t0 = time.perf_counter()
        r = c.run("x = 1")
        cells.append(time.perf_counter() - t0)
        r.raise_for_errors()
    assert dict(c.run("x").values) == {0: 1, 1: 1}  # the timed cells ran
finally:
    c.shutdown()
print("RESULT " + json.dumps({"startup_s": startup, "cell_s": statistics.median(cells),
                               "from": notebook_dist.__file__}))
"""


def measure(checkout: Path, cells: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE.replace("CELLS", str(cells))],
        capture_output=True,
        text=True,
        env=env,
        cwd=checkout,
        timeout=600,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    result = json.loads(line[7:])
    assert result["from"].startswith(str(checkout)), result["from"]  # that checkout's code ran
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="?", default=HERE.parent)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cells", type=int, default=100)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for which in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[which].append(measure(getattr(args, which).resolve(), args.cells))
    report = {}
    for key in ("startup_s", "cell_s"):
        old = [r[key] for r in runs["old"]]
        new = [r[key] for r in runs["new"]]
        report[key] = {
            "old_median": statistics.median(old),
            "new_median": statistics.median(new),
            "new_vs_old": statistics.median(new) / statistics.median(old),
            "pair_median": statistics.median(n / o for n, o in zip(new, old)),
        }
        print(
            f"{key:10s} old {report[key]['old_median'] * 1e3:8.1f} ms  new "
            f"{report[key]['new_median'] * 1e3:8.1f} ms  new/old {report[key]['new_vs_old']:.3f}x "
            f"(pair median {report[key]['pair_median']:.3f}x, {args.rounds} rounds)"
        )
    print("RESULT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
