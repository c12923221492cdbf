"""``nd.report(step=..., loss=..., **metrics)``: feed the dashboard from inside a cell."""

from __future__ import annotations

import numbers
import time
from typing import Any

from .state import STATE

MAX_POINTS = 256


def report(**metrics: Any) -> None:
    """Record metrics for this rank; the dashboard shows the latest values and a chart.

    ``step`` is the x axis (default: the number of reports so far), ``total`` makes a
    progress bar, ``samples`` (per report) gives throughput. Cheap enough to call every
    step: it only updates a dict; the agent thread sends it at 2 Hz.
    """
    STATE.reports += 1
    step = metrics.get("step", STATE.reports)
    STATE.metrics.update(metrics)
    STATE.metrics["step"] = step
    STATE.metrics["_time"] = time.time()
    if "samples" in metrics:
        STATE.metrics["_samples_total"] = (
            STATE.metrics.get("_samples_total", 0) + metrics["samples"]
        )
    for key, value in metrics.items():
        if key in ("step", "total", "samples") or not isinstance(value, numbers.Real):
            continue
        series = STATE.series.setdefault(key, [])
        series.append((float(step), float(value)))
        if len(series) > MAX_POINTS:  # keep the whole run's shape in bounded space
            del series[::2]
