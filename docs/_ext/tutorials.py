"""Put the tutorials (``notebooks/*.ipynb``) into the site before Sphinx reads its sources.

Each comes in executed when the tests left an executed copy in the folder named by
``NOTEBOOK_DIST_EXECUTED`` (tests/test_notebooks.py writes them, tests/test_site.py
passes the folder on), so the site shows what the tests saw and nothing runs twice;
otherwise the stored notebook comes in without outputs, and myst-nb executes it.
"""

from __future__ import annotations

import os
from pathlib import Path


def copy_tutorials(app) -> None:
    docs = Path(app.srcdir)
    source = docs.parent / "notebooks"
    target = docs / "tutorials"
    target.mkdir(exist_ok=True)
    executed = os.environ.get("NOTEBOOK_DIST_EXECUTED")
    for nb in sorted(source.glob("*.ipynb")):
        done = Path(executed, nb.name) if executed else None
        if done is not None and done.exists() and done.stat().st_mtime >= nb.stat().st_mtime:
            text = done.read_text()
        else:
            text = nb.read_text()
        out = target / nb.name
        if not out.exists() or out.read_text() != text:  # unchanged: Sphinx keeps its cache
            out.write_text(text)
    for stale in target.glob("*.ipynb"):
        if not (source / stale.name).exists():
            stale.unlink()


def setup(app):
    app.connect("builder-inited", copy_tutorials)
    return {"parallel_read_safe": True, "version": "1", "env_version": 1}
