"""Magics for where the time goes: the last cell's profile, and collective bandwidth."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from notebook_dist.session import SESSION

from .magics import no_arguments, parse_argstring, refuse, usage_errors


@magics_class
class PerformanceMagics(Magics):
    """%dist_profile, %dist_bench."""

    @line_magic
    def dist_profile(self, line: str = ""):
        """The profile of the last cell run with ``%%distributed --profile``, again.

        In [5]: %%distributed --profile
           ...: train(steps=20)
        In [6]: %dist_profile
        """
        no_arguments("%dist_profile", line)
        if SESSION.last_profile is None:
            refuse("no cell has been profiled yet: run one with %%distributed --profile")
        return SESSION.last_profile

    @magic_arguments()
    @argument(
        "ops",
        nargs="*",
        metavar="OP",
        help="collectives to time: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all "
        "(default: all five)",
    )
    @argument(
        "--sizes",
        default="1K-16M",
        help="sizes S as nccl-tests counts them: a range of powers of two (1K-256M), one size "
        "(1M) or a list (4K,1M,64M); K, M, G = 2**10, 2**20, 2**30 bytes (default 1K-16M)",
    )
    @argument("--dtype", default="float32", help="element type (default float32)")
    @line_magic
    def dist_bench(self, line: str = ""):
        """Collective bandwidth on the ranks, as nccl-tests reports it: per op and size, the
        time, algbw = S / t and busbw = algbw x factor(ranks), with a plot of busbw.

        In [7]: %dist_bench all_reduce --sizes 1K-64M
        %dist_bench: 2 ranks, gloo, float32
        op          size     time      algbw       busbw
        all_reduce  1 KiB    95.1 us   0.011 GB/s  0.011 GB/s
        ...
        """
        from notebook_dist.bench import bench

        args = parse_argstring(self.dist_bench, line)
        with usage_errors():
            return bench(SESSION.live(), args.ops, args.sizes, args.dtype)
