"""Monarch (torchmonarch) side by side with notebook_dist, in a plain script, as issue
"Scale" measured it: the time from nothing to a Gloo group of 2 processes with a checked
all_reduce done, and an empty call on every process with its values returned.

    python benchmarks/monarch_job.py [CALLS]     (a Python with torchmonarch installed)

Prints one line ``RESULT {json}``: ``start_s``, ``call_s`` (median of CALLS empty calls).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

T0 = time.perf_counter()


def main(calls: int) -> dict:
    from monarch.actor import Actor, current_rank, endpoint, this_host

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Rank(Actor):
        @endpoint
        def join(self, world_size: int, port: int) -> float:
            import torch
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank = current_rank().rank
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            t = torch.ones(1)
            dist.all_reduce(t)
            return float(t)

        @endpoint
        def nothing(self) -> int:
            return current_rank().rank

    procs = this_host().spawn_procs(per_host={"procs": 2})
    ranks = procs.spawn("ranks", Rank)
    summed = list(ranks.join.call(2, port).get())
    start = time.perf_counter() - T0
    assert [v for _, v in summed] == [2.0, 2.0], summed
    for _ in range(5):
        ranks.nothing.call().get()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        got = ranks.nothing.call().get()
        times.append(time.perf_counter() - t0)
    assert sorted(v for _, v in got) == [0, 1], got
    return {"start_s": start, "call_s": statistics.median(times)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)), flush=True)
    os._exit(0)  # (Monarch's process mesh ends with this process)
