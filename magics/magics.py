"""``%dist_*`` line magics and the ``%%distributed`` / ``%%rank`` cell magics."""

from __future__ import annotations

import keyword
import re
from contextlib import contextmanager
from typing import NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.core.magic_arguments import parse_argstring as _ipython_parse

from notebook_dist.errors import OptionError, UsageMistake
from notebook_dist.request import PRELOAD, ClusterRequest
from notebook_dist.session import SESSION


@contextmanager
def usage_errors():
    """The one way a mistake in what the user typed becomes IPython's UsageError: every
    library error that is such a mistake derives from ``errors.UsageMistake``."""
    try:
        yield
    except UsageMistake as exc:
        raise UsageError(str(exc)) from None


def refuse(text: str) -> NoReturn:
    """A magic's own refusal of what the user typed, through the same door as the
    library's mistakes (:func:`usage_errors`): one line, no traceback."""
    with usage_errors():
        raise OptionError(text)


def parse_argstring(magic, line: str):
    """IPython's parser, with a line it cannot split (an unclosed quote) as a UsageError."""
    try:
        return _ipython_parse(magic, line)
    except ValueError as exc:
        refuse(f"cannot read the arguments {line!r}: {exc}")


def no_arguments(magic: str, line: str) -> None:
    if line.strip():
        refuse(f"{magic} takes no arguments")


def _ipython_owns(name: str) -> bool:
    """Names IPython's history machinery sets after each cell (_, __, _5, _i5, In, Out)."""
    if name in ("In", "Out", "get_ipython", "exit", "quit") or name.strip("_") == "":
        return True
    return re.fullmatch(r"_i{0,3}\d*", name) is not None


def check_names(option: str, names: list[str], why: str = "") -> None:
    """Names the notebook binds: Python names that IPython does not keep for itself."""
    for name in names:
        if not name.isidentifier() or keyword.iskeyword(name):
            refuse(f"{option} {name!r}: not a valid Python name")
        if _ipython_owns(name):
            refuse(
                f"{option} {name}: IPython keeps its own values under that name{why}; "
                "choose another"
            )


