"""`pip install .` and `pip install -e .` both give a working `%load_ext notebook_dist`.

Each install goes into a fresh venv that sees this environment's dependencies through a
.pth file, so the test checks our packaging (magics/ mapped to notebook_dist.magics)
without downloading anything.
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import notebook_dist, notebook_dist.magics
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "notebook_dist")
assert ip.find_cell_magic("distributed") and ip.find_line_magic("dist_init")
print("MAGICS_FROM", notebook_dist.magics.__file__)
"""


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the new venv's own site-packages comes first; ours (deps only) after it
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    Path(purelib, "zz_deps.pth").write_text("\n".join(deps) + "\n")
    return py


@pytest.mark.parametrize("editable", [False, True], ids=["pip-install", "pip-install-e"])
def test_load_ext_after_install(tmp_path, editable):
    py = _venv(tmp_path)
    target = ["-e", str(REPO)] if editable else [str(REPO)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            *target,
        ],
        check=True,
        cwd=tmp_path,
    )
    env = {"PATH": "/usr/bin:/bin", "IPYTHONDIR": str(tmp_path / "ipy"), "HOME": str(tmp_path)}
    out = subprocess.run(
        [str(py), "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stderr
    where = out.stdout.split("MAGICS_FROM", 1)[1].strip()
    if editable:
        assert where == str(REPO / "magics" / "__init__.py")
    else:
        assert "site-packages" in where and where.endswith("notebook_dist/magics/__init__.py")
