"""Process launchers called on a rank do what the pasted code meant: the ranks already
are the processes.

- ``torch.multiprocessing.spawn(fn, args, nprocs=world_size)`` (PyTorch's DDP tutorial
  under ``if __name__ == "__main__":``), and ``start_processes`` alike, run
  ``fn(rank, *args)`` on each rank in place, with one note; another ``nprocs`` is
  refused with a sentence, before any child starts;
- ``multiprocessing.Process(target=f)`` with ``f`` defined in a cell (``dist_tuto``'s
  ``run.py``) is refused before the child starts: a child cannot see a cell's functions,
  and each rank would start ranks of its own. A target from a module (DataLoader's
  workers, a library's pool) starts as usual;
- a process the cell started that ended with an error fails the cell
  (:func:`check_children`): it never ends green with its children dead;
- ``set_start_method`` of the method already set is accepted (a cell run again raised
  "context has already been set").

And a progress bar (tqdm: its text bars, ``tqdm.auto``, ``tqdm.notebook``, the bars of
Lightning and the Transformers Trainer) says which rank it is: ``[rank 1] Epoch 0``.
"""

from __future__ import annotations

import sys

from .state import STATE

_originals: dict = {}


class AlreadyTheRanks(RuntimeError):
    """A call that would start rank processes on a rank, refused before any child starts."""


def _is_cell_function(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith("Cell In[")


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """``torch.multiprocessing.spawn`` on a rank: ``fn(rank, *args)`` here, in place."""
    if nprocs != STATE.world_size:
        raise AlreadyTheRanks(
            f"mp.spawn(..., nprocs={nprocs}) would start {nprocs} processes on each of the "
            f"{STATE.world_size} ranks, but the ranks already are the processes: call "
            f"{getattr(fn, '__name__', 'fn')}(nd.rank, ...) in the cell, or %dist_init -n "
            f"{nprocs} for {nprocs} ranks"
        )
    if STATE.extras.get("spawn_said") != STATE.cell_token:
        STATE.extras["spawn_said"] = STATE.cell_token
        print(
            f"notebook_dist: mp.spawn({getattr(fn, '__name__', 'fn')}, nprocs={nprocs}) runs "
            f"it on each of the {nprocs} ranks in place (the ranks already are the processes): "
            "rank r calls it with r.",
            file=sys.stderr,
        )
    fn(STATE.rank, *args)
    return None if join else _Done()


class _Done:
    """What ``spawn(join=False)`` returns: the work already ran."""

    def join(self, timeout=None) -> bool:
        return True


def _checked_start(self):
    target = getattr(self, "_target", None)
    if _is_cell_function(target):
        raise AlreadyTheRanks(
            f"multiprocessing.Process(target={target.__name__}) would start a process of its "
            "own on each rank (and a child process cannot see functions defined in a cell), "
            f"but the ranks already are the processes: call {target.__name__}(nd.rank, "
            "nd.world_size, ...) in the cell instead"
        )
    started = _originals["start"](self)  # it forgets its target once started
    if not self.daemon:  # a DataLoader's or a pool's workers are daemons, ended by their owner
        _children.append((STATE.cell_token, self, getattr(target, "__name__", "?")))
    return started


#: the processes a cell started itself (not daemons), with the cell's token
_children: list = []


class ChildProcessFailed(RuntimeError):
    """A process the cell started ended with an error: the cell did not do its work."""


def check_children() -> None:
    """At the end of a cell that ran to its end: a process it started that has ended with
    an error makes the cell fail, naming it (its traceback is above, on stderr)."""
    mine = [(p, name) for token, p, name in _children if token == STATE.cell_token]
    _children[:] = [c for c in _children if c[1].exitcode is None]  # still running
    failed = [(p, name) for p, name in mine if p.exitcode not in (None, 0)]
    if failed:
        said = ", ".join(
            f"{p.name} (pid {p.pid}, target {name}) exited with code {p.exitcode}"
            for p, name in failed
        )
        raise ChildProcessFailed(
            f"{said}: a process this cell started failed, so the cell did not do its work"
        )


def _set_start_method(method, force=False):
    import multiprocessing

    if not force and multiprocessing.get_start_method(allow_none=True) == method:
        return None  # a cell run again: the same method is already set
    return _originals["set_start_method"](method, force=force)


def is_widget_bar(bar) -> bool:
    """Whether ``bar`` is a ``tqdm.notebook`` bar (a widget), not a text bar."""
    return any(c.__module__ == "tqdm.notebook" for c in type(bar).__mro__)


def label_progress_bars() -> None:
    """A widget progress bar (``tqdm.notebook``, and ``tqdm.auto`` where it picks widgets)
    says its rank before its description, also when a framework sets the description
    later (Lightning's "Epoch 0"). A text bar is a line of the rank's stream, which the
    notebook already shows as the rank's: it is left as it is. Every bar's count rides in
    the agent's snapshots (the dashboard's progress), and where the notebook shows the
    ranks' alike bars as one, a bar shows nothing on the rank (``runtime/bars.py``)."""
    import importlib.util

    if "tqdm_init" in _originals or importlib.util.find_spec("tqdm") is None:
        return
    import tqdm.std

    from . import bars

    cls = tqdm.std.tqdm
    init = _originals["tqdm_init"] = cls.__init__
    set_description = _originals["tqdm_set_description"] = cls.set_description
    set_description_str = _originals["tqdm_set_description_str"] = cls.set_description_str

    def label(bar, desc):
        if not is_widget_bar(bar) or bars.grouped():  # (a grouped bar is of many ranks)
            return desc
        return f"[rank {STATE.rank}] {desc}" if desc else f"[rank {STATE.rank}]"

    def labelled_init(self, *args, **kwargs):
        if len(args) > 1:  # tqdm(iterable, desc, ...)
            args = (args[0], label(self, args[1]), *args[2:])
        else:
            kwargs["desc"] = label(self, kwargs.get("desc"))
        # (run inside tqdm.notebook's own __init__, before it makes its widgets)
        quiet = bars.quieted(self, is_widget_bar(self), args, kwargs)
        init(self, *args, **kwargs)
        bars.keep(self, quiet)

    def labelled_set_description(self, desc=None, refresh=True):
        set_description(self, label(self, desc), refresh)

    def labelled_set_description_str(self, desc=None, refresh=True):
        set_description_str(self, label(self, desc), refresh)

    cls.__init__ = labelled_init
    cls.set_description = labelled_set_description
    cls.set_description_str = labelled_set_description_str


def install() -> None:
    """The guards, once per process (``bootstrap``)."""
    label_progress_bars()
    if "start" in _originals:
        return
    import multiprocessing
    import multiprocessing.process

    import torch.multiprocessing as tmp

    _originals["start"] = multiprocessing.process.BaseProcess.start
    _originals["set_start_method"] = multiprocessing.set_start_method
    _originals["spawn"] = tmp.spawn
    multiprocessing.process.BaseProcess.start = _checked_start
    multiprocessing.set_start_method = _set_start_method
    tmp.set_start_method = _set_start_method
    tmp.spawn = spawn
    _originals["start_processes"] = tmp.start_processes
    tmp.start_processes = spawn  # what spawn calls, with the same arguments
    if hasattr(tmp, "spawn_"):
        tmp.spawn_ = spawn
    import torch.multiprocessing.spawn as spawn_module

    spawn_module.spawn = spawn
    spawn_module.start_processes = spawn
