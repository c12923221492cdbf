"""Options that carry a command line of their own (``--ssh "..."``, ``--args "..."``)."""

from __future__ import annotations

import shlex


def split_quoted(text: str | None) -> list[str]:
    """``"-i key -o Port=2222"`` as words, as a shell splits them. IPython's argument parser
    keeps the quotes around a quoted value: one word that is itself quoted is split again.
    Raises ValueError for an unclosed quote."""
    if not text:
        return []
    words = shlex.split(text)
    if len(words) == 1 and text.strip()[:1] in ("'", '"'):
        words = shlex.split(words[0])
    return words
