"""The headless demo: a small DDP training on every rank, run through the Python API.

    python -m notebook_dist.demo [-n N] [--steps S]

Starts 2 CPU ranks on Gloo (or one rank per GPU with NCCL), trains a small model with
DistributedDataParallel, prints each rank's loss as it goes, and checks that the
replicas ended identical.
"""

from __future__ import annotations

import argparse
import sys
import time

TRAIN_CELL = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)                      # same initial model on every rank
dev = torch.device(nd.device)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(dev)
ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

g = torch.Generator().manual_seed(1)      # one global dataset; each rank takes its slice
X = torch.randn(256, 8, generator=g)
y = X.sum(dim=1, keepdim=True).sin()
mine = slice(nd.rank, None, nd.world_size)
Xr, yr = X[mine].to(dev), y[mine].to(dev)

for step in range(1, STEPS + 1):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(Xr), yr)
    loss.backward()
    opt.step()
    if step % max(1, STEPS // 5) == 0 or step == 1:
        print(f"step {step:3d}  loss {loss.item():.4f}")

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
flat
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-n", type=int, default=None, help="ranks (default: one per GPU, else 2 CPU ranks)"
    )
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)

    from notebook_dist import DistCluster

    t0 = time.perf_counter()
    with DistCluster(n=args.n) as cluster:
        print(
            f"started {cluster.world_size} ranks ({cluster.backend}) in {time.perf_counter() - t0:.1f} s"
        )
        print(cluster.table())
        result = cluster.run(TRAIN_CELL.replace("STEPS", str(args.steps)), filename="demo")
        result.raise_for_errors()
        params = result.values
        ref = params[0]
        in_sync = all(bool((p == ref).all()) for p in params.values())
        print(
            f"trained {args.steps} steps on {cluster.world_size} ranks in {result.elapsed_s:.1f} s; "
            f"replicas in sync: {'yes' if in_sync else 'NO'} ({ref.numel()} parameters compared)"
        )
    return 0 if in_sync else 1


if __name__ == "__main__":
    sys.exit(main())
