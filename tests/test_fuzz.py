"""Fuzzed magic lines: every argument line gives a clear error (UsageError or one of
ours, shown without internal frames) or a correct run, never a traceback from inside
notebook_dist, and the cluster stays usable.

Lines are built from each magic's own options and values that sit on the edges (empty,
negative, huge, nan, quotes, unicode), mixed with arbitrary text. Examples are
derandomised so CI is repeatable; FUZZ_RANDOM=1 FUZZ_EXAMPLES=1000 searches further.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)

EDGE = [
    "",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "99999999999999999999",
    "1e309",
    "nan",
    "inf",
    "-inf",
    "0.0",
    "all",
    "0,1",
    "1-0",
    "0-1",
    "1,,2",
    "0-",
    "-",
    "--",
    "'",
    '"',
    "\\",
    "'a b'",
    "x",
    "_",
    "x.y",
    "1x",
    "é",
    "名",
    "\x00",
    "$HOME",
    "*",
    "gloo",
    "nccl",
    "auto",
    "mpi",
    "on",
    "off",
    "show",
    "stop",
    "65536",
    "65535",
    "22",
    "-n",
    "-h",
    "--help",
    "nd.rank",
    "t.sum()",
    "(",
    "1+",
    "None",
    "[1,2]",
    "{}",
    "🙂",
    "\t",
    "a" * 300,
]

# each magic's options, with values that should work and values on the edges
RANKS = ["all", "0", "1", "0,1", "0-1", "1-0", "2", "-1", "0,0"]
SECONDS = ["5", "0.5", "0", "-1", "nan", "inf", "1e-9"]
OPTIONS: dict[str, dict[str, list[str]]] = {
    "dist_init": {
        "-n": ["2", "1", "0", "-1", "3", "99999"],
        "--backend": ["gloo", "auto", "nccl", "mpi", "GLOO"],
        "--gpus": ["0", "0,1", ",", "a"],
        "--timeout": SECONDS,
        "--hang-after": SECONDS,
        "--port": ["0", "1", "65535", "65536", "29500", "abc"],
        "--profile": ["nosuch", "default", ""],
        "--cluster-id": ["nope", ""],
        "--network": [""],
        "--launcher": ["local", "mpi", "ssh", "slurm", "nope"],
        "--hosts": ["node1,node2", "a:2,b:2", "a:0", "a,a", "a:2,b", ":", "-x", "u@h"],
        "--ssh": ["'-o Port=2222'", "'-i key'", '"\'"'],
    },
    "dist_push": {"--ranks": RANKS},
    "dist_pull": {"--ranks": RANKS},
    "dist_stacks": {"--ranks": RANKS},
    "dist_compare": {"--ranks": RANKS, "--atol": SECONDS, "--rtol": SECONDS},
    "dist_inspect": {"--ranks": RANKS},
    "dist_debug": {"--rank": ["0", "1", "5", "-1"], "--frame": ["0", "1", "99", "-3"]},
    "dist_export": {"--cells": ["1-3", "3,1", "x", "", "0", "1-"]},
    "dist_restart": {"--replay": [""]},
    "dist_status": {},
    "dist_shutdown": {},
    "dist_diagnose": {},
    "autodist": {},
    "distributed": {
        "--ranks": RANKS,
        "--gather": ["y", "z", "y z", "1x", "kept_value", "_", "class", "_i3"],
        "--hang-after": SECONDS,
        "--on-hang": ["show", "stop", "never"],
        "--no-dashboard": [""],
    },
    "rank": {},
}
EXPRESSIONS = ["nd.rank", "torch.ones(2) * nd.rank", "nd.rank +", "undefined_name", "(1,"]
POSITIONAL: dict[str, list[str]] = {
    "dist_push": ["kept_value", "undefined_name", "ip"],
    "dist_pull": ["y", "kept_value", "undefined_name"],
    "dist_compare": EXPRESSIONS,
    "dist_inspect": EXPRESSIONS,
    "dist_debug": EXPRESSIONS,
    "dist_export": ["out.py", "sub/dir/out.py", ".", "/nonexistent/dir/out.py", "out"],
    "autodist": ["on", "off", "ON"],
    "rank": RANKS,
}


def lines(magic: str):
    """Argument lines: mostly the magic's own options and values, some arbitrary text."""
    options = OPTIONS[magic]
    choices = [st.sampled_from(POSITIONAL.get(magic, []) + EDGE), st.text(max_size=8)]
    if options:
        option = st.sampled_from(sorted(options)).flatmap(
            lambda o: st.sampled_from(options[o] + EDGE[:12]).map(lambda v: f"{o} {v}".strip())
        )
        choices = [option, option, option, option, *choices]
    return st.lists(st.one_of(*choices), max_size=4).map(" ".join)


