"""The hang doctor's rules: one small function per hang class, tried in order.

Each rule reads the :class:`~notebook_dist.doctor.facts.Facts` of a cell and returns a
verdict or nothing; :func:`notebook_dist.doctor.diagnose` takes the first verdict, so the
order below goes from the most specific cause to the most general. A new hang class is
one new rule (``@rule("ND...", "what it finds")`` in the module of its family) and its
unit tests in ``tests/test_doctor_unit.py``; the property test there keeps every
verdict consistent with the table it sits under.
"""

from __future__ import annotations

from . import collectives, debugger, ended, fallback, library, p2p, slow
from .base import Rule

RULES: list[Rule] = [
    *debugger.RULES,  # ND0xx: a rank in the debugger is its user's turn, never a hang
    *ended.RULES,  # ND1xx: a rank died or raised
    *p2p.RULES,  # ND2xx: point-to-point
    *collectives.RULES,  # ND3xx: the tracked collectives diverge
    *library.RULES,  # ND4xx: collectives inside library calls
    *slow.RULES,  # ND5xx: uneven data, busy ranks, ranks that finished
    *fallback.RULES,  # ND6xx-8xx: nobody missing, no collective, unexplained
]

__all__ = ["RULES", "Rule"]
