"""The magic reference, made from the magics themselves before Sphinx reads its sources:
each magic's usage and options from its ``magic_arguments`` parser, and its description
and example from its docstring. It cannot drift from the code: it is the code."""

from __future__ import annotations

import inspect
from pathlib import Path

FAMILIES = [
    ("Cluster and cells", "notebook_dist.magics.magics", "DistMagics"),
    ("When things go wrong, and moving on", "notebook_dist.magics.debugging", "DebugMagics"),
    ("Where the time goes", "notebook_dist.magics.performance", "PerformanceMagics"),
]


def magic_pages() -> str:
    import importlib

    out = [
        "# Magic reference",
        "",
        "Every magic of `%load_ext notebook_dist`, as `%magic?` shows it in a notebook. Made",
        "from the magics' own argument parsers and docstrings when the site is built.",
        "",
    ]
    for title, module, name in FAMILIES:
        cls = getattr(importlib.import_module(module), name)
        out += [f"## {title}", ""]
        for kind, table in (("line", "%"), ("cell", "%%")):
            for magic, attr in cls.magics.get(kind, {}).items():
                out += _one(table + magic, getattr(cls, attr))
    return "\n".join(out) + "\n"


def _one(name: str, func) -> list[str]:
    parser = getattr(func, "parser", None)
    doc = (parser.description if parser is not None else None) or inspect.getdoc(func) or ""
    lines = [f"(magic-{name.strip('%').replace('_', '-')})=", f"### `{name}`", ""]
    if parser is not None:
        usage = parser.format_usage().replace("usage: ", "", 1).strip()
        usage = inspect.cleandoc(usage.removeprefix("::"))  # IPython's usage is an rst block
        lines += ["```text", usage, "```", ""]
    lines += _described(inspect.cleandoc(doc))
    options = [a for a in getattr(parser, "_actions", []) if a.help and a.help != "==SUPPRESS=="]
    options = [a for a in options if "-h" not in a.option_strings]
    if options:
        lines += ["| option | meaning |", "| --- | --- |"]
        for a in options:
            names = ", ".join(a.option_strings) or a.dest
            if a.metavar or (a.nargs != 0 and a.option_strings):
                names += f" {a.metavar or a.dest.upper()}"
            meaning = a.help.replace("|", "\\|").replace("%%", "%")
            if a.choices:
                meaning += f" (one of: {', '.join(map(str, a.choices))})"
            lines.append(f"| `{names}` | {meaning} |")
        lines.append("")
    return lines


def _described(doc: str) -> list[str]:
    """Paragraphs as text; an ``In [N]:`` transcript (up to a blank line) as code."""
    out: list[str] = []
    block: list[str] | None = None
    for line in doc.splitlines():
        if block is None and line.lstrip().startswith("In ["):
            block = [line]
            continue
        if block is not None:
            if line.strip():
                block.append(line)
                continue
            out += ["```text", *block, "```", ""]
            block = None
            continue
        out.append(line.replace("``", "`"))
    if block:
        out += ["```text", *block, "```"]
    out.append("")
    return out


def write_reference(app) -> None:
    target = Path(app.srcdir) / "reference" / "magics.md"
    text = magic_pages()
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


def setup(app):
    app.connect("builder-inited", write_reference)
    return {"parallel_read_safe": True, "version": "1", "env_version": 1}
