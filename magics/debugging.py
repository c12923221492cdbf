"""Magics for when things go wrong and for moving on: stacks, diagnosis, restart,
cross-rank inspection, and export to a torchrun script."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from notebook_dist.session import SESSION

from .magics import no_arguments, parse_argstring, refuse, usage_errors


@magics_class
class DebugMagics(Magics):
    """%dist_stacks, %dist_diagnose, %dist_restart, %dist_heal, %dist_compare, %dist_debug,
    %dist_inspect, %dist_export."""

    # ---- hangs and recovery --------------------------------------------------------

    @magic_arguments()
    @argument("--ranks", default="all", help="ranks to show (default all)")
    @line_magic
    def dist_stacks(self, line: str = ""):
        """Every rank's Python stack, with frames in the cell shown as cell lines.

        In [7]: %dist_stacks
        rank 0: in broadcast #1
          line 4, in <module>
            dist.broadcast(x, 0)

        Shows the stacks of the last cell at the moment it hung or was interrupted, or
        the live stacks while a cell runs from another thread.
        """
        args = parse_argstring(self.dist_stacks, line)
        with usage_errors():
            print(SESSION.stacks(args.ranks))

    @line_magic
    def dist_diagnose(self, line: str = ""):
        """The doctor's diagnosis of the running or last cell: a table and a verdict.

        In [8]: %dist_diagnose
        """
        no_arguments("%dist_diagnose", line)
        with usage_errors():
            print(SESSION.diagnose())

    @magic_arguments()
    @argument(
        "--replay",
        action="store_true",
        help="re-run the cells that ran on every rank since %%dist_init",
    )
    @line_magic
    def dist_restart(self, line: str = ""):
        """Fresh engines and process group, same ranks; --replay rebuilds your state.

        In [9]: %dist_restart --replay
        notebook_dist: restarted 2 ranks (gloo) in 7.9 s; replayed 3 cells.
        """
        args = parse_argstring(self.dist_restart, line)
        with usage_errors():
            for said in SESSION.restart(args.replay):
                print(said)

    @magic_arguments()
    @argument(
        "--copy",
        default="",
        help="variables to copy to the new ranks from a survivor, as one object graph, "
        "e.g. model,opt,step",
    )
    @argument(
        "--from",
        dest="source",
        type=int,
        default=None,
        help="the surviving rank to copy from (default: the lowest)",
    )
    @line_magic
    def dist_heal(self, line: str = ""):
        """Replace every dead rank with a fresh one; every survivor keeps its variables.

        In [9]: %dist_heal --copy model,opt,step
        notebook_dist: healed rank 1 in 0.9 s (rank 1 exited with code 1). It replayed 2
        setup cells alone. The process group was made again over every rank ...

        The new rank replays the cells %dist_restart --replay would (alone: its collectives
        do not wait for the others), joins a new process group at the same rank, then gets
        --copy from a survivor, with tensors on its own device.
        """
        args = parse_argstring(self.dist_heal, line)
        copy = [n.strip() for n in args.copy.split(",") if n.strip()]
        with usage_errors():
            print(SESSION.heal(copy, args.source))

    @line_magic
    def debug(self, line: str = ""):
        """``%debug`` after a failed ``%%distributed`` cell: the debugger on the rank that
        raised, in its frames as they were, asked through the notebook; after anything
        else, IPython's own ``%debug``.

        In [7]: %debug
        [rank 1] (Pdb) p x
        """
        import sys

        from notebook_dist.errors import RankError

        failed = getattr(sys, "last_value", None)
        if isinstance(failed, RankError) and not line.strip():
            with usage_errors():
                return SESSION.post_mortem(min(failed.errors))
        original = getattr(self.shell, "_notebook_dist_ipython_debug", None)
        if original is None:
            refuse("%debug: nothing to debug")
        return original(line)

    # ---- inspection ------------------------------------------------------------------

    @magic_arguments()
    @argument("expr", nargs="+", help="a Python expression, evaluated on every rank")
    @argument(
        "--ranks", default="all", help="ranks to compare (default all); the first is the reference"
    )
    @argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    @argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    @line_magic
    def dist_compare(self, line: str = ""):
        """Do the ranks agree on EXPR? Only what differs is listed.

        In [10]: %dist_compare model
        1 of 4 entries differ from rank 0 (exactly):
          0.weight  ranks 1: max abs diff 0.031, max rel diff 0.9

        Tensors, modules (their state_dict), optimizers and containers are compared
        leaf by leaf; large tensors are compared on the ranks, not sent to the notebook.
        """
        args = parse_argstring(self.dist_compare, line)
        with usage_errors():
            return SESSION.live().compare(" ".join(args.expr), args.ranks, args.atol, args.rtol)

    @magic_arguments()
    @argument("expr", nargs="*", help="an expression to evaluate in that frame")
    @argument(
        "--rank",
        type=int,
        default=None,
        help="the rank to look at (default: the first that raised)",
    )
    @argument(
        "--frame",
        type=int,
        default=0,
        help="0 is where it raised; 1, 2, ... walk up to the callers",
    )
    @line_magic
    def dist_debug(self, line: str = ""):
        """Post-mortem of the last cell: the failing frame on a rank, its locals, and EXPR there.

        In [11]: %dist_debug --rank 1 x
        rank 1 raised ZeroDivisionError: division by zero
        frame 0 of 2 (0 = where it raised): Cell In[10], line 3, in f
        locals:
          x = 0
        => 0
        """
        args = parse_argstring(self.dist_debug, line)
        with usage_errors():
            return SESSION.live().debug(args.rank, " ".join(args.expr) or None, args.frame)

    @magic_arguments()
    @argument("expr", nargs="+", help="a Python expression, evaluated on every rank")
    @argument("--ranks", default="all", help="ranks to ask (default all)")
    @line_magic
    def dist_inspect(self, line: str = ""):
        """EXPR on every rank, side by side, without running a cell.

        In [12]: %dist_inspect loss.item()
        """
        args = parse_argstring(self.dist_inspect, line)
        with usage_errors():
            return SESSION.live().inspect(" ".join(args.expr), args.ranks)

    # ---- export ----------------------------------------------------------------------

    @magic_arguments()
    @argument("file", help="the script to write, e.g. train.py")
    @argument(
        "--cells", default=None, help="cell numbers to export, e.g. 3-7,9, or last (default: all)"
    )
    @line_magic
    def dist_export(self, line: str = ""):
        """Write the distributed cells that ran, in order, as a script for torchrun.

        In [12]: %dist_export train.py
        wrote train.py: 4 distributed cells. Run it with: torchrun --nproc_per_node=2 train.py

        %%rank cells become ``if dist.get_rank() in (...)`` blocks; kernel cells are kept
        as comments; cells that raised are left out (as comments).
        """
        args = parse_argstring(self.dist_export, line)
        raw = list(self.shell.history_manager.input_hist_raw)
        with usage_errors():
            print(SESSION.export(args.file, args.cells, raw))
