"""Summary statistics for rollout metrics: NeMo-RL's ``calculate_single_metric`` and ``pct``, same keys and order.

``calculate_single_metric(values, batch_size, key)`` divides the sum by ``batch_size``,
as NeMo-RL does: a metric that only some samples report (a per-agent field, say) reads
as the mean over the batch. Histograms are plain lists of floats (no wandb needed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gym_bridge.failures.errors import SettingError

if TYPE_CHECKING:
    from gym_bridge.types import LLMMessageLogType

type MetricValue = float | list[float]
"""One summary metric: a number (an int stays an int), or the ``/histogram`` list."""


def calculate_single_metric(values: Sequence[float], batch_size: int, key_name: str) -> dict[str, MetricValue]:
    """``{key_name}/mean`` (sum over ``batch_size``), ``/max``, ``/min``, ``/median``, ``/stddev``, ``/histogram``.

    NeMo-RL's function: the values keep their type (an int metric's max is an int), ``/stddev`` is the
    sample standard deviation (NaN for one value) and ``/histogram`` the list of values.
    """
    values = list(values)
    return {
        f"{key_name}/mean": sum(values) / batch_size,
        f"{key_name}/max": max(values),
        f"{key_name}/min": min(values),
        f"{key_name}/median": statistics.median(values),
        f"{key_name}/stddev": statistics.stdev(values) if len(values) > 1 else math.nan,
        f"{key_name}/histogram": values,
    }


def pct(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile without interpolation: sorted value at ``min(int(n*p/100), n-1)``.

    Empty ``values`` give 0.0. The p50 of an even count is the upper middle value.
    """
    if not 0 <= p <= 100:
        raise SettingError(f"percentile must be within [0, 100], got {p}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return 0.0
    n = len(ordered)
    return ordered[min(int(n * p / 100), n - 1)]


def summarize(
    values: Iterable[float], key_name: str, percentiles: Sequence[float] = (95, 99)
) -> dict[str, MetricValue]:
    """:func:`calculate_single_metric` over all ``values`` plus ``{key_name}/p<P>`` for each percentile."""
    values = list(values)
    out = calculate_single_metric(values, len(values), key_name)
    for p in percentiles:
        out[f"{key_name}/p{p:g}"] = pct(values, p)
    return out


@dataclass(frozen=True)
class TokenCounts:
    """A message log's tokens: ``prompt`` (every message the model did not generate: chat template, tool
    results) and ``generated`` (every model call's output)."""

    prompt: int
    generated: int

    @property
    def total(self) -> int:
        return self.prompt + self.generated


def token_counts(message_log: LLMMessageLogType) -> TokenCounts:
    """The one place a message log's prompt and generated tokens are counted (metrics, eval records, truncation)."""
    prompt = generated = 0
    for message in message_log:
        count = int(message["token_ids"].numel())
        if message["role"] == "assistant":
            generated += count
        else:
            prompt += count
    return TokenCounts(prompt=prompt, generated=generated)