@magics_class
class DistMagics(Magics):
    """Magics for running cells on every rank of a torch.distributed cluster."""

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
        "--timeout",
        type=float,
        default=None,
        help="torch's own collective timeout in seconds (default: none; a cell stuck for "
        "DistConfig.stuck_after_s, 5 min, is stopped by the notebook, never while a rank "
        "waits at a prompt)",
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
    @argument(
        "--spares",
        type=int,
        default=None,
        help="idle engines kept ready to replace dead or restarted ranks in a fraction of a "
        "second (default 1; each costs a Python with torch imported, about 240 MiB)",
    )
    @argument(
        "--preload",
        default=None,
        choices=list(PRELOAD),
        help="load what a first optimizer or DDP module needs (torch._dynamo, ~2 s of CPU a "
        "rank) once, before the ranks are forked: the start takes that much longer, every "
        "rank's first training cell that much less, and ranks share its memory (default "
        "auto: when there are more ranks than cores)",
    )
    @argument(
        "--scheduling",
        default=None,
        choices=["auto", "batch", "normal"],
        help="how Linux schedules the ranks' threads: batch (SCHED_BATCH: a thread that wakes "
        "does not take the core from the one working there; Gloo's DDP steps ran twice as "
        "fast on 2 cores) or normal (default auto: batch on CPU, normal on GPUs)",
    )
    @argument(
        "--heal",
        default=None,
        choices=["auto", "off"],
        help="auto: a rank that dies in a cell is replaced at once (%%dist_heal), copying "
        "--heal-copy from a survivor (default off)",
    )
    @argument(
        "--heal-copy",
        default=None,
        metavar="NAMES",
        help="with --heal auto: the variables copied to the new rank, e.g. model,opt,step",
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
        keeps the live cluster (or restarts its ranks, if one has ended); with other
        arguments it replaces it.
        """
        args = parse_argstring(self.dist_init, line)
        with usage_errors():
            said = SESSION.init(
                ClusterRequest(
                    **{k: getattr(args, k) for k in ("n", "backend", "gpus", "timeout", "port")},
                    **{k: getattr(args, k) for k in ("launcher", "hosts", "ssh", "sbatch")},
                    profile=args.profile,
                    cluster_id=args.cluster_id,
                    network=args.network,
                    hang_after=args.hang_after,
                    spares=args.spares,
                    preload=args.preload,
                    scheduling=args.scheduling,
                    heal=args.heal,
                    heal_copy=args.heal_copy,
                )
            )
        print("\n".join(said))

    @line_magic
    def dist_status(self, line: str = ""):
        """Show every rank: host, pid, device, backend, state and process-group health.

        In [2]: %dist_status
        """
        from notebook_dist.ui import show

        no_arguments("%dist_status", line)
        show(SESSION.status())

    @line_magic
    def dist_shutdown(self, line: str = ""):
        """Stop every process this notebook started for its cluster.

        In [9]: %dist_shutdown
        """
        no_arguments("%dist_shutdown", line)
        print(SESSION.shutdown() or "notebook_dist: no cluster was running.")

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
        "--pdb",
        action="store_true",
        help="a rank that raises opens the debugger where it raised, in the notebook (as "
        "IPython's %%pdb on, which turns it on for every cell)",
    )
    @argument(
        "--answers",
        nargs="+",
        default=[],
        metavar="LINE",
        help="lines for what the ranks ask (their debugger, input()), given in advance, in "
        'order, e.g. --answers "p w" c',
    )
    @argument(
        "--raw-output",
        action="store_true",
        help="every rank's lines as they are: none folded into one [ranks 0-7] line",
    )
    @argument(
        "--args",
        default=None,
        metavar="ARGS",
        help="the cell's command line, as a script's: sys.argv[1:] on every rank, e.g. "
        '--args "--epochs 3 --lr 0.1" (default none, so argparse takes its defaults)',
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
        header = None if args.autodist else f"%%distributed {line}".rstrip()
        options = {k: getattr(args, k) for k in ("hang_after", "on_hang", "profile")}
        options["check_collectives"] = args.check_collectives
        options["args"] = args.args
        options["raw_output"] = args.raw_output
        options["answers"] = args.answers
        options["post_mortem"] = args.pdb
        return self._run(cell, args.ranks, args.gather, header, not args.no_dashboard, **options)

    @cell_magic
    def rank(self, line: str, cell: str):
        """Run the cell on some ranks only: ``%%rank SPEC`` is ``%%distributed --ranks SPEC``.

        In [4]: %%rank 0
           ...: print("only rank 0 runs this")
        """
        spec = line.strip()
        if not spec:
            refuse("%%rank needs ranks, e.g. %%rank 0 or %%rank 0,2 or %%rank 1-3")
        return self._run(cell, spec, [], f"%%rank {line}".rstrip())

    def _run(self, cell, ranks, gather, header, dashboard=True, **options):
        check_names("--gather", gather)
        number = self.shell.displayhook.prompt_count  # IPython's own Out[N] number
        if self.shell.call_pdb:  # %pdb on: the ranks' own post-mortem, not the kernel's
            options["post_mortem"] = True
            self._skip_kernel_post_mortem()
        with usage_errors():
            result = SESSION.run_cell(cell, number, ranks, gather, header, dashboard, **options)
        self.shell.user_ns.update(result.gathered)
        if result.profile is not None:
            from IPython.display import display

            display(result.profile)
        result.raise_for_errors()
        return result.values

    def _skip_kernel_post_mortem(self) -> None:
        """With %pdb on, IPython would open its debugger in the tool's own frames after the
        cell: the ranks opened theirs where they raised. Off for this cell, on again after."""
        shell = self.shell
        shell.call_pdb = False

        def restore(result=None):
            shell.call_pdb = True
            shell.events.unregister("post_run_cell", restore)

        shell.events.register("post_run_cell", restore)

    # ---- moving values -------------------------------------------------------------

    @magic_arguments()
    @argument("names", nargs="+", metavar="NAME", help="notebook variables to send")
    @argument("--ranks", default="all", help="ranks to send to (default all)")
    @argument(
        "--module",
        action="store_true",
        help="NAMEs are modules beside the notebook: send their source, for ranks on hosts "
        "that do not share its folder (import NAME then works there; send again after an edit)",
    )
    @line_magic
    def dist_push(self, line: str = ""):
        """Send notebook variables to the ranks (cloudpickle: functions and classes work).

        In [5]: %dist_push lr model_fn
        In [6]: %dist_push --module datautils
        """
        args = parse_argstring(self.dist_push, line)
        with usage_errors():
            if args.module:
                SESSION.live().push_modules(args.names, ranks=args.ranks)
                return
            missing = [n for n in args.names if n not in self.shell.user_ns]
            if missing:
                refuse(f"not defined in the notebook: {', '.join(missing)}")
            SESSION.live().push({n: self.shell.user_ns[n] for n in args.names}, ranks=args.ranks)

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
                refuse(
                    f"%dist_pull {name}: IPython keeps its own values under that name in the "
                    f"notebook; on the ranks, assign it to another name first (x = {name})"
                )
        with usage_errors():
            pulled = SESSION.live().pull(args.names, ranks=args.ranks)
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
            refuse("use %autodist on or %autodist off")
        self.autodist(word == "on")
        print(f"notebook_dist: autodist {word}.")

    def autodist(self, on: bool) -> None:
        transformers = self.shell.input_transformers_cleanup
        if on and _autodist_transform not in transformers:
            transformers.append(_autodist_transform)
        if not on and _autodist_transform in transformers:
            transformers.remove(_autodist_transform)

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
