"""binder/ stays consistent with pyproject.toml: same dependencies, the package installed."""

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower()


def test_binder_requirements_cover_the_project():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["lab"]}
    lines = [ln.strip() for ln in (REPO / "binder" / "requirements.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith(("#", "-"))]
    have = {_name(r) for r in reqs}
    assert wanted <= have, f"missing from binder/requirements.txt: {wanted - have}"
    assert have <= wanted, f"binder/requirements.txt has extras pyproject lacks: {have - wanted}"
    # Binder runs the tutorials: the torch they need, as the lab extra asks for it
    (lab_torch,) = [r for r in project["optional-dependencies"]["lab"] if _name(r) == "torch"]
    assert lab_torch in reqs
    # the CPU build of torch: Binder has no GPU, and the CUDA wheels are several GB
    assert any(ln.startswith("--extra-index-url") and ln.endswith("/whl/cpu") for ln in lines)


def test_binder_installs_the_package_itself():
    post = (REPO / "binder" / "postBuild").read_text()
    # as users install it: the built package, not the checkout (-e hid a wheel that lacked a module)
    assert "pip install --no-deps ." in post and " -e " not in post
    assert (REPO / "binder" / "postBuild").stat().st_mode & 0o111
