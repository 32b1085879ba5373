"""Paired statistics for comparing two evaluations of the same prompts: a seeded percentile bootstrap of a
mean difference, and McNemar's exact test on per-prompt pass/fail verdicts.

Both work prompt by prompt (the unit that was sampled from the task distribution), so a prompt that both
runs find hard counts once, and the interval reflects how much the verdict depends on which prompts
happened to be in the dataset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gym_bridge.failures.errors import SettingError

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 10_000
_CHUNK = 1_000
"""Resamples drawn at once: bounds memory to ``_CHUNK * prompts`` counts."""


@dataclass(frozen=True)
class McNemarResult:
    """Two evaluations of the same problems compared pairwise: which verdicts changed, and how likely by chance."""

    n: int
    wrong_to_right: int
    right_to_wrong: int
    p_value: float


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> McNemarResult:
    """McNemar's exact test: two-sided binomial p of the discordant pairs under "no change" (p = 1/2).

    Raises:
        SettingError: the two sequences differ in length (a ``ValueError``).
    """
    if len(before) != len(after):
        raise SettingError(f"paired verdicts differ in length: {len(before)} before, {len(after)} after")
    fixed = sum(not b and a for b, a in zip(before, after, strict=True))
    broken = sum(b and not a for b, a in zip(before, after, strict=True))
    n = fixed + broken
    tail = sum(math.comb(n, k) for k in range(min(fixed, broken) + 1)) / 2**n
    return McNemarResult(len(before), fixed, broken, min(1.0, 2 * tail))


@dataclass(frozen=True)
class Interval:
    """A mean difference and its percentile bootstrap interval at ``level`` (e.g. 0.95)."""

    estimate: float
    low: float
    high: float
    level: float

    def as_dict(self) -> dict[str, float]:
        return {"diff": self.estimate, "low": self.low, "high": self.high}


def paired_bootstrap(
    differences: np.ndarray,
    *,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> list[Interval]:
    """Percentile bootstrap intervals of the mean of each row of ``differences`` (metrics x prompts).

    Every resample draws prompts with replacement, the same prompts for every metric (one paired resample),
    from ``numpy.random.default_rng(seed)``: the same input and seed give the same intervals. The interval is
    the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (linear interpolation) of the resampled means,
    as ``scipy.stats.bootstrap(..., method="percentile")`` computes them.

    Raises:
        SettingError: ``level`` not in (0, 1), ``resamples`` < 1, or no prompts (a ``ValueError``).
    """
    if not 0.0 < level < 1.0:
        raise SettingError(f"the confidence level must be in (0, 1), got {level}")
    if resamples < 1:
        raise SettingError(f"resamples must be >= 1, got {resamples}")
    data = np.atleast_2d(np.asarray(differences, dtype=np.float64))
    metrics, n = data.shape
    if n == 0:
        raise SettingError("no prompts to resample")
    rng = np.random.default_rng(seed)
    means = np.empty((resamples, metrics))
    offsets = None
    for start in range(0, resamples, _CHUNK):
        size = min(_CHUNK, resamples - start)
        picks = rng.integers(0, n, size=(size, n))
        if offsets is None or len(offsets) != size:
            offsets = (np.arange(size) * n)[:, None]
        counts = np.bincount((picks + offsets).ravel(), minlength=size * n).reshape(size, n)
        means[start : start + size] = counts @ data.T / n
    lows, highs = np.quantile(means, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return [Interval(float(data[i].mean()), float(lows[i]), float(highs[i]), level) for i in range(metrics)]
