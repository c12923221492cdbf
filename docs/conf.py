"""The notebook_dist documentation site: Sphinx, the PyData theme and myst-nb.

    python -m sphinx docs docs/_build/html

Tutorials come from ``notebooks/``, executed: the copies the tests executed are reused
when ``NOTEBOOK_DIST_EXECUTED`` names their folder (tests/test_site.py does), and any other
notebook without outputs is executed here, on 2 CPU ranks. The magic reference is made
from the magics themselves (``_ext/magicref.py``). tests/test_site.py builds it with
warnings as errors, from the built wheel installed in a fresh environment.

It documents the installed package: ``pip install .[docs]`` (or ``-e``), then
``python -m sphinx -W docs OUT`` from the checkout or from anywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
# notebook_dist is the installed one, regular or editable, never the checkout's folder: only
# an install maps magics/ to notebook_dist.magics. `python -m sphinx` run from the checkout
# puts the checkout first on sys.path, where half of the package would be found: take it off.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != DOCS.parent]

project = "notebook_dist"
author = "the notebook_dist authors"
copyright = "2026, the notebook_dist authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "magicref",
    "tutorials",
]

html_theme = "pydata_sphinx_theme"
html_title = "notebook_dist"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_prev_next": True,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
# single pages have no section to navigate: the left sidebar only where there is one
html_sidebars = {
    page: [] for page in ("index", "guide", "beyond", "benchmarks", "hangs", "troubleshooting")
}
exclude_patterns = ["_build", "_ext", "**.ipynb_checkpoints", "jupyter_execute"]

# myst-nb: a notebook without outputs is executed at build time (the hang catalogue, the
# troubleshooting page, a tutorial the tests did not execute first); one with outputs is
# shown as it is. A cell that raises fails the build unless it is tagged raises-exception.
nb_execution_mode = "auto"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_in_temp = True
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# every reference must resolve (tests build with -W): Python objects too, except those of
# the libraries underneath, whose inventories this offline build cannot fetch
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|ipyparallel|IPython|traitlets|ipywidgets|numpy)(\..*)?"),
    (r"py:.*", r"(TextIO|Any|Callable|Path|dataclasses\..*|typing\..*|collections\..*)"),
    # type hints as autodoc quotes them ('dict[str, int] | None'), and the prepared cell,
    # which is the library's own business
    (r"py:class", r"'.*"),
    (r"py:class", r"notebook_dist\.execute\.PreparedCell"),
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"

os.environ.setdefault("OMP_NUM_THREADS", "1")
