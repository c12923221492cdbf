"""``%dist_*`` line magics and the ``%%distributed`` / ``%%rank`` cell magics."""

from __future__ import annotations

import keyword
import math
import re
from contextlib import contextmanager

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.core.magic_arguments import parse_argstring as _ipython_parse

from notebook_dist import session
from notebook_dist.cluster import DistCluster
from notebook_dist.config import DistConfig
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


def parse_argstring(magic, line: str):
    """IPython's parser, with a line it cannot split (an unclosed quote) as a UsageError."""
    try:
        return _ipython_parse(magic, line)
    except ValueError as exc:
        raise UsageError(f"cannot read the arguments {line!r}: {exc}") from None


def _ipython_owns(name: str) -> bool:
    """Names IPython's history machinery sets after each cell (_, __, _5, _i5, In, Out)."""
    if name in ("In", "Out", "get_ipython", "exit", "quit") or name.strip("_") == "":
        return True
    return re.fullmatch(r"_i{0,3}\d*", name) is not None


def _check_seconds(option: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} {value}: give a positive number of seconds")


def live_cluster() -> DistCluster:
    cluster = session.current()
    if cluster is None:
        raise UsageError("no cluster is running: start one with %dist_init")
    return cluster


@magics_class
class DistMagics(Magics):
    """Magics for running cells on every rank of a torch.distributed cluster."""

    _autodist_on = False

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
    @argument(
        "--port",
        type=int,
        default=None,
        help="rendezvous port, MASTER_PORT (default: a free port the system picks)",
    )
    @argument(
        "--launcher",
        default="local",
        help="how to start the engines: local (default), mpi (mpiexec), slurm (one sbatch "
        "job) or ssh (--hosts, with --network); for the rest, start them with ipcluster and "
        "attach with --profile/--cluster-id",
    )
    @argument(
        "--hosts",
        default=None,
        help="with --launcher ssh: the machines, e.g. node1,node2 (one rank each; -n spreads "
        "more) or node1:2,me@node2:2",
    )
    @argument(
        "--ssh",
        default=None,
        metavar="OPTIONS",
        help='with --launcher ssh: options for ssh and scp, e.g. "-i ~/.ssh/key -o Port=2222"',
    )
    @argument(
        "--sbatch",
        default=None,
        metavar="OPTIONS",
        help='with --launcher slurm: more #SBATCH options, e.g. "--partition=gpu --time=60"',
    )
    @argument(
        "--profile",
        default=None,
        help="attach to a running ipyparallel cluster of this profile (ipcluster start --profile ...)",
    )
    @argument(
        "--cluster-id", default=None, help="attach to the running cluster with this cluster id"
    )
    @argument(
        "--network",
        action="store_true",
        help="let ranks on several hosts meet over the network (the controller, rank 0's "
        "store and Gloo listen on their hosts' addresses; needed for --launcher ssh and when "
        "an attached cluster spans hosts)",
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
        attach = args.profile is not None or args.cluster_id is not None
        ssh = args.launcher.lower() == "ssh"
        if args.network and not (attach or ssh):
            raise UsageError(
                "--network is for ranks on other hosts: --launcher ssh --hosts ..., or attach "
                "to a cluster with --profile/--cluster-id (other launchers run on this machine)"
            )
        for option, value in (("--hosts", args.hosts), ("--ssh", args.ssh)):
            if value is not None and not ssh:
                raise UsageError(f"{option} is for --launcher ssh")
        if attach and (args.port is not None or args.launcher != "local"):
            option = "--port" if args.port is not None else "--launcher"
            raise UsageError(f"{option} is for clusters %dist_init starts, not attached ones")
        common = dict(n=args.n, backend=args.backend, gpus=args.gpus, timeout=args.timeout)
        try:
            if attach:
                from notebook_dist.cluster.attach import AttachedCluster

                wanted = AttachedCluster(
                    profile=args.profile, cluster_id=args.cluster_id, network=args.network, **common
                )
            else:
                if args.sbatch is not None and args.launcher != "slurm":
                    raise UsageError("--sbatch is for --launcher slurm")
                config = DistConfig(slurm={"options": args.sbatch} if args.sbatch else {})
                hosts = None
                if ssh:
                    import shlex

                    from notebook_dist.cluster.hosts import parse_hosts

                    hosts = parse_hosts(args.hosts or "")
                    try:  # IPython keeps the quotes around a value: take them off first
                        options = shlex.split(args.ssh or "")
                        if len(options) == 1 and args.ssh.strip()[:1] in ("'", '"'):
                            options = shlex.split(options[0])
                    except ValueError as exc:
                        raise UsageError(f"--ssh {args.ssh!r}: {exc}") from None
                    config.ssh = {"ssh_args": options, "scp_args": list(options)}
                    config.loopback_only = not args.network
                wanted = DistCluster(
                    port=args.port, launcher=args.launcher, config=config, ssh_hosts=hosts, **common
                )
        except PreflightError as exc:
            raise _usage(exc) from None
        if args.hang_after is not None:
            _check_seconds("--hang-after", args.hang_after)
            wanted.config.hang_after_s = args.hang_after
        live = session.current()
        if live is not None:
            if live.request == wanted.request:
                wanted.discard()
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
        from notebook_dist.about import versions_line

        cluster.start()
        session.set_current(cluster)
        print(versions_line(cluster))
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
        return live_cluster()

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
        from notebook_dist.about import versions_line

        rows = cluster.status()
        columns = ("rank", "host", "pid", "device", "backend", "state", "process_group")
        if any(row["gpu"] for row in rows):  # GPU ranks: the GPU and its CUDA memory
            columns += ("gpu",)
        title = versions_line(cluster)
        text = title + "\n" + cluster.table(rows, columns)
        note = cluster.dead_note()
        if note:
            text += "\n" + note
        from notebook_dist.ui import widgets_available

        if widgets_available():
            from IPython.display import display

            from notebook_dist.ui.html import DashboardRecord, render_html
            from notebook_dist.ui.state import cluster_state

            display(DashboardRecord(render_html(cluster_state(cluster, rows, title)), text))
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
        cluster = session.current()
        attached = getattr(cluster, "attached_to", None)
        stopped = session.shutdown()
        if quiet:
            return
        if not stopped:
            print("notebook_dist: no cluster was running.")
        elif attached is not None:
            where = " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in attached.items() if v is not None
            )
            print(
                "notebook_dist: the ranks left their process group; the engines keep running "
                f"(they are not ours to stop: ipcluster stop {where})."
            )
        else:
            print(f"notebook_dist: cluster stopped: {stopped}.")

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
        "--profile",
        action="store_true",
        help="run the cell under torch.profiler on every rank and show where the time went: "
        "compute, collectives, waiting for peers, a straggler verdict, a timeline and a merged trace",
    )
    @argument(
        "--check-collectives",
        action="store_true",
        default=None,
        help="compare every collective's arguments across the ranks before it runs (op, dtype, "
        "shape, root, reduce op): a mismatch is an error on every rank instead of a hang, "
        "a Gloo abort or wrong numbers (one small all_gather per collective)",
    )
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
        if args.hang_after is not None:
            _check_seconds("--hang-after", args.hang_after)
        header = None if args.autodist else f"%%distributed {line}".rstrip()
        return self._run(
            cell,
            args.ranks,
            args.gather,
            header=header,
            hang_after=args.hang_after,
            dashboard=not args.no_dashboard,
            on_hang=args.on_hang,
            profile=args.profile,
            check_collectives=args.check_collectives,
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
        profile: bool = False,
        check_collectives: bool | None = None,
    ):
        for name in gather:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise UsageError(f"--gather {name!r}: not a valid Python name")
            if _ipython_owns(name):
                raise UsageError(
                    f"--gather {name}: IPython keeps its own values under that name; choose another"
                )
        cluster = session.current()
        planned = cluster if cluster is not None else DistCluster()
        try:
            planned.select(ranks)  # a bad spec is refused before anything starts
        except RankSpecError as exc:
            raise _usage(exc) from None
        cluster = self._cluster()
        filename = f"Cell In[{self.shell.displayhook.prompt_count}]"  # IPython's own Out[N] number
        from notebook_dist.ui import DashboardFeed, make_dashboard

        config = cluster.config
        board = make_dashboard(config.dashboard if dashboard else "off", config.dashboard_quiet_s)
        feed = DashboardFeed(board) if board is not None else None
        before = cluster.last_watch
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
                profile=profile,
                check_collectives=check_collectives,
            )
        finally:
            # only this cell's watch: a cell refused before it ran (a syntax error, a dead
            # rank) has none, and must not show the previous cell's dashboard
            if feed is not None and cluster.last_watch not in (None, before):
                feed.close(cluster.last_watch)
        from notebook_dist.export import ExportCell

        number = self.shell.displayhook.prompt_count
        session.cell_records[number] = ExportCell(
            number, "distributed", cell, ranks, ok=not result.errors
        )
        for name, values in result.gathered.items():
            self.shell.user_ns[name] = values
        if result.profile is not None:
            from IPython.display import display

            session.last_profile = result.profile
            display(result.profile)
        result.raise_for_errors()
        return result.values

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
        for name in args.names:
            if _ipython_owns(name):
                raise UsageError(
                    f"%dist_pull {name}: IPython keeps its own values under that name in the "
                    f"notebook; on the ranks, assign it to another name first (x = {name})"
                )
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
