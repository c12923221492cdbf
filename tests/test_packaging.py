"""The package as users get it: the built wheel and sdist hold every module, and the wheel,
installed into a fresh venv, runs cells in a real kernel started in an empty folder.

Each install goes into a fresh venv that sees this environment's dependencies through a
.pth file, so the tests check our packaging without downloading anything. The venv's own
site-packages comes first, and nothing puts the checkout on the path: what runs is the
installed copy (the tests assert it, on the kernel and on the ranks).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
from conftest import pids_alive
from installs import REPO, clean_env, fresh_venv, pip, purelib

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def checkout_modules() -> set[str]:
    """Every module of the checkout, named as it installs (magics/ -> notebook_dist/magics/)."""
    found = {str(p.relative_to(REPO)) for p in (REPO / "notebook_dist").rglob("*.py") if _kept(p)}
    found |= {
        "notebook_dist/magics/" + str(p.relative_to(REPO / "magics"))
        for p in (REPO / "magics").rglob("*.py")
        if _kept(p)
    }
    return found


def _kept(path: Path) -> bool:
    return "__pycache__" not in path.parts


def wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if n.endswith(".py")}


def test_the_wheel_holds_every_module_of_the_checkout(built):
    assert wheel_modules(built["wheel"]) == checkout_modules()


def test_the_sdist_holds_every_module_and_builds_the_same_wheel(built, tmp_path):
    with tarfile.open(built["sdist"]) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = tmp_path.iterdir()
    in_sdist = {
        str(p.relative_to(src)).replace("magics/", "notebook_dist/magics/", 1)
        if p.relative_to(src).parts[0] == "magics"
        else str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.relative_to(src).parts[0] in ("notebook_dist", "magics")
    }
    assert in_sdist == checkout_modules()
    # what pip does with an sdist: build the wheel from it (setup.py must be in it)
    out = tmp_path / "from-sdist"
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src), cwd=tmp_path)
    assert wheel_modules(next(out.glob("*.whl"))) == checkout_modules()


def test_editable_install_loads_the_magics_from_the_checkout(tmp_path):
    py = fresh_venv(tmp_path)
    pip(
        "--python",
        str(py),
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-e",
        str(REPO),
        cwd=tmp_path,
    )
    check = (
        "import notebook_dist, notebook_dist.magics\n"
        "from IPython.testing.globalipapp import start_ipython\n"
        "ip = start_ipython()\nip.run_line_magic('load_ext', 'notebook_dist')\n"
        "assert ip.find_cell_magic('distributed') and ip.find_line_magic('dist_init')\n"
        "print(notebook_dist.magics.__file__)"
    )
    out = subprocess.run(
        [str(py), "-c", check],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(tmp_path, py),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(REPO / "magics" / "__init__.py")


class WheelKernel:
    """A real kernel on the venv's Python, its working directory an empty folder."""

    def __init__(self, venv_py: Path, home: Path, cwd: Path):
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        kernels = home / "kernels"
        (kernels / "wheel").mkdir(parents=True)
        spec = {
            "argv": [str(venv_py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "the built wheel",
            "language": "python",
        }
        (kernels / "wheel" / "kernel.json").write_text(json.dumps(spec))
        self.km = KernelManager(
            kernel_name="wheel", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
        )
        self.km.start_kernel(cwd=str(cwd), env=clean_env(home, venv_py))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.comms_opened = 0

    def run(self, code: str, timeout: float = 180) -> dict:
        """Run a cell that must succeed: its text, HTML and value."""
        got = {"text": [], "html": [], "value": []}

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                got["text"].append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                data = content["data"]
                got["html"].append(data.get("text/html", ""))
                target = got["value"] if kind == "execute_result" else got["text"]
                target.append(data.get("text/plain", ""))
            elif kind == "comm_open":
                self.comms_opened += 1

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)["content"]
        text = {k: "\n".join(v) for k, v in got.items()}
        assert reply["status"] == "ok", (code, reply.get("evalue"), reply.get("traceback"), text)
        return text

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


@pytest.mark.slow
def test_the_built_wheel_runs_cells_in_a_kernel_started_in_an_empty_folder(built, tmp_path):
    py = fresh_venv(tmp_path)
    pip("--python", str(py), "install", "-q", "--no-deps", str(built["wheel"]), cwd=tmp_path)
    site_packages = purelib(py)
    empty = tmp_path / "empty"
    empty.mkdir()
    k = WheelKernel(py, tmp_path, empty)
    pids: list[int] = []
    try:
        where = k.run(
            "import notebook_dist\nprint(notebook_dist.__file__, notebook_dist.__version__)"
        )
        assert where["text"].split() == [f"{site_packages}/notebook_dist/__init__.py", VERSION]
        k.run("%load_ext notebook_dist")
        started = k.run("%dist_init -n 2")["text"]
        assert f"notebook_dist {VERSION} · torch " in started and "2 ranks, gloo" in started
        cell = k.run(
            "%%distributed\nimport os\nfor step in range(1, 6):\n"
            "    nd.report(step=step, total=5, loss=1.0 / step)\n"
            "t = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
            "(nd.__file__, float(t), os.getpid())"
        )
        # the ranks import the installed copy too, and the kernel's dashboard
        # (notebook_dist.ui, once missing from the wheel) ran and left its record
        assert f"'{site_packages}/notebook_dist/__init__.py', 3.0" in cell["value"], cell
        assert k.comms_opened >= 1 and "nd-dashboard nd-final" in cell["html"], cell
        assert "step" in cell["html"] and "5/5" in cell["html"]
        pids = [int(p) for p in re.findall(r"3\.0, (\d+)\)", cell["value"])]
        assert len(pids) == 2
        status = k.run("%dist_status")
        assert f"notebook_dist {VERSION}" in status["html"] and "idle" in status["text"]
        assert "stacks at the end of the last cell:" in k.run("%dist_stacks")["text"]
        exported = k.run("%dist_export train.py")["text"]
        assert "wrote train.py: 1 distributed cell" in exported
        assert "nd.report(step=step" in (empty / "train.py").read_text()
        assert "cluster stopped" in k.run("%dist_shutdown")["text"]
        assert pids_alive(pids) == []
        assert sorted(os.listdir(empty)) == ["train.py"]
    finally:
        k.close()
        for pid in pids_alive(pids):
            os.kill(pid, 9)
