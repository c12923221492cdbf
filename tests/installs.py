"""The package as users install it, for the tests that check that: the wheel and sdist
built from a clean copy of the checkout, and fresh venvs to install them into.

A fresh venv sees this environment's dependencies (torch, ipyparallel, sphinx, ...) through
a .pth file, so nothing is downloaded. The venv's own site-packages comes first, and a path
in a .pth file is not a site dir, so the editable install of the checkout that lives in this
environment stays inactive there: what runs is what was installed into the venv.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, cwd=cwd)


def clean_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them: a build/ folder left by an earlier
    build would otherwise slip stale modules into the wheel and hide a missing package."""
    files = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def build(src: Path, out: Path) -> dict[str, Path]:
    """The wheel (as `pip wheel .` builds it) and the sdist (as `python -m build` would)."""
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src), cwd=out)
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=src, capture_output=True)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def fresh_venv(where: Path) -> Path:
    """A new venv in ``where`` (its python returned), this environment's dependencies behind
    its own site-packages."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    Path(purelib(py), "zz_deps.pth").write_text("\n".join(deps) + "\n")
    return py


def purelib(py: Path) -> str:
    return subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def clean_env(home: Path, venv_py: Path) -> dict[str, str]:
    """An environment with the venv first on PATH and nothing of this one's."""
    return {
        "PATH": f"{venv_py.parent}:/usr/bin:/bin",
        "HOME": str(home),
        "IPYTHONDIR": str(home / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "OMP_NUM_THREADS": "1",
    }
