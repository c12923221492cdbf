"""The README's two set-up commands, and .ci/run running the test one verbatim."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_exactly_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert cmds[0].endswith("python -m notebook_dist.demo")
    assert cmds[1].endswith("python -m pytest")
    assert all("-c constraints.txt" in c for c in cmds)
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in ci
