"""Summary statistics for rollout metrics, under NeMo-RL's key names.

One deliberate difference from NeMo-RL's ``calculate_single_metric``: NeMo-RL
divides the sum by ``batch_size``, so a metric reported by only some samples
(a per-agent metric, say) has its mean biased toward zero. Here the mean is over
the values given, ``sum(values) / len(values)``. ``batch_size`` is accepted only
to check that no more values than samples were passed; it emits no extra key, so
metric key sets match NeMo-RL's. Histograms are plain lists of floats (no wandb).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def calculate_single_metric(values: Iterable[Any], key: str, batch_size: int | None = None) -> dict[str, Any]:
    """``{key}/mean``, ``/max``, ``/min``, ``/median``, ``/stddev`` and ``/histogram``.

    The mean divides by ``len(values)``, not by ``batch_size`` as NeMo-RL does.
    ``/stddev`` is the sample standard deviation: NaN for fewer than two values,
    0.0 for identical values. ``/histogram`` is the list of values as floats.
    ``batch_size``, when given, must be at least ``len(values)``; it changes nothing else.

    Raises:
        TypeError: ``key`` is not a string (NeMo-RL's order was ``values, batch_size, key``).
        ValueError: ``values`` is empty, or there are more values than ``batch_size``.
    """
    if not isinstance(key, str):
        raise TypeError(
            f"key must be a str, got {key!r}; the signature is calculate_single_metric(values, key, batch_size=None)"
        )
    floats = [float(v) for v in values]
    if not floats:
        raise ValueError(f"metric {key!r} has no values to summarise")
    if batch_size is not None and len(floats) > batch_size:
        raise ValueError(f"metric {key!r} has {len(floats)} values for a batch of {batch_size}")
    return {
        f"{key}/mean": math.fsum(floats) / len(floats),
        f"{key}/max": max(floats),
        f"{key}/min": min(floats),
        f"{key}/median": float(statistics.median(floats)),
        f"{key}/stddev": statistics.stdev(floats) if len(floats) >= 2 else math.nan,
        f"{key}/histogram": floats,
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


def summarize(
    values: Iterable[Any], key: str, percentiles: Sequence[float] = (95, 99), batch_size: int | None = None
) -> dict[str, Any]:
    """:func:`calculate_single_metric` plus ``{key}/p<P>`` (via :func:`pct`) for each percentile."""
    floats = [float(v) for v in values]
    out = calculate_single_metric(floats, key, batch_size)
    for p in percentiles:
        out[f"{key}/p{p:g}"] = pct(floats, p)
    return out
