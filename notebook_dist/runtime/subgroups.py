"""The process groups besides the default one, which a rebuild of the default group voids
(``recover.reinit``): each made with ``new_group()`` is kept with what made it
(:func:`install`), and made again, in the same order, once the default group is rebuilt
(:func:`remake`); whatever held the old group then holds the new one.

Every rank must make a group, members or not, in the same order. So each group is kept
under a key every rank gives it alike: how many groups the rank had made before it (since
its engine started, counted the same on every rank, a heal's new rank replaying the cells
included) and what it was asked (its ranks, backend and description). The ranks make again
the groups whose key every rank kept: a member drops the key of a group it destroyed, and
so a rank that was no member of it, which cannot tell, does not make it again either. The
rest are said to be gone. A group made only by its members
(``use_local_synchronization=True``) and a device mesh's (torch makes those itself) are
not made again.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from .state import STATE

#: what made each group, in the order made: [(the group, args, kwargs, its key), ...]
_MADE = "made_groups"
#: how many groups this rank has made that every rank makes (the first half of a key)
_COUNT = "groups_counted"
#: the most records a rank keeps (the newest): one that is no member of a group keeps its
#: record until the next rebuild, so a cell that makes and destroys groups over and over
#: would otherwise grow them without end
KEEP = 4096


def install(dist_module) -> None:
    """``new_group`` (the cells', and ``new_subgroups``' inside torch) keeps what made each
    group it makes."""
    c10d = dist_module.distributed_c10d
    make = c10d.new_group
    if getattr(make, "_notebook_dist_kept", False):
        return

    def new_group(*args, **kwargs):
        made = make(*args, **kwargs)
        asked = _signature(make, args, kwargs)
        if asked is not None:
            count = STATE.extras.get(_COUNT, 0)
            STATE.extras[_COUNT] = count + 1
            # (the records of groups destroyed since go: a cell that makes and destroys
            # groups over and over keeps no more than it has, where it is a member)
            kept = _alive(STATE.extras.get(_MADE, []), c10d)[-(KEEP - 1) :]
            STATE.extras[_MADE] = [*kept, (made, args, kwargs, (count, asked))]
        return made

    new_group._notebook_dist_kept = True
    new_group.__wrapped__ = make
    new_group.__doc__ = make.__doc__
    new_group.__signature__ = inspect.signature(make)
    for module in (dist_module, c10d):
        module.new_group = new_group


def others() -> int:
    """How many process groups there are besides the default one (``new_group()``'s, a
    device mesh's of 2 or more dimensions): a rebuild of the default group voids them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    with contextlib.suppress(Exception):  # (torch's books, as torch 2.x keeps them)
        return max(0, len(dist.distributed_c10d._world.pg_map) - 1)
    return 0


def alive() -> list[tuple]:
    """What made each group still in use (not destroyed), in the order made: taken before
    the default group is destroyed, for :func:`remake`."""
    import torch.distributed as dist

    made = STATE.extras.pop(_MADE, [])
    return _alive(made, dist.distributed_c10d) if dist.is_initialized() else []


def _alive(made: list[tuple], c10d) -> list[tuple]:
    """The records of ``made`` whose group is not destroyed (a rank that is no member of a
    group cannot tell: its record is kept)."""
    members = c10d._world.pg_map
    return [m for m in made if m[0] is c10d.GroupMember.NON_GROUP_MEMBER or m[0] in members]


def remake(kept: list[tuple]) -> list[tuple]:
    """Make the groups of ``kept`` (:func:`alive`) again over the rebuilt default group,
    those whose key every rank kept, in the order made. Returns (old group, new group) for
    this rank's own groups (those it is a member of), for whatever held the old one
    (``group.rebind_holders``)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    make = getattr(c10d.new_group, "__wrapped__", c10d.new_group)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [key for *_, key in kept])
    agreed = set.intersection(*(set(keys) for keys in everyone))
    again, own = [], []
    for old, args, kwargs, key in kept:
        if key not in agreed:
            continue
        new = make(*args, **kwargs)
        if old is not c10d.GroupMember.NON_GROUP_MEMBER:
            own.append((old, new))
        again.append((new, args, kwargs, key))
    STATE.extras[_MADE] = again
    return own


def _signature(make, args: tuple, kwargs: dict) -> tuple | None:
    """What every rank must have asked the same of ``new_group`` (its ranks, backend and
    description), or None for a group that is not made again (made by its members alone,
    or asked what ``new_group`` refused)."""
    try:
        bound = inspect.signature(make).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    if bound.get("use_local_synchronization"):
        return None
    ranks = bound.get("ranks")
    return (
        None if ranks is None else tuple(sorted(ranks)),
        str(bound.get("backend")),
        str(bound.get("group_desc")),
    )
