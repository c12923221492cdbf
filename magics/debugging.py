"""Magics for when things go wrong and for moving on: stacks, diagnosis, restart,
cross-rank inspection, and export to a torchrun script."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from notebook_dist import session
from notebook_dist.errors import RankSpecError

from .magics import _usage, _usage_errors, live_cluster, parse_argstring


@magics_class
class DebugMagics(Magics):
    """%dist_stacks, %dist_diagnose, %dist_restart, %dist_compare, %dist_debug, %dist_inspect, %dist_export."""

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
        cluster = live_cluster()
        try:
            ranks = cluster.select(args.ranks)
        except RankSpecError as exc:
            raise _usage(exc) from None
        from notebook_dist.doctor import format_stacks

        watch = cluster.last_watch
        if watch is None:
            print("notebook_dist: no cell has run yet; every rank is idle.")
            return
        snaps = (
            watch.frozen
            if (watch.frozen is not None and not watch.running())
            else {r: v.snap for r, v in watch.views.items()}
        )
        when = (
            "now"
            if watch.running()
            else (
                "when the last cell hung or was interrupted"
                if watch.frozen is not None
                else "at the end of the last cell"
            )
        )
        print(f"stacks {when}:")
        print(
            format_stacks(
                {r: snaps.get(r, {}) for r in ranks if r in snaps}, watch.prepared.filename
            )
        )

    @line_magic
    def dist_diagnose(self, line: str = ""):
        """The doctor's diagnosis of the running or last cell: a table and a verdict.

        In [8]: %dist_diagnose
        """
        if line.strip():
            raise UsageError("%dist_diagnose takes no arguments")
        cluster = live_cluster()
        watch = cluster.last_watch
        if watch is None:
            print("notebook_dist: no cell has run yet.")
            return
        if watch.running():
            print(watch.diagnose().text())
        else:  # the ranks as they were when the hang showed or they were released
            print((watch.final or watch.diagnose(before_release=True)).text())

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
        import time

        cluster = live_cluster()
        t0 = time.perf_counter()
        history = list(cluster.history)
        fresh = cluster.restarted()
        session.set_current(fresh)
        msg = (
            f"notebook_dist: restarted {fresh.world_size} ranks ({fresh.backend}) in "
            f"{time.perf_counter() - t0:.1f} s (stopped: {cluster.stop_note})"
        )
        if args.replay:
            print(msg + f"; replaying {len(history)} cell{'s' if len(history) != 1 else ''}.")
            n = fresh.replay(history)
            print(
                f"notebook_dist: replayed {n} cell{'s' if n != 1 else ''}; the ranks are where they were."
            )
        else:
            print(
                msg
                + (
                    f"; {len(history)} earlier cell{'s' if len(history) != 1 else ''} can be "
                    "replayed with --replay."
                    if history
                    else "."
                )
            )

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
        cluster = live_cluster()
        with _usage_errors():
            return cluster.compare(" ".join(args.expr), args.ranks, args.atol, args.rtol)

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
        cluster = live_cluster()
        with _usage_errors():
            return cluster.debug(args.rank, " ".join(args.expr) or None, args.frame)

    @magic_arguments()
    @argument("expr", nargs="+", help="a Python expression, evaluated on every rank")
    @argument("--ranks", default="all", help="ranks to ask (default all)")
    @line_magic
    def dist_inspect(self, line: str = ""):
        """EXPR on every rank, side by side, without running a cell.

        In [12]: %dist_inspect loss.item()
        """
        args = parse_argstring(self.dist_inspect, line)
        cluster = live_cluster()
        with _usage_errors():
            return cluster.inspect(" ".join(args.expr), args.ranks)

    # ---- export ----------------------------------------------------------------------

    @magic_arguments()
    @argument("file", help="the script to write, e.g. train.py")
    @argument("--cells", default=None, help="cell numbers to export, e.g. 3-7,9 (default: all)")
    @line_magic
    def dist_export(self, line: str = ""):
        """Write the distributed cells that ran, in order, as a script for torchrun.

        In [12]: %dist_export train.py
        wrote train.py: 4 distributed cells. Run it with: torchrun --nproc_per_node=2 train.py

        %%rank cells become ``if dist.get_rank() in (...)`` blocks; kernel cells are kept
        as comments; cells that raised are left out (as comments).
        """
        args = parse_argstring(self.dist_export, line)
        from notebook_dist.export import ExportCell, select_cells, to_script

        cluster = session.current()
        world_size = cluster.world_size if cluster is not None else 2
        raw = self.shell.history_manager.input_hist_raw
        cells = []
        for n in range(1, len(raw)):
            if n in session.cell_records:
                cell = session.cell_records[n]
                if not cell.ok:
                    cell = ExportCell(
                        n, "kernel", "(raised on the ranks in the notebook)\n" + cell.source
                    )
                cells.append(cell)
                continue
            text = raw[n].strip()
            lines = [ln for ln in text.splitlines() if ln.strip()]
            if (
                not lines
                or all(ln.lstrip().startswith("%") for ln in lines)
                or text.startswith("%%")
            ):
                continue  # magics (%dist_init, %%rank that failed to parse, ...)
            cells.append(ExportCell(n, "kernel", text))
        try:
            chosen = select_cells(cells, args.cells)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        n_dist = sum(c.kind == "distributed" for c in chosen)
        if not n_dist:
            raise UsageError(
                "no distributed cell has run yet (or none in --cells): nothing to export"
            )
        import os

        try:
            with open(args.file, "w") as f:
                f.write(to_script(chosen, world_size, os.path.basename(args.file)))
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise UsageError(f"cannot write {args.file!r}: {reason}") from None
        print(
            f"wrote {args.file}: {n_dist} distributed cell{'s' if n_dist != 1 else ''}. "
            f"Run it with: torchrun --nproc_per_node={world_size} {args.file}"
        )
