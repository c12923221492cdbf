"""DDP on 2 real Gloo ranks matches one process trained on the whole batch."""

from __future__ import annotations

import io
import time

import torch

DDP_CELL = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(123)
X, Y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
half = X.shape[0] // nd.world_size
Xr, Yr = X[nd.rank * half:(nd.rank + 1) * half], Y[nd.rank * half:(nd.rank + 1) * half]
for step in range(20):
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(Xr), Yr).backward()
    opt.step()
{k: v.detach().clone() for k, v in model.state_dict().items()}
"""


def _single_process_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(123)
    X, Y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
    return model.state_dict()


def test_ddp_20_steps_matches_single_process(live, run):
    out = run("%%distributed\n" + DDP_CELL)
    assert out.error is None, out.output
    states = out.result.result
    ref = _single_process_reference()
    assert states.ranks == [0, 1]
    for name, value in ref.items():
        assert torch.equal(states[0][name], states[1][name]), f"{name} differs between ranks"
        assert torch.allclose(states[0][name], value, atol=1e-6), (
            f"{name} differs from one-process training"
        )
    # and training did move the weights (a test that cannot fail would not notice)
    torch.manual_seed(0)
    init = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    ).state_dict()
    assert not torch.allclose(init["0.weight"], states[0]["0.weight"])


class _Stamped(io.StringIO):
    def __init__(self):
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def write(self, s):
        self.stamps.append((time.monotonic(), s))
        return super().write(s)


def test_output_arrives_while_the_cell_runs(live):
    out = _Stamped()
    t0 = time.monotonic()
    result = live.run(
        "import time\nprint('early', flush=True)\ntime.sleep(3)\nprint('late')", out=out
    )
    t_end = time.monotonic()
    assert not result.errors
    early = [t for t, s in out.stamps if "early" in s]
    late = [t for t, s in out.stamps if "late" in s]
    assert len(early) == 2 and len(late) == 2, out.getvalue()  # one line per rank
    assert max(early) - t0 < t_end - t0 - 2.0, "the first lines only arrived at the end of the cell"