def _check(outcome, line: str, seen: dict[str, int]):
    """The outcome of running a magic line: nothing raised, or a clear error."""
    from IPython.core.error import UsageError

    from notebook_dist.errors import NotebookDistError

    kind = "ran" if outcome is None else type(outcome).__name__
    seen[kind] = seen.get(kind, 0) + 1
    if outcome is None or isinstance(outcome, (UsageError, NotebookDistError)):
        return
    raise AssertionError(f"{line!r} raised {type(outcome).__name__}: {outcome}") from outcome


def _report(magic: str, seen: dict[str, int]) -> None:
    print(f"\nfuzz %{magic}: {sum(seen.values())} lines: {seen}")
    assert sum(seen.values()) >= EXAMPLES // 2, seen
    assert seen.get("UsageError"), f"no line was refused: the fuzzing missed the parser ({seen})"


@pytest.fixture
def guarded(live, ip, tmp_path, monkeypatch):
    """Run magics whose valid lines would start, stop or replace the cluster, without doing it.

    The starting/stopping calls are replaced at their boundary (parsing, validation and
    pre-flight all run for real); a line that reaches the boundary is a correct run.
    """
    from IPython.utils.capture import capture_output

    from notebook_dist import session

    reached = []
    monkeypatch.setattr(
        session.Session, "_start", lambda self, c: reached.append(("start", c)) or ["started"]
    )
    monkeypatch.setattr(
        session.Session, "shutdown", lambda self: reached.append(("shutdown",)) or "stopped"
    )
    monkeypatch.setattr(type(live), "restarted", lambda self: reached.append("restart") or self)
    monkeypatch.setattr(type(live), "replay", lambda self, cells, **kw: len(cells))
    monkeypatch.chdir(tmp_path)  # %dist_export writes here
    names_before = set(ip.user_ns)
    ip.user_ns["kept_value"] = 1
    with capture_output():  # a cell to export, and a failed one to %dist_debug
        ip.run_cell("%%distributed\ny = nd.rank", store_history=True)
        ip.run_cell(
            "%%distributed\nif nd.rank == 1:\n    raise ValueError('fuzz')", store_history=True
        )
    yield reached
    ip.run_line_magic("autodist", "off")
    for name in set(ip.user_ns) - names_before:  # what --gather and %dist_pull bound
        del ip.user_ns[name]
    for name in ("_", "__", "___"):
        assert ip.user_ns[name] is getattr(ip.displayhook, name), f"{name} was rebound"
    assert session.current() is live
    assert dict(live.run("nd.rank").values) == {0: 0, 1: 1}, "the cluster must stay usable"


def _run_line(ip, magic: str, line: str):
    from IPython.utils.capture import capture_output

    with capture_output():
        try:
            ip.run_line_magic(magic, line)
        except BaseException as exc:  # noqa: BLE001 - the property is about what escapes
            return exc
    return None


def _run_cell(ip, magic: str, line: str, body: str):
    from IPython.utils.capture import capture_output

    with capture_output():
        try:
            ip.run_cell_magic(magic, line, body)
        except BaseException as exc:  # noqa: BLE001
            return exc
    return None


LINE_MAGICS = [m for m in OPTIONS if m not in ("distributed", "rank")]


@pytest.mark.parametrize("magic", LINE_MAGICS)
def test_line_magic_arguments_fuzzed(magic, ip, guarded):
    seen: dict[str, int] = {}

    @SETTINGS
    @given(line=lines(magic))
    def fuzz(line):
        _check(_run_line(ip, magic, line), line, seen)

    fuzz()
    _report(magic, seen)


@pytest.mark.parametrize("magic", ["distributed", "rank"])
def test_cell_magic_lines_fuzzed(magic, ip, guarded):
    seen: dict[str, int] = {}

    @SETTINGS
    @given(line=lines(magic))
    def fuzz(line):
        _check(_run_cell(ip, magic, line, "y = z = nd.rank\nnd.rank"), line, seen)

    fuzz()
    _report(magic, seen)
    assert seen.get("ran"), f"no line ran: the fuzzing never reached the ranks ({seen})"
