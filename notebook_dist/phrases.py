"""How the package writes ranks and sizes, in every message: one helper each."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))

#: from how many ranks what is said of every rank says the ranks that are alike once: the
#: dashboard's groups (``ui/compact.py``), the doctor's table
COMPACT_FROM = 9


def rank_list(ranks: Iterable[int], one: str = "rank", many: str = "ranks") -> str:
    """'rank 1', 'ranks 0, 2', 'Ranks 0-9, 11-31' (``many="Ranks"``): three or more ranks
    in a row as a range, so a verdict at 32 ranks names the odd one out at a glance."""
    ranks = sorted(set(ranks))
    return f"{one if len(ranks) == 1 else many} {_runs(ranks)}"


def rank_numbers(ranks: Iterable[int]) -> str:
    """The numbers alone, as :func:`rank_list` writes them: '0-4, 6-15'."""
    return _runs(sorted(set(ranks)))


def alike(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """The items that share a key, under it, the keys in the order they first come: how
    every message that speaks of many ranks finds the ranks that read the same."""
    groups: dict[K, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


#: the first word of what one rank does, as several ranks do it
_OF_MANY = {"is": "are", "was": "were", "waits": "wait", "runs": "run", "has": "have"}


def each_rank(
    said: Iterable[tuple],
    sep: str = "; ",
    between: str = " ",
    one: str = "rank",
    many: str = "ranks",
) -> str:
    """What each rank does, the ranks that do the same named once, in the order they first
    come: 'ranks 0-4, 6-15 wait in all_reduce #1 at line 4; rank 5 finished the cell'. At 32
    ranks a verdict reads as one line per thing the ranks do, not one per rank. ``said``: a
    rank and its words as of one rank, and as of several where :func:`of_many` cannot make
    them."""
    return sep.join(
        f"{rank_list([s[0] for s in same], one, many)}{between}"
        + (words if len(same) == 1 else same[0][2] if len(same[0]) > 2 else of_many(words))
        for words, same in alike(said, key=lambda s: s[1]).items()
    )


def of_many(words: str) -> str:
    """What one rank does, said of several: 'is busy' -> 'are busy'."""
    first, space, rest = words.partition(" ")
    return _OF_MANY.get(first, first) + space + rest


def _runs(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ", ".join(parts)


def groups_after_rebuild(lost: int, remade: int) -> str:
    """What a rebuild of the default group did to the other groups, in a sentence or two:
    those made again, those gone ("" when there were none)."""
    said = []
    if remade:
        one = remade == 1
        said.append(
            f"{remade} process group{'' if one else 's'} made with new_group() or by a "
            f"device mesh {'was' if one else 'were'} made again over the same ranks."
        )
    if lost:
        one = lost == 1
        said.append(
            f"{lost} process group{'' if one else 's'} besides the default one "
            f"{'is' if one else 'are'} gone (not made alike on every rank): make "
            f"{'it' if one else 'them'} again."
        )
    return " ".join(said)


def _scaled(n: float) -> tuple[float, str]:
    for unit, size in _UNITS:
        if n >= size:
            return n / size, unit
    return n, "B"


def size_text(n: int) -> str:
    """A transfer's size, three significant digits: '514 KiB', '4 MiB', '96 B'."""
    value, unit = _scaled(n)
    return f"{n} B" if unit == "B" else f"{value:.3g} {unit}"


def memory_text(n: int | None) -> str:
    """Memory held, one decimal: '100.0 MiB'; '-' when not known."""
    if not n:
        return "-"
    value, unit = _scaled(n)
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


#: how a rank that ended is said where the notebook cannot see its exit status: a rank on
#: another host, found gone by the controller's heartbeat; one started by ``mpiexec`` or
#: attached, found gone here. A verdict says instead what the rank's own files say of its
#: end (``watch.inputs.dead_report``).
HEARTBEAT_GONE = "stopped answering the controller's heartbeat"
PROCESS_GONE = "ended (its engine process is gone)"
UNKNOWN_EXIT = "ended (exit status unknown)"
UNSEEN_EXITS = frozenset({HEARTBEAT_GONE, PROCESS_GONE, UNKNOWN_EXIT})


def describe_exit(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that ended it):
    'was killed by SIGKILL', 'exited with code 3'."""
    import signal

    if code is None:
        return UNKNOWN_EXIT
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
