"""The process groups besides the default one, which a rebuild of the default group voids
(``recover.reinit``): each made with ``new_group()``, and each set a device mesh makes, is
kept with what made it (:func:`install`), and made again, in the same order, once the
default group is rebuilt (:func:`remake`); whatever held an old group then holds its new
one, and a device mesh (its slices and flattened meshes too) names its new groups.

Every rank must make a group, members or not, in the same order. So each is kept under a
key every rank gives it alike: how many this rank had made before it (since its engine
started, counted the same on every rank, a heal's new rank replaying the cells included)
and what it was asked (a group's ranks, backend and description; a mesh's layout, ranks,
dimension names and backends). The ranks make again those whose key every rank kept: a
member drops the key of a group it destroyed, and so a rank that was no member of it,
which cannot tell, does not make it again either. A group made by its members alone
(``use_local_synchronization=True``) is kept by them only, under what they asked, and made
again by them if every one of them kept it. The rest are said to be gone.
"""

from __future__ import annotations

import contextlib
import inspect

from .group import meeting_within
from .state import STATE, rebuild_step

#: what made each group or mesh, in the order made: [(kind, made, args, kwargs, key), ...]
#: where kind is "group" (made: the group) or "mesh" (made: its groups' names)
_MADE = "made_groups"
#: how many groups and meshes this rank has made that every rank makes (a key's first half)
_COUNT = "groups_counted"
#: the most records a rank keeps (the newest): one that is no member of a group keeps its
#: record until the next rebuild, so a cell that makes and destroys groups over and over
#: would otherwise grow them without end
KEEP = 4096
#: a key's first half for a group made by its members alone (they alone make it again)
_LOCAL = "made by its members"
#: the records a rebuild is making again, until it has (a try that failed leaves them to
#: the next: its groups are destroyed, so :func:`alive` could no longer tell them)
_HELD = "groups_being_remade"
#: how deep the rank is inside a device mesh's making (its own new_group calls are the
#: mesh's, not kept apart)
_IN_MESH = [0]


def install(dist_module) -> None:
    """``new_group`` (the cells', and ``new_subgroups``' inside torch) and a device mesh's
    making of its groups keep what made each."""
    c10d = dist_module.distributed_c10d
    make = c10d.new_group
    if getattr(make, "_notebook_dist_kept", False):
        return

    def new_group(*args, **kwargs):
        made = make(*args, **kwargs)
        if not _IN_MESH[0]:
            _keep(c10d, "group", made, args, kwargs, _signature(make, args, kwargs))
        return made

    new_group._notebook_dist_kept = True
    new_group.__wrapped__ = make
    new_group.__doc__ = make.__doc__
    new_group.__signature__ = inspect.signature(make)
    for module in (dist_module, c10d):
        module.new_group = new_group
    _install_mesh(c10d)


def _install_mesh(c10d) -> None:
    """A device mesh makes its groups in ``DeviceMesh._init_process_groups`` (torch 2.x:
    at its making, flattening and unflattening): what it was given is kept, and the
    names of the groups it made."""
    try:
        from torch.distributed.device_mesh import DeviceMesh

        init = DeviceMesh._init_process_groups
        signature = inspect.signature(init)
    except Exception:  # (no device mesh in this torch, or not as torch 2.x makes it)
        return
    if getattr(init, "_notebook_dist_kept", False):
        return

    def init_process_groups(*args, **kwargs):
        _IN_MESH[0] += 1
        try:
            names = init(*args, **kwargs)
        finally:
            _IN_MESH[0] -= 1
        if not _IN_MESH[0]:
            _keep(c10d, "mesh", list(names), args, kwargs, _mesh_signature(signature, args, kwargs))
        return names

    init_process_groups._notebook_dist_kept = True
    init_process_groups.__wrapped__ = init
    DeviceMesh._init_process_groups = staticmethod(init_process_groups)


