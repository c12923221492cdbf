"""Importing a process's large, long-lived modules (torch, ipyparallel) at start-up."""

from __future__ import annotations

import gc


class frozen_after:
    """Imports without the garbage collector, and what they made frozen afterwards.

    Importing torch makes hundreds of thousands of objects, and each full collection on
    the way scans them all (0.15 s of the server's 1.5 s of imports here). Frozen, they
    stay out of every later collection, in the server and in each engine forked from it:
    a collection in an engine no longer touches, and so copies, the pages it shares with
    the server."""

    def __enter__(self):
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        gc.freeze()
        if self.was_enabled:
            gc.enable()
