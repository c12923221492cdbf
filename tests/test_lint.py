"""ruff (lint and format) on the project's code."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ruff(*args):
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_check():
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_notebooks_lint_with_nbqa():
    exe = shutil.which("nbqa") or str(Path(sys.executable).with_name("nbqa"))
    pages = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.ipynb"))
    assert pages, "the site's own notebooks (hang catalogue, troubleshooting)"
    out = subprocess.run(
        [exe, "ruff", "notebooks/", *pages], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
