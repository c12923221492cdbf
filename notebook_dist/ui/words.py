"""How a rank's row is said, in each form of the dashboard (text, HTML, compact)."""

from __future__ import annotations


def fmt_metric(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def progress_text(step, total) -> str:
    if step is None:
        return "-"
    if total:
        return f"{step:g}/{total:g}"
    return f"{step:g}"


def healed_text(row) -> str:
    """' (healed)', ' (healed 3x)': a rank replaced by a fresh engine, said beside its state."""
    if not row.healed:
        return ""
    return " (healed)" if row.healed == 1 else f" (healed {row.healed}x)"
