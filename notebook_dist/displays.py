"""A rank's rich outputs (figures, tables, widgets, HTML progress bars) in the notebook,
each said to be that rank's: a small ``rank N`` label above a figure or a table, the text
form prefixed ``[rank N]``, and a display the rank updates in place (a DisplayHandle's
``update``, the Transformers Trainer's bar) updated in the notebook. Outside a kernel (a
script, terminal IPython) each display's text is written as one of the rank's lines."""

from __future__ import annotations

import re
from collections.abc import Callable

from .runtime.streams import UPDATE

#: the text of a display that has no text of its own ("<IPython.core.display.HTML object>")
_NO_TEXT = re.compile(r"^<[\w.]+ object(?: at 0x[0-9a-f]+)?>$")


def in_kernel() -> bool:
    """Whether this process is a notebook's kernel (displays reach a front end)."""
    try:
        from IPython.core.getipython import get_ipython  # (not IPython's lazy __getattr__)
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def cell_request() -> dict | None:
    """The request of the notebook cell this kernel runs now (None outside a kernel)."""
    try:
        from IPython.core.getipython import get_ipython  # (not IPython's lazy __getattr__)
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    get_parent = getattr(kernel, "get_parent", None)
    return get_parent("shell") or None if get_parent is not None else None


class DisplayRelay:
    def __init__(self):
        self._seen: dict[int, int] = {}  # per rank, how many of its outputs were relayed
        self._shown_ids: set[str] = set()  # a rank's displays the notebook shows (by id)

    def relay(self, rank: int, md: dict, put_text: Callable[[int, list[str]], None]) -> None:
        """The outputs ipyparallel collected from ``rank`` (``md["outputs"]``) since the
        last call; outside a kernel, each one's text is given to ``put_text(rank, lines)``
        (given here, not kept: a relay that held its streamer's method would make a cycle,
        and every cell's records would wait for the garbage collector)."""
        outputs = md.get("outputs") or []
        seen = self._seen.get(rank, 0)
        if len(outputs) <= seen:
            return
        self._seen[rank] = len(outputs)
        if not in_kernel():
            for output in outputs[seen:]:
                text = output.get("data", {}).get("text/plain")
                if text and not _NO_TEXT.match(text) and UPDATE not in output.get("metadata", {}):
                    put_text(rank, text.removeprefix(f"[rank {rank}] ").split("\n"))
            return
        for output in outputs[seen:]:
            self._publish(rank, output)

    def _publish(self, rank: int, output: dict) -> None:
        from IPython.display import publish_display_data

        data = dict(output.get("data", {}))
        metadata = dict(output.get("metadata") or {})
        update = metadata.pop(UPDATE, False)
        shown_id = (output.get("transient") or {}).get("display_id")
        transient = {"display_id": f"rank{rank}-{shown_id}"} if shown_id else {}
        if update:  # applied to the display it updates, if the notebook shows it
            if transient and transient["display_id"] in self._shown_ids:
                publish_display_data(data, metadata, transient=transient, update=True)
            return
        label = f"[rank {rank}]"
        if "text/plain" in data and not data["text/plain"].startswith(label):
            data["text/plain"] = f"{label} " + data["text/plain"]
        rich = set(data) - {"text/plain"}
        if rich and not rich <= {"application/vnd.jupyter.widget-view+json"}:
            publish_display_data(  # a label above a figure or a table
                {
                    "text/plain": label,
                    "text/html": f"<div class='nd-rank-label' style='font-size:11px;"
                    f"color:#777'>rank {rank}</div>",
                },
            )
        publish_display_data(data, metadata, transient=transient or None)
        if transient:
            self._shown_ids.add(transient["display_id"])
