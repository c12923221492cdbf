"""The IPython layer: argument parsing and display only; the logic lives in notebook_dist.

Installed as ``notebook_dist.magics`` (pyproject maps this folder there).
"""

from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    from notebook_dist.session import SESSION

    SESSION.ahead()  # first: torch is imported for the ranks while the rest loads
    from .debugging import DebugMagics
    from .magics import DistMagics
    from .performance import PerformanceMagics

    magics = DistMagics(ipython)
    # %debug after a failed %%distributed cell debugs the rank; IPython's own otherwise
    if not hasattr(ipython, "_notebook_dist_ipython_debug"):
        ipython._notebook_dist_ipython_debug = ipython.find_line_magic("debug")
    ipython.register_magics(magics)
    ipython.register_magics(DebugMagics(ipython))
    ipython.register_magics(PerformanceMagics(ipython))
    ipython._notebook_dist_magics = magics


def unload_ipython_extension(ipython) -> None:
    from notebook_dist.session import SESSION

    magics = getattr(ipython, "_notebook_dist_magics", None)
    if magics is not None:
        magics.autodist(False)
        SESSION.shutdown()
        SESSION.ahead(False)
