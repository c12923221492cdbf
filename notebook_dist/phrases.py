"""How the package writes ranks, in every message: one helper, one way."""

from __future__ import annotations

from collections.abc import Iterable


def rank_list(ranks: Iterable[int], one: str = "rank", many: str = "ranks") -> str:
    """'rank 1', 'ranks 0, 2'."""
    ranks = sorted(ranks)
    return f"{one if len(ranks) == 1 else many} {', '.join(map(str, ranks))}"
