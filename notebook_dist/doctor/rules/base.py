"""What every rule shares: the rule record, its registration, and the verdict maker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..diagnosis import Diagnosis
from ..facts import Facts

__all__ = ["Diagnosis", "Facts", "Rule", "cap", "make", "registrar"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    check: Callable[[Facts], Diagnosis | None]


def registrar(into: list[Rule]):
    """``rule = registrar(RULES)``, then ``@rule("ND201", "what it finds")`` on each check."""

    def rule(code: str, name: str):
        def register(fn: Callable[[Facts], Diagnosis | None]):
            into.append(Rule(code, name, fn))
            return fn

        return register

    return rule


def make(f: Facts, kind: str, verdict: str, culprits, line: int | None = None) -> Diagnosis:
    """A verdict with the table of the same facts."""
    return Diagnosis(kind, verdict, sorted(set(culprits)), f.rows(), line)


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]
