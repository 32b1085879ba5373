"""Paired statistics for comparing two evaluations of the same prompts: a seeded percentile bootstrap of a
mean difference, and McNemar's exact test on per-prompt pass/fail verdicts.

Both work prompt by prompt (the unit that was sampled from the task distribution), so a prompt that both
runs find hard counts once, and the interval reflects how much the verdict depends on which prompts
happened to be in the dataset. Both scale to hundreds of thousands of prompts: McNemar's tail is summed in
log space (time linear in the discordant pairs), and the bootstrap draws how often each distinct prompt
outcome is picked (a multinomial) instead of every pick. When more than 4,096 outcomes are distinct
(continuous rewards) it draws the picks in chunks of bounded memory, unless they would number more than
:data:`_EXACT_CELLS` (at 10,000 resamples: over 2,000 prompts, so every such run): then the percentile interval
comes from the Cornish-Fisher expansion of the bootstrap distribution instead of from resampling it. The
resampled mean has mean ``m``, sd ``s / sqrt(n)``, skewness ``g / sqrt(n)`` and excess kurtosis ``k / n`` from the
sample's own moments, and at such ``n`` the expansion is closer to the ideal bootstrap's quantiles than 10,000
resamples are (``Interval.method`` says which was used).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gym_bridge.failures.errors import SettingError

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 10_000
MIN_PAIRED_PROMPTS = 10
"""Below this many paired prompts a percentile bootstrap is not an interval (3 prompts, all fixed, give
``[+1, +1]`` while McNemar's exact p is 0.25): callers claim no difference and make no gate decision."""
_CHUNK_CELLS = 4_000_000
"""Picks drawn at once on the fallback path (resamples x prompts): about 32 MB of int64, whatever the size."""
_MAX_DISTINCT = 4_096
"""Up to this many distinct prompt outcomes the bootstrap draws counts per outcome (a multinomial)."""
_EXACT_CELLS = 20_000_000
"""Beyond this many picks (resamples x prompts) with mostly distinct outcomes, the Cornish-Fisher expansion."""
RESAMPLED = "percentile bootstrap"
EXPANDED = "percentile bootstrap, Cornish-Fisher expansion"


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
    was = np.asarray(before, dtype=bool)
    now = np.asarray(after, dtype=bool)
    fixed = int(np.count_nonzero(now & ~was))
    broken = int(np.count_nonzero(was & ~now))
    return McNemarResult(len(before), fixed, broken, binomial_two_sided_half(min(fixed, broken), fixed + broken))


def binomial_two_sided_half(k: int, n: int) -> float:
    """Two-sided exact p of ``k`` (the smaller count) of ``n`` under Binomial(n, 1/2), summed in log space.

    ``log C(n, j)`` grows by ``log((n - j + 1) / j)`` per step, so the tail takes ``k`` steps and no big integers.
    """
    if n == 0:
        return 1.0
    steps = np.arange(1, k + 1, dtype=np.float64)
    log_terms = np.concatenate(([0.0], np.cumsum(np.log(n - steps + 1) - np.log(steps))))
    top = float(log_terms.max())
    log_tail = top + math.log(math.fsum(np.exp(log_terms - top).tolist())) - n * math.log(2.0)
    return min(1.0, 2.0 * math.exp(log_tail))


@dataclass(frozen=True)
class Interval:
    """A mean difference and its percentile bootstrap interval at ``level`` (e.g. 0.95)."""

    estimate: float
    low: float
    high: float
    level: float
    method: str = RESAMPLED
    """:data:`RESAMPLED`, or :data:`EXPANDED` for many distinct outcomes at scale (see the module docstring)."""

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
    as ``scipy.stats.bootstrap(..., method="percentile")`` computes them. Memory stays bounded whatever the
    number of prompts (see the module docstring).

    Raises:
        SettingError: ``level`` not in (0, 1), ``resamples`` < 1, non-finite differences, or no prompts
            (a ``ValueError``).
    """
    if not 0.0 < level < 1.0:
        raise SettingError(f"the confidence level must be in (0, 1), got {level}")
    if resamples < 1:
        raise SettingError(f"resamples must be >= 1, got {resamples}")
    data = np.atleast_2d(np.asarray(differences, dtype=np.float64))
    n = data.shape[1]
    if n == 0:
        raise SettingError("no prompts to resample")
    if not np.isfinite(data).all():
        raise SettingError("the differences to resample must be finite numbers")
    rng = np.random.default_rng(seed)
    outcomes, inverse = np.unique(data.T, axis=0, return_inverse=True)
    if len(outcomes) <= _MAX_DISTINCT:
        means = _multinomial_means(outcomes, np.bincount(inverse.ravel(), minlength=len(outcomes)), resamples, rng)
    elif n * resamples > _EXACT_CELLS:
        return [cornish_fisher_interval(row, level) for row in data]
    else:
        means = _chunked_means(data, resamples, rng)
    lows, highs = np.quantile(means, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return [Interval(float(data[i].mean()), float(lows[i]), float(highs[i]), level) for i in range(data.shape[0])]


def cornish_fisher_interval(values: np.ndarray, level: float) -> Interval:
    """The ideal percentile bootstrap interval of the mean of ``values``, from the Cornish-Fisher expansion of
    the resampled mean's distribution (its moments follow from the sample's: see the module docstring)."""
    n = len(values)
    mean = float(values.mean())
    centred = values - mean
    variance = float(np.mean(centred**2))
    if variance == 0.0:
        return Interval(mean, mean, mean, level, EXPANDED)
    sd = math.sqrt(variance)
    skew = float(np.mean(centred**3)) / sd**3 / math.sqrt(n)
    kurtosis = (float(np.mean(centred**4)) / variance**2 - 3.0) / n
    low, high = (
        mean + sd / math.sqrt(n) * _cornish_fisher(z, skew, kurtosis)
        for z in (_normal_quantile((1 - level) / 2), _normal_quantile((1 + level) / 2))
    )
    return Interval(mean, low, high, level, EXPANDED)


def _cornish_fisher(z: float, skew: float, kurtosis: float) -> float:
    """The standardised quantile of a distribution with this skewness and excess kurtosis, at normal quantile z."""
    return z + (z * z - 1) * skew / 6 + (z**3 - 3 * z) * kurtosis / 24 - (2 * z**3 - 5 * z) * skew * skew / 36


def _normal_quantile(p: float) -> float:
    """The standard normal quantile (``statistics.NormalDist``: exact to double precision)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


def _multinomial_means(
    outcomes: np.ndarray, counts: np.ndarray, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """Resampled means when prompts share few outcomes: how often each outcome is drawn is Multinomial(n, freq)."""
    n = int(counts.sum())
    picked = rng.multinomial(n, counts / n, size=resamples)
    means: np.ndarray = picked @ outcomes / n
    return means


def _chunked_means(data: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Resampled means from explicit picks, a bounded number of cells at a time (resamples x prompts)."""
    metrics, n = data.shape
    chunk = max(1, _CHUNK_CELLS // n)
    means = np.empty((resamples, metrics))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        picks = rng.integers(0, n, size=(size, n))
        picks += (np.arange(size) * n)[:, None]
        counts = np.bincount(picks.ravel(), minlength=size * n).reshape(size, n)
        means[start : start + size] = counts @ data.T / n
    return means
