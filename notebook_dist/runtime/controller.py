"""A cluster's controller: ipyparallel's own, with its own arguments, started sooner
(``python -m notebook_dist.runtime.controller``, the command ``cluster/processes.py``
gives ipyparallel's controller launcher).

With the fork server started ahead (``%load_ext``), the controller's start is most of what
``%dist_init`` waits for: about 0.6 s here, of which

- 0.3 s is importing ipyparallel, made here without the garbage collector (as the fork
  server imports; 0.03 s less), and
- 0.25 s is a fixed pause the hub takes once it has made its database
  (``time.sleep(0.25)`` in ``IPController.init_hub``, from when that database could be a
  server to connect to; the controller's is in memory). It is skipped: nothing else of
  the hub's start is changed, and a controller without that pause starts as before.
"""

from __future__ import annotations

import time


class _NoPause:
    """The ``time`` module, but for ``sleep``: what the hub's start sees of it."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(_seconds: float) -> None:
        pass


def without_pause(app) -> None:
    """``app`` (``ipyparallel.controller.app``) with its controller's ``init_hub`` run
    without the pause: the hub sees :class:`_NoPause` as its ``time`` while it starts."""
    init_hub = app.IPController.init_hub

    def init_hub_without_pause(self):
        module_time, app.time = getattr(app, "time", time), _NoPause()
        try:
            return init_hub(self)
        finally:
            app.time = module_time

    app.IPController.init_hub = init_hub_without_pause


def main() -> None:
    from .imports import frozen_after

    with frozen_after():
        from ipyparallel.controller import app

    without_pause(app)
    app.main()


if __name__ == "__main__":
    main()
