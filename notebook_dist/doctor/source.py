"""Reading the running cell's source: the rank-dependent ``if`` or loop around a line."""

from __future__ import annotations

import ast

RANK_WORDS = ("rank", "is_main", "local_rank")


def _enclosing(
    source: str | None, line: int | None, first_line: int, header
) -> tuple[int, str] | None:
    """The innermost statement around ``line`` for which ``header(node)`` gives a text:
    (its first line in the cell, that text)."""
    if not source or line is None:
        return None
    body = "\n".join(source.splitlines()[first_line - 1 :])
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return None
    found = None
    for node in ast.walk(tree):
        said = header(node)
        if said is None:
            continue
        start = node.lineno + first_line - 1
        end = (node.end_lineno or node.lineno) + first_line - 1
        if start < line <= end and (found is None or start > found[0]):
            found = (start, said)
    return found


def _ranked(text: str) -> bool:
    return any(w in text for w in RANK_WORDS)


def _rank_if(node) -> str | None:
    if isinstance(node, ast.If) and _ranked(test := ast.unparse(node.test)):
        return test
    return None


def _rank_loop(node) -> str | None:
    if isinstance(node, ast.For) and _ranked(ast.unparse(node.iter)):
        return f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
    if isinstance(node, ast.While) and _ranked(test := ast.unparse(node.test)):
        return f"while {test}"
    return None


def rank_condition(
    source: str | None, line: int | None, first_line: int = 1
) -> tuple[int, str] | None:
    """If ``line`` sits inside an ``if`` whose test mentions the rank: (if line, test text)."""
    return _enclosing(source, line, first_line, _rank_if)


def rank_loop(source: str | None, line: int | None, first_line: int = 1) -> tuple[int, str] | None:
    """If ``line`` sits inside a ``for`` or ``while`` loop whose iterable or test mentions the
    rank (so it runs a different number of times on different ranks): (loop line, its
    header without the colon)."""
    return _enclosing(source, line, first_line, _rank_loop)
