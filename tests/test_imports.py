"""What each side imports: ranks stay free of display code; the kernel of torch until needed."""

import subprocess
import sys


def _imported(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_rank_side_imports_no_display_code():
    mods = _imported(
        "import notebook_dist.runtime.cell, notebook_dist.runtime.bootstrap, notebook_dist.runtime.engine"
    )
    assert not {
        m for m in mods if m.startswith(("ipywidgets", "IPython.display", "IPython.core.display"))
    }
    assert "notebook_dist.magics" not in mods


def test_package_import_is_light():
    mods = _imported("import notebook_dist")
    assert "torch" not in mods and "ipyparallel" not in mods and "IPython" not in mods


def test_magics_do_not_import_torch_in_the_kernel():
    mods = _imported("import notebook_dist.magics.magics")
    assert "torch" not in mods