def _keep(c10d, kind: str, made, args: tuple, kwargs: dict, asked: tuple | None) -> None:
    """Keep a record of what was made (nothing for what is not made again: ``asked`` None).
    A group made by its members alone (``use_local_synchronization=True``) is not counted:
    the other ranks do not make it; its members key it by what they asked alike."""
    if asked is None:
        return
    if asked[0] == _LOCAL:
        count, asked = _LOCAL, asked[1:]
        if made is c10d.GroupMember.NON_GROUP_MEMBER:
            return
    else:
        count = STATE.extras.get(_COUNT, 0)
        STATE.extras[_COUNT] = count + 1
    # (the records of groups destroyed since go: a cell that makes and destroys groups over
    # and over keeps no more than it has, where it is a member)
    kept = _alive(STATE.extras.get(_MADE, []), c10d)[-(KEEP - 1) :]
    STATE.extras[_MADE] = [*kept, (kind, made, args, kwargs, (count, asked))]


def others() -> int:
    """How many process groups there are besides the default one (``new_group()``'s, a
    device mesh's): a rebuild of the default group voids them."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    with contextlib.suppress(Exception):  # (torch's books, as torch 2.x keeps them)
        return max(0, len(dist.distributed_c10d._world.pg_map) - 1)
    return 0


def alive() -> list[tuple]:
    """What made each group and mesh still in use (not destroyed), in the order made,
    taken before the default group is destroyed, for :func:`remake` (a mesh's, with its
    groups as they are now: [(name, group), ...])."""
    import torch.distributed as dist

    made, held = STATE.extras.pop(_MADE, []), STATE.extras.pop(_HELD, [])
    if dist.is_initialized():
        c10d = dist.distributed_c10d
        by_name = {name: pg for pg, name in c10d._world.pg_names.items()}
        held += [
            (kind, [(n, by_name[n]) for n in old] if kind == "mesh" else old, *rest)
            for kind, old, *rest in _alive(made, c10d)
        ]
    STATE.extras[_HELD] = held
    return held


def _alive(made: list[tuple], c10d) -> list[tuple]:
    """The records of ``made`` whose groups are not destroyed (a rank that is no member of
    a group cannot tell: its record is kept)."""
    members = c10d._world.pg_map
    names = set(c10d._world.pg_names.values())
    return [
        m
        for m in made
        if (m[0] == "mesh" and names.issuperset(m[1]))
        or (m[0] == "group" and (m[1] is c10d.GroupMember.NON_GROUP_MEMBER or m[1] in members))
    ]


def remake(kept: list[tuple], store) -> tuple[list[tuple], dict[str, str] | None]:
    """Make the groups and meshes' groups of ``kept`` (:func:`alive`) again over the
    rebuilt default group, those whose key every rank kept (:func:`_agreed`, in
    ``store``, the rebuild's), in the order made. Returns (old group, new group) for this
    rank's own groups (those it is a member of), for whatever held the old one
    (``group.rebind_holders``); and, when a mesh's groups were made again, their names that
    changed (old -> new), for :func:`rename_in_meshes` (else None)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    rebuild_step("agreeing with the others which other groups to make again")
    agreed = _agreed(store, [record[-1] for record in kept])
    rebuild_step(f"making {len(agreed)} other groups again")
    again, own, renamed, meshes = [], [], {}, False
    with meeting_within(store.timeout):
        for kind, old, args, kwargs, key in kept:
            if key in agreed:
                new = _made_again(c10d, kind, old, args, kwargs, own, renamed)
                again.append((kind, new, args, kwargs, key))
                meshes = meshes or kind == "mesh"
    STATE.extras[_MADE] = again
    STATE.extras.pop(_HELD, None)
    return own, renamed if meshes else None


def _made_again(c10d, kind: str, old, args: tuple, kwargs: dict, own: list, renamed: dict):
    """The group or mesh's groups of one record made again (see :func:`remake`): what the
    record keeps of them; this rank's (old, new) groups added to ``own``, and a mesh's group
    names that changed to ``renamed``."""
    if kind == "group":
        new = _unwrapped(c10d.new_group)(*args, **kwargs)
        if old is not c10d.GroupMember.NON_GROUP_MEMBER:
            own.append((old, new))
        return new
    from torch.distributed.device_mesh import DeviceMesh

    names = list(_unwrapped(DeviceMesh._init_process_groups)(*args, **kwargs))
    by_name = {name: pg for pg, name in c10d._world.pg_names.items()}
    for (was, pg), now in zip(old, names):
        if by_name[now] is not c10d._get_default_group():  # (a dimension over every
            own.append((pg, by_name[now]))  # rank has the default group)
        if now != was:  # (names start again from the default group's)
            renamed[was] = now
    return names


def _agreed(store, keys: list[tuple]) -> set[tuple]:
    """The keys every rank kept, met in the rebuild's store: within its timeout (the
    rendezvous's), where a collective would wait for the group's (minutes) on a rank that
    is not coming; such ranks are named."""
    import pickle

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    names = [f"notebook_dist/kept/{r}" for r in range(world)]
    store.set(names[rank], pickle.dumps(keys))
    try:
        store.wait(names)
    except Exception:  # (torch's DistStoreError: the store's timeout passed)
        late = [str(r) for r, name in enumerate(names) if not store.check([name])]
        raise TimeoutError(
            f"rank{'s' if len(late) > 1 else ''} {', '.join(late)} did not come to agree "
            f"which other process groups to make again within {store.timeout.total_seconds():.0f} s"
        ) from None
    everyone = [set(pickle.loads(blob)) for blob in store.multi_get(names)]
    agreed = set.intersection(*everyone)
    for count, asked in everyone[rank]:  # a group made by its members alone: they kept it
        if count == _LOCAL:
            members = range(world) if asked[0] is None else asked[0]
            if all((count, asked) in everyone[m] for m in members):
                agreed.add((count, asked))
    return agreed


def _unwrapped(func):
    return getattr(func, "__wrapped__", func)


def rename_in_meshes(meshes: list, renamed: dict[str, str]) -> None:
    """Every device mesh of ``meshes`` (a slice's and a flattened one's too) names its
    groups by their new names (``renamed``: old name -> new, where they differ), and holds
    the new groups where it holds them by name."""
    import torch.distributed as dist

    by_name = {name: pg for pg, name in dist.distributed_c10d._world.pg_names.items()}
    for mesh in meshes:
        if not hasattr(mesh, "_dim_group_names"):
            continue
        mesh._dim_group_names = [renamed.get(n, n) for n in mesh._dim_group_names]
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            now = {renamed.get(n, n): pg for n, pg in registry.items()}
            mesh._pg_registry = {n: by_name.get(n, pg) for n, pg in now.items()}


def _signature(make, args: tuple, kwargs: dict) -> tuple | None:
    """What every rank must have asked the same of ``new_group`` (its ranks, backend and
    description), first marked :data:`_LOCAL` for a group made by its members alone; or
    None for a group that is not made again (asked what ``new_group`` refused)."""
    try:
        bound = inspect.signature(make).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    ranks = bound.get("ranks")
    asked = (
        None if ranks is None else tuple(sorted(ranks)),
        str(bound.get("backend")),
        str(bound.get("group_desc")),
    )
    return (_LOCAL, *asked) if bound.get("use_local_synchronization") else asked


def _mesh_signature(signature, args: tuple, kwargs: dict) -> tuple | None:
    """What every rank gave a device mesh alike: its layout, its ranks, the names of its
    dimensions and their backends (not their options: those print as objects)."""
    try:
        given = list(signature.bind(*args, **kwargs).arguments.values())
        layout, rank_map, names, backends = given
        return (
            "mesh",
            repr(layout),
            tuple(rank_map.flatten().tolist()),
            None if names is None else tuple(names),
            tuple((str(b), o is not None) for b, o in backends),
        )
    except Exception:  # (not as torch 2.x gives them: not made again)
        return None
