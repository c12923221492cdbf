"""Export the notebook's distributed cells as a script that torchrun runs.

Cells are taken in the order they ran. ``%%rank SPEC`` (and ``--ranks``) cells become
``if dist.get_rank() in (...):`` blocks; kernel-only cells are kept as comments so the
script still reads like the notebook; IPython magics inside a cell are commented out.
``nd.rank``, ``nd.world_size``, ``nd.device`` and ``nd.report`` work under torchrun, so
the cells run unchanged.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from datetime import datetime

from .errors import UsageMistake
from .ranks import parse_ranks


class ExportError(UsageMistake, ValueError):
    """An export that cannot be written: nothing to export, bad --cells, a bad path."""


@dataclass(frozen=True)
class ExportCell:
    number: int  # the notebook's In[N]
    kind: str  # "distributed" or "kernel"
    source: str  # the cell body (no magic line)
    ranks: str = "all"  # the --ranks / %%rank spec
    ok: bool = True


HEADER = '''\
"""Exported from a notebook_dist session on {date} by %dist_export.

Run it the way the notebook ran it:
    torchrun --nproc_per_node={world_size} {name}
"""

import os

import torch
import torch.distributed as dist

import notebook_dist as nd

'''

INIT = """
if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
else:
    dist.init_process_group("gloo")
"""

#: a script pasted into a cell makes its own group (the notebook skipped that call)
OWN_INIT = """
# The process group is made by the init_process_group() call below, as the script did
# under torchrun (in the notebook the cluster's group stood in for it).
"""

# The last barrier's handle is kept until exit: otherwise Gloo's worker thread may free it
# while Python shuts down, which aborts the process (rarely; seen in about 1 run in 50).
FOOTER = """
# Every rank is done before any tears the group down. The handle is kept so the barrier
# is freed here at exit, not on Gloo's worker thread while Python shuts down.
if dist.is_initialized():  # a script pasted into a cell may have destroyed it itself
    _last = dist.barrier(async_op=True)
    _last.wait()
    dist.destroy_process_group()
"""


def _python_lines(source: str) -> str:
    """The cell with IPython-only lines (magics, shell escapes) commented out."""
    out = []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}# (IPython, not exported) {stripped}")
        else:
            out.append(line)
    return "\n".join(out).rstrip() + "\n"


def to_script(cells: list[ExportCell], world_size: int, name: str = "script.py") -> str:
    parts = [
        HEADER.format(
            date=datetime.now().strftime("%Y-%m-%d %H:%M"), world_size=world_size, name=name
        ),
        OWN_INIT if any(_makes_group(c) for c in cells) else INIT,
    ]
    for cell in cells:
        if cell.kind == "kernel":
            body = "\n".join(f"# {ln}" if ln else "#" for ln in cell.source.rstrip().splitlines())
            parts.append(
                f"\n# ---- In [{cell.number}]: ran in the notebook kernel, not on the ranks ----\n{body}\n"
            )
            continue
        body = _python_lines(cell.source)
        ranks = parse_ranks(cell.ranks, world_size)
        if ranks == list(range(world_size)):
            parts.append(f"\n# ---- In [{cell.number}] ----\n{body}")
        else:
            spec = ", ".join(map(str, ranks)) + ("," if len(ranks) == 1 else "")
            parts.append(
                f"\n# ---- In [{cell.number}]: %%rank {cell.ranks} ----\nif dist.get_rank() in ({spec}):\n"
                + textwrap.indent(body, "    ")
            )
    parts.append(FOOTER)
    return "".join(parts)


def _makes_group(cell: ExportCell) -> bool:
    """Whether a distributed cell calls ``init_process_group`` itself (a pasted script)."""
    if cell.kind != "distributed":
        return False
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return False
    return any(
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
        == "init_process_group"
        for node in ast.walk(tree)
    )


def select_cells(cells: list[ExportCell], spec: str | None) -> list[ExportCell]:
    """``--cells 3-7,9`` keeps the cells whose In[N] is in the spec (all by default);
    ``last`` is the last distributed cell that ran."""
    if not spec:
        return list(cells)
    wanted: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if lo == "last" and not sep:
            ran = [c.number for c in cells if c.kind == "distributed"]
            wanted.update(ran[-1:])
            continue
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ExportError(f"bad --cells {spec!r}: give cell numbers like 3-7,9, or last")
        wanted.update(range(int(lo), int(hi or lo) + 1))
    return [c for c in cells if c.number in wanted]


def history_cells(raw_history: list[str], records: dict[int, ExportCell]) -> list[ExportCell]:
    """The notebook's cells in the order they ran: the distributed ones as recorded
    (those that raised on a rank kept as comments), the kernel's own as comments; cells
    of magics only (%dist_init, ...) left out."""
    cells = []
    for n in range(1, len(raw_history)):
        if n in records:
            cell = records[n]
            if not cell.ok:
                cell = ExportCell(
                    n, "kernel", "(raised on the ranks in the notebook)\n" + cell.source
                )
            cells.append(cell)
            continue
        text = raw_history[n].strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines or all(ln.lstrip().startswith("%") for ln in lines) or text.startswith("%%"):
            continue
        cells.append(ExportCell(n, "kernel", text))
    return cells


def write_script(
    path: str,
    cells: str | None,
    raw_history: list[str],
    records: dict[int, ExportCell],
    world_size: int,
) -> str:
    """Write the script for torchrun at ``path`` (``cells``: a --cells spec); what to say."""
    import os

    chosen = select_cells(history_cells(raw_history, records), cells)
    n_dist = sum(c.kind == "distributed" for c in chosen)
    if not n_dist:
        raise ExportError("no distributed cell has run yet (or none in --cells): nothing to export")
    try:
        with open(path, "w") as f:
            f.write(to_script(chosen, world_size, os.path.basename(path)))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ExportError(f"cannot write {path!r}: {reason}") from None
    return (
        f"wrote {path}: {n_dist} distributed cell{'s' if n_dist != 1 else ''}. "
        f"Run it with: torchrun --nproc_per_node={world_size} {path}"
    )
