"""How Linux schedules the ranks (DistConfig.rank_scheduling, %dist_init --scheduling): CPU
ranks run every thread under SCHED_BATCH, the ones their group and their cells make later
included, while the notebook keeps the normal policy; "normal" leaves them as any process;
GPU ranks are normal unless asked; a policy that is not one is refused before anything
starts."""

from __future__ import annotations

import os

import pytest

from notebook_dist.config import DistConfig
from notebook_dist.errors import PreflightError
from notebook_dist.request import ClusterRequest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's SCHED_BATCH")

#: on a rank: the threads (by name) under each policy, and the policy of a thread the
#: cell starts
THREADS = """
import os, threading
_go = threading.Event()
_t = threading.Thread(target=_go.wait)
_t.start()
_policies = {}
for _tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{_tid}/comm") as _f:
        _policies.setdefault(os.sched_getscheduler(int(_tid)), set()).add(_f.read().strip())
_own = os.sched_getscheduler(_t.native_id)
_go.set()
_t.join()
({k: sorted(v) for k, v in _policies.items()}, _own)
"""


def test_policies_by_backend_and_what_is_refused():
    from notebook_dist.config import scheduling

    assert scheduling(DistConfig(), "gloo") == "batch"
    assert scheduling(DistConfig(), "nccl") == "normal"
    assert scheduling(DistConfig(rank_scheduling="batch"), "nccl") == "batch"
    assert scheduling(DistConfig(rank_scheduling="normal"), "gloo") == "normal"
    with pytest.raises(ValueError, match="rank_scheduling 'fast': give 'auto', 'batch', 'normal'"):
        scheduling(DistConfig(rank_scheduling="fast"), "gloo")
    with pytest.raises(PreflightError, match="--scheduling fast: give auto, batch or normal"):
        ClusterRequest(n=2, scheduling="fast").check()
    for said in ("auto", "batch", "normal"):  # (planned, not started)
        assert ClusterRequest(n=2, scheduling=said).cluster().config.rank_scheduling == said


@pytest.mark.parametrize("asked, policy", [("auto", "SCHED_BATCH"), ("normal", "SCHED_OTHER")])
def test_cpu_ranks_run_every_thread_under_the_policy_asked_and_the_notebook_stays_normal(
    asked, policy
):
    from notebook_dist import DistCluster

    want = getattr(os, policy)
    config = DistConfig(spare_engines=0, rank_scheduling=asked)
    with DistCluster(n=2, config=config) as c:
        assert [i["scheduling"] for i in c.bootstrap_info] == [asked.replace("auto", "batch")] * 2
        r = c.run(THREADS)
        r.raise_for_errors()
        for rank, (policies, own) in r.values.items():
            assert list(policies) == [want] and own == want, (rank, policies, own)
            assert {"gloo_tcp_loop", "pt_gloo_runloop", "ZMQbg/IO/0"} <= set(policies[want])
        # a collective after it, as the cells' threads would run one
        assert c.run("t = torch.ones(1); dist.all_reduce(t); t.item()").values[0] == 2.0
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (the notebook's own policy)
