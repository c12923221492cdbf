"""Rank specifications: ``all``, ``0``, ``0,2``, ``1-3`` and combinations (``0,2-3``).

Parsed by hand, never ``eval``-ed.
"""

from __future__ import annotations

from .errors import RankSpecError
from .phrases import rank_list

_FORMS = "use 'all', a rank like '0', a list like '0,2' or a range like '1-3'"


def parse_ranks(spec: str | int | list[int] | tuple[int, ...] | None, world_size: int) -> list[int]:
    """Return the sorted ranks that ``spec`` names, checked against ``world_size``.

    >>> parse_ranks("0,2-3", 4)
    [0, 2, 3]
    """
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, int):
        ranks = {spec}
    elif isinstance(spec, (list, tuple, range, set, frozenset)):
        ranks = set()
        for item in spec:
            if not isinstance(item, int) or isinstance(item, bool):
                raise RankSpecError(f"ranks must be integers, got {item!r}")
            ranks.add(item)
    else:
        text = str(spec).strip()
        if text.lower() == "all":
            return list(range(world_size))
        if not text:
            raise RankSpecError(f"empty rank specification: {_FORMS}")
        ranks = set()
        for part in text.split(","):
            part = part.strip()
            if not part:
                raise RankSpecError(f"bad rank specification {spec!r}: empty item; {_FORMS}")
            lo, sep, hi = part.partition("-")
            bounds = (lo, hi) if sep else (part, part)
            if not all(b.strip().isdigit() for b in bounds):
                raise RankSpecError(f"bad rank specification {spec!r}: {_FORMS}")
            a, b = int(bounds[0]), int(bounds[1])
            if a > b:
                raise RankSpecError(f"bad rank range {part!r}: the start is after the end")
            ranks.update(range(a, b + 1))
    if not ranks:
        raise RankSpecError(f"no ranks selected: {_FORMS}")
    bad = sorted(r for r in ranks if r < 0 or r >= world_size)
    if bad:
        have = "rank 0" if world_size == 1 else f"ranks 0-{world_size - 1}"
        raise RankSpecError(
            f"{rank_list(bad)} not in this cluster: it has {world_size} "
            f"{'rank' if world_size == 1 else 'ranks'} ({have})"
        )
    return sorted(ranks)
