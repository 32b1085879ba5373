"""Summary statistics for rollout metrics: NeMo-RL's ``calculate_single_metric`` and ``pct``, same keys and order.

``calculate_single_metric(values, batch_size, key)`` divides the sum by ``batch_size``,
as NeMo-RL does: a metric that only some samples report (a per-agent field, say) reads
as the mean over the batch. Histograms are plain lists of floats (no wandb needed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def calculate_single_metric(values: Iterable[Any], batch_size: int, key_name: str) -> dict[str, Any]:
    """``{key_name}/mean`` (sum over ``batch_size``), ``/max``, ``/min``, ``/median``, ``/stddev``, ``/histogram``.

    ``/stddev`` is the sample standard deviation of the values (NaN for one value);
    ``/histogram`` is the list of values as floats.

    Raises:
        TypeError: ``key_name`` is not a string or ``batch_size`` not an int (the order is NeMo-RL's).
        ValueError: ``values`` is empty, or ``batch_size`` is smaller than the number of values.
    """
    if not isinstance(key_name, str):
        raise TypeError(
            f"key_name must be a str, got {key_name!r}; the signature is "
            "calculate_single_metric(values, batch_size, key_name)"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool):
        raise TypeError(f"batch_size must be an int, got {batch_size!r} (metric {key_name!r})")
    floats = [float(v) for v in values]
    if not floats:
        raise ValueError(f"metric {key_name!r} has no values to summarise")
    if batch_size < len(floats):
        raise ValueError(f"metric {key_name!r} has {len(floats)} values for a batch of {batch_size}")
    return {
        f"{key_name}/mean": math.fsum(floats) / batch_size,
        f"{key_name}/max": max(floats),
        f"{key_name}/min": min(floats),
        f"{key_name}/median": float(statistics.median(floats)),
        f"{key_name}/stddev": statistics.stdev(floats) if len(floats) >= 2 else math.nan,
        f"{key_name}/histogram": floats,
    }


def pct(values: Iterable[Any], p: float) -> float:
    """The ``p``-th percentile without interpolation: sorted value at ``min(int(n*p/100), n-1)``.

    Empty ``values`` give 0.0. The p50 of an even count is the upper middle value.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return 0.0
    n = len(ordered)
    return ordered[min(int(n * p / 100), n - 1)]


def summarize(values: Iterable[Any], key_name: str, percentiles: Sequence[float] = (95, 99)) -> dict[str, Any]:
    """:func:`calculate_single_metric` over all ``values`` plus ``{key_name}/p<P>`` for each percentile."""
    floats = [float(v) for v in values]
    out = calculate_single_metric(floats, len(floats), key_name)
    for p in percentiles:
        out[f"{key_name}/p{p:g}"] = pct(floats, p)
    return out
