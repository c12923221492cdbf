"""What each side imports: ranks stay free of display code; the kernel of torch until needed;
the rank runtime in one direction (bootstrap -> agent -> recover -> group -> state), no cycle."""

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


RUNTIME_ORDER = ["bootstrap", "agent", "recover", "group", "state"]  # each uses only those after it


def _runtime_imports() -> dict[str, set[str]]:
    """Which runtime modules each runtime module imports (at the top or inside a function)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "notebook_dist" / "runtime"
    names = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        edges = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:  # from .state import STATE
                    edges.add(node.module.split(".")[0])
                else:  # from . import group, recover
                    edges.update(a.name for a in node.names)
        graph[name] = edges & names
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in seen and (found := visit(nxt, [*path, node])):
                return found
        seen[node] = 2
        return None

    for node in sorted(graph):
        if node not in seen and (found := visit(node, [])):
            return found
    return None


def test_the_rank_runtime_has_a_direction():
    graph = _runtime_imports()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    for i, low in enumerate(RUNTIME_ORDER):
        upward = graph[low] & set(RUNTIME_ORDER[:i])
        assert not upward, f"runtime/{low}.py imports {upward}, above it"
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the check itself sees one
