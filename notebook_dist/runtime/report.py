"""``nd.report(step=..., loss=..., **metrics)``: feed the dashboard from inside a cell."""

from __future__ import annotations

import numbers
import time
from typing import Any

from .state import STATE

MAX_POINTS = 256
_NOT_CHARTED = frozenset(("step", "total", "samples"))


def report(**metrics: Any) -> None:
    """Record metrics for this rank; the dashboard shows the latest values and a chart.

    ``step`` is the x axis (default: the number of reports so far), ``total`` makes a
    progress bar, ``samples`` (per report) gives throughput. Cheap enough to call every
    step (about a microsecond): it only updates a dict and appends to the charts' lists;
    the agent thread sends them at 2 Hz.
    """
    state = STATE
    state.reports += 1
    step = metrics.get("step", state.reports)
    latest = state.metrics
    latest.update(metrics)
    latest["step"] = step
    latest["_time"] = time.time()
    samples = metrics.get("samples")
    if samples is not None:
        latest["_samples_total"] = latest.get("_samples_total", 0) + samples
    charts = state.series
    for key, value in metrics.items():
        kind = type(value)
        if key in _NOT_CHARTED or not (
            kind is float or kind is int or isinstance(value, numbers.Real)
        ):
            continue
        series = charts.get(key)
        if series is None:
            series = charts[key] = []
        series.append((step, value))  # made floats when sent (agent.snapshot)
        if len(series) > MAX_POINTS:  # keep the whole run's shape in bounded space
            del series[1::2]  # (the first and the latest point stay)
