"""notebook_dist in a plain script, measured as benchmarks/monarch_job.py measures Monarch:
nothing to a Gloo group of 2 ranks with a checked all_reduce done, then empty calls on
every rank with their values returned (``DistCluster.run`` of an empty cell, and
``apply`` of a function).

    python benchmarks/ours_job.py [CALLS]

Prints one line ``RESULT {json}``: ``start_s``, ``cell_s``, ``apply_s`` (medians).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

T0 = time.perf_counter()


def rank() -> int:
    import notebook_dist as nd

    return nd.rank


def main(calls: int) -> dict:
    from notebook_dist import DistCluster

    c = DistCluster(n=2).start()
    try:
        summed = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        start = time.perf_counter() - T0
        assert dict(summed.values) == {0: 2.0, 1: 2.0}, summed.values
        out = {"start_s": start}
        calls_of = {
            "cell_s": lambda: dict(c.run("nd.rank").values),
            "apply_s": lambda: dict(c.apply(rank)),
        }
        for name, call in calls_of.items():
            for _ in range(5):
                call()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                got = call()
                times.append(time.perf_counter() - t0)
            assert sorted(got.values()) == [0, 1], got
            out[name] = statistics.median(times)
        return out
    finally:
        c.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)), flush=True)
