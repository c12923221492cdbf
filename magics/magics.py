"""``%dist_*`` line magics and the ``%%distributed`` / ``%%rank`` cell magics."""

from __future__ import annotations

from contextlib import contextmanager

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from notebook_dist import session
from notebook_dist.cluster import DistCluster
from notebook_dist.errors import PreflightError, RankSpecError


def _usage(exc: Exception) -> UsageError:
    return UsageError(str(exc))


@contextmanager
def _usage_errors():
    """Bad input (a rank spec, an expression, a rank that did not fail) as a UsageError."""
    from notebook_dist.inspect import InspectError

    try:
        yield
    except (RankSpecError, InspectError) as exc:
        raise _usage(exc) from None


@magics_class
class DistMagics(Magics):
    """Magics for running cells on every rank of a torch.distributed cluster."""

    _autodist_on = False

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self._exportable: dict = {}  # In[N] -> ExportCell, for %dist_export

    # ---- cluster -------------------------------------------------------------------

    @magic_arguments()
    @argument(
        "-n", type=int, default=None, help="number of ranks (default: one per GPU, or 2 on CPU)"
    )
    @argument(
        "--backend",
        default="auto",
        help="auto (NCCL when every rank has its own GPU, else Gloo), gloo or nccl",
    )
    @argument("--gpus", default=None, help="GPU indices to use, e.g. 0,1 (default: all visible)")
    @argument(
        "--timeout", type=float, default=None, help="collective timeout in seconds (default 300)"
    )
    @argument(
        "--hang-after",
        type=float,
        default=None,
        help="seconds without progress before a diagnosis is shown (default 10)",
    )
    @line_magic
    def dist_init(self, line: str = ""):
        """Start the ranks: one engine per GPU (or -n CPU ranks), process group ready.

        In [1]: %dist_init -n 2
        rank  host  pid    device  backend
        0     vm    81723  cpu     gloo
        1     vm    81724  cpu     gloo

        Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
        MASTER_PORT as torchrun sets them. Running it again with the same arguments
        keeps the live cluster; with other arguments it replaces it.
        """
        args = parse_argstring(self.dist_init, line)
        try:
            wanted = DistCluster(
                n=args.n, backend=args.backend, gpus=args.gpus, timeout=args.timeout
            )
        except PreflightError as exc:
            raise _usage(exc) from None
        if args.hang_after is not None:
            if args.hang_after <= 0:
                raise UsageError("--hang-after: give a positive number of seconds")
            wanted.config.hang_after_s = args.hang_after
        live = session.current()
        if live is not None:
            if live.request == wanted.request:
                if args.hang_after is not None:
                    live.config.hang_after_s = args.hang_after
                print(
                    f"notebook_dist: reusing the running cluster ({live.world_size} ranks, {live.backend})."
                )
                return
            print(
                f"notebook_dist: replacing the running cluster ({live.world_size} ranks, {live.backend}) "
                f"with {wanted.world_size} ranks, {wanted.backend}; its ranks' variables are lost."
            )
            session.shutdown()
        self._start(wanted)

    def _start(self, cluster: DistCluster) -> DistCluster:
        cluster.start()
        session.set_current(cluster)
        print(cluster.table())
        for note in cluster.notes:
            print(f"note: {note}")
        return cluster

    def _cluster(self) -> DistCluster:
        cluster = session.current()
        if cluster is None:
            cluster = DistCluster()
            print(
                f"notebook_dist: no cluster was running; starting {cluster.world_size} ranks "
                f"({cluster.backend}), as %dist_init would."
            )
            self._start(cluster)
        return cluster

    def _live_cluster(self) -> DistCluster:
        cluster = session.current()
        if cluster is None:
            raise UsageError("no cluster is running: start one with %dist_init")
        return cluster

    @line_magic
    def dist_status(self, line: str = ""):
        """Show every rank: host, pid, device, backend, state and process-group health.

        In [2]: %dist_status
        """
        if line.strip():
            raise UsageError("%dist_status takes no arguments")
        cluster = session.current()
        if cluster is None:
            print("notebook_dist: no cluster is running (start one with %dist_init).")
            return
        rows = cluster.status()
        columns = ("rank", "host", "pid", "device", "backend", "state", "process_group")
        text = f"{cluster.world_size} ranks, backend {cluster.backend}\n" + cluster.table(
            rows, columns
        )
        from notebook_dist.ui import widgets_available

        if widgets_available():
            from IPython.display import display

            from notebook_dist.ui.html import DashboardRecord, render_html
            from notebook_dist.ui.state import cluster_state

            display(DashboardRecord(render_html(cluster_state(cluster, rows)), text))
        else:
            print(text)

    @line_magic
    def dist_shutdown(self, line: str = ""):
        """Stop every process this notebook started for its cluster.

        In [9]: %dist_shutdown
        """
        if line.strip():
            raise UsageError("%dist_shutdown takes no arguments")
        self.shutdown_cluster()

    def shutdown_cluster(self, quiet: bool = False) -> None:
        stopped = session.shutdown()
        if not quiet:
            print(
                "notebook_dist: cluster stopped."
                if stopped
                else "notebook_dist: no cluster was running."
            )

    # ---- running cells -------------------------------------------------------------

    @magic_arguments()
    @argument("--ranks", default="all", help="ranks to run on: all, 0, 0,2 or 1-3 (default all)")
    @argument(
        "--gather",
        nargs="+",
        default=[],
        metavar="NAME",
        help="bind these variables in the notebook as RankValues",
    )
    @argument(
        "--hang-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="show a diagnosis after this long without progress",
    )
    @argument(
        "--on-hang",
        choices=("show", "stop"),
        default="show",
        help="show: print the diagnosis and keep waiting (default); stop: then end the cell with HangError",
    )
    @argument("--no-dashboard", action="store_true", help="no live dashboard for this cell")
    @argument(
        "--autodist",
        action="store_true",
        help="set by %%autodist: the cell has no magic line of its own",
    )
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run the cell on every rank at once (or on --ranks).

        In [3]: %%distributed
           ...: t = torch.ones(2) * (dist.get_rank() + 1)
           ...: dist.all_reduce(t)
           ...: t
        Out[3]: RankValues (2 ranks)
                [rank 0] tensor([3., 3.])
                [rank 1] tensor([3., 3.])

        Output streams live, tagged by rank. The value is a RankValues (rank -> value);
        --gather x y also binds x and y in the notebook. If any rank raises, each
        rank's traceback is shown once and the cell fails.
        """
        args = parse_argstring(self.distributed, line)
        if args.hang_after is not None and args.hang_after <= 0:
            raise UsageError("--hang-after: give a positive number of seconds")
        header = None if args.autodist else f"%%distributed {line}".rstrip()
        return self._run(
            cell,
            args.ranks,
            args.gather,
            header=header,
            hang_after=args.hang_after,
            dashboard=not args.no_dashboard,
            on_hang=args.on_hang,
        )

    @cell_magic
    def rank(self, line: str, cell: str):
        """Run the cell on some ranks only: ``%%rank SPEC`` is ``%%distributed --ranks SPEC``.

        In [4]: %%rank 0
           ...: print("only rank 0 runs this")
        """
        spec = line.strip()
        if not spec:
            raise UsageError("%%rank needs ranks, e.g. %%rank 0 or %%rank 0,2 or %%rank 1-3")
        return self._run(cell, spec, [], header=f"%%rank {line}".rstrip())

    def _run(
        self,
        cell: str,
        ranks: str,
        gather: list[str],
        header: str | None,
        hang_after: float | None = None,
        dashboard: bool = True,
        on_hang: str = "show",
    ):
        for name in gather:
            if not name.isidentifier():
                raise UsageError(f"--gather {name!r}: not a valid Python name")
        cluster = session.current()
        planned = cluster if cluster is not None else DistCluster()
        try:
            planned.select(ranks)  # a bad spec is refused before anything starts
        except RankSpecError as exc:
            raise _usage(exc) from None
        cluster = self._cluster()
        filename = f"Cell In[{self.shell.displayhook.prompt_count}]"  # IPython's own Out[N] number
        from notebook_dist.ui import DashboardFeed, make_dashboard

        board = make_dashboard(cluster.config.dashboard if dashboard else "off")
        feed = DashboardFeed(board) if board is not None else None
        try:
            result = cluster.run(
                cell,
                ranks,
                gather,
                filename=filename,
                header=header,
                hang_after=hang_after,
                on_update=feed,
                on_hang=on_hang,
            )
        finally:
            if feed is not None and cluster.last_watch is not None:
                feed.close(cluster.last_watch)
        from notebook_dist.export import ExportCell

        number = self.shell.displayhook.prompt_count
        self._exportable[number] = ExportCell(
            number, "distributed", cell, ranks, ok=not result.errors
        )
        for name, values in result.gathered.items():
            self.shell.user_ns[name] = values
        result.raise_for_errors()
        return result.values

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
        cluster = self._live_cluster()
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
        cluster = self._live_cluster()
        watch = cluster.last_watch
        if watch is None:
            print("notebook_dist: no cell has run yet.")
            return
        if watch.frozen is not None and not watch.running():
            for r, snap in watch.frozen.items():
                watch.views[r].snap = snap
                if watch.views[r].released:
                    watch.views[r].status = "running"  # as it was before the release
        print(watch.diagnose().text())

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

        cluster = self._live_cluster()
        t0 = time.perf_counter()
        history = list(cluster.history)
        fresh = cluster.restarted()
        session.set_current(fresh)
        msg = f"notebook_dist: restarted {fresh.world_size} ranks ({fresh.backend}) in {time.perf_counter() - t0:.1f} s"
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
                    f"; {len(history)} earlier cells can be replayed with --replay."
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
        cluster = self._live_cluster()
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
        cluster = self._live_cluster()
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
        cluster = self._live_cluster()
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
            if n in self._exportable:
                cell = self._exportable[n]
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

        with open(args.file, "w") as f:
            f.write(to_script(chosen, world_size, os.path.basename(args.file)))
        print(
            f"wrote {args.file}: {n_dist} distributed cell{'s' if n_dist != 1 else ''}. "
            f"Run it with: torchrun --nproc_per_node={world_size} {args.file}"
        )

    # ---- moving values -------------------------------------------------------------

    @magic_arguments()
    @argument("names", nargs="+", metavar="NAME", help="notebook variables to send")
    @argument("--ranks", default="all", help="ranks to send to (default all)")
    @line_magic
    def dist_push(self, line: str = ""):
        """Send notebook variables to the ranks (cloudpickle: functions and classes work).

        In [5]: %dist_push lr model_fn
        """
        args = parse_argstring(self.dist_push, line)
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        cluster = self._live_cluster()
        try:
            cluster.push({n: self.shell.user_ns[n] for n in args.names}, ranks=args.ranks)
        except RankSpecError as exc:
            raise _usage(exc) from None

    @magic_arguments()
    @argument("names", nargs="+", metavar="NAME", help="rank variables to fetch")
    @argument("--ranks", default="all", help="ranks to fetch from (default all)")
    @line_magic
    def dist_pull(self, line: str = ""):
        """Fetch variables from the ranks; each is bound in the notebook as RankValues.

        In [6]: %dist_pull loss
        In [7]: loss[1]
        """
        args = parse_argstring(self.dist_pull, line)
        cluster = self._live_cluster()
        try:
            pulled = cluster.pull(args.names, ranks=args.ranks)
        except RankSpecError as exc:
            raise _usage(exc) from None
        self.shell.user_ns.update(pulled)
        if len(pulled) == 1:
            return next(iter(pulled.values()))

    # ---- autodist ------------------------------------------------------------------

    @line_magic("autodist")
    def autodist_magic(self, line: str = ""):
        """``%autodist on``: every following cell runs distributed, until ``%autodist off``.

        In [8]: %autodist on
        A cell that starts with %%local runs in the notebook kernel instead.
        """
        word = line.strip().lower()
        if word not in ("on", "off"):
            raise UsageError("use %autodist on or %autodist off")
        self.autodist(word == "on")
        print(f"notebook_dist: autodist {word}.")

    def autodist(self, on: bool) -> None:
        transformers = self.shell.input_transformers_cleanup
        if on and _autodist_transform not in transformers:
            transformers.append(_autodist_transform)
        if not on and _autodist_transform in transformers:
            transformers.remove(_autodist_transform)
        self._autodist_on = on

    @cell_magic
    def local(self, line: str, cell: str):
        """Run this cell in the notebook kernel (only needed while %autodist is on).

        In [9]: %%local
           ...: print("in the kernel")
        """
        result = self.shell.run_cell(cell)
        if result.error_in_exec is not None:
            raise result.error_in_exec


def _autodist_transform(lines: list[str]) -> list[str]:
    """Cleanup transformer used while %autodist is on: route plain cells to the ranks."""
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if not first:
        return lines
    if first.startswith("%%local"):
        i = next(i for i, ln in enumerate(lines) if ln.strip())
        return lines[:i] + lines[i + 1 :]
    if first.startswith("%%") or first.startswith("%autodist") or first.startswith("%dist_"):
        return lines
    return ["%%distributed --autodist\n", *lines]
