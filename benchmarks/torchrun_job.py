"""The torchrun side of the side-by-side benchmarks (run by benchmarks/run.py)."""

import os
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
dist.init_process_group("gloo")
if mode == "startup":
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print(f"RESULT {float(t)}")  # the caller checks that it summed
elif mode == "bench":  # the same timing loop as %dist_bench, under torchrun
    import json

    from notebook_dist.runtime.bench import run

    sizes = [int(s) for s in sys.argv[2].split(",")]
    rows = run(["all_reduce"], sizes, "float32")
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows))
elif mode == "train":
    steps = int(sys.argv[2])
    sys.path.insert(0, os.path.dirname(__file__))
    from cases import TRAIN_LOOP, TRAIN_SETUP

    ns = {
        "nd": type(
            "nd",
            (),
            {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "report": staticmethod(lambda **k: None),
            },
        )
    }
    exec(TRAIN_SETUP, ns)
    dist.barrier()
    t0 = time.perf_counter()
    exec(TRAIN_LOOP.replace("STEPS", str(steps)), ns)
    elapsed = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(f"RESULT {steps / elapsed} {ns['step']}")  # the caller checks every step ran
_last = dist.barrier(async_op=True)  # kept until exit: see FOOTER in notebook_dist/export.py
_last.wait()
dist.destroy_process_group()
