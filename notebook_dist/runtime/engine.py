"""Entry point of an engine process: ``python -m notebook_dist.runtime.engine``.

Starts importing torch in a background thread while the ipyparallel engine starts and
registers, so the two costs overlap instead of adding up (torch's import is ~3 s here).
"""

from __future__ import annotations

import threading


def _preimport() -> None:
    import sys

    if "torch.distributed" in sys.modules:  # forked from a server that imported it
        return
    from .imports import frozen_after

    with frozen_after():  # (the engine's own imports meanwhile too)
        try:
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        except Exception:
            # the bootstrap imports torch again and reports the error with its rank
            pass


def main() -> None:
    threading.Thread(target=_preimport, name="notebook_dist-preimport", daemon=True).start()
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    main()
