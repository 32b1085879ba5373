"""The unbiased pass@k estimator (Chen et al., 2021): ``1 - C(n-c, k) / C(n, k)``."""

from __future__ import annotations

import math

from gym_bridge.failures import SettingError


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from
    ``n`` samples, ``c`` of them correct, is correct.

    Raises:
        SettingError: not ``0 <= c <= n`` or not ``1 <= k <= n`` (a ``ValueError``).
    """
    if not 0 <= c <= n:
        raise SettingError(f"need 0 <= c <= n, got n={n} c={c}")
    if not 1 <= k <= n:
        raise SettingError(f"need 1 <= k <= n, got n={n} k={k}")
    if n - c < k:
        return 1.0
    # The product form of C(n-c, k) / C(n, k): exact enough and no huge integers.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    if ks[-1] != n:
        ks.append(n)
    return ks
