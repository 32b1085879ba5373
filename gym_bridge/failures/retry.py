"""Retrying and bounding waits: the retry policy, deadlines, backoff, and a gather that cancels siblings."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from gym_bridge.failures.errors import RolloutTimeout, SettingError


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Capped exponential backoff: seconds before retry number ``attempt`` (1-based).

    That is ``min(base * 2**(attempt-1), max)``.
    """
    return float(min(base_s * 2 ** (attempt - 1), max_s))


def _check_seconds(name: str, seconds: float | None) -> None:
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise SettingError(f"{name} must be None or a positive finite number of seconds, got {seconds!r}")


def _check_count(name: str, value: object, minimum: int) -> None:
    """``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise SettingError(f"{name} must be >= {minimum}, got {value}")


def _check_backoff(name: str, value: object) -> None:
    """``value`` is a number of seconds (not a bool), at least 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if value < 0:
        raise SettingError(f"backoff times must be >= 0, got {name}={value}")


@dataclass(frozen=True)
class RolloutTimeouts:
    """Deadlines for the waits inside one rollout; ``None`` waits forever."""

    rollout_s: float | None = None
    """The whole NeMo-Gym prompt group, re-dispatches included."""
    generation_s: float | None = None
    """One native generation turn."""
    env_s: float | None = None
    """One native environment step."""

    def __post_init__(self) -> None:
        for name in ("rollout_s", "generation_s", "env_s"):
            _check_seconds(name, getattr(self, name))


@dataclass(frozen=True)
class RolloutRetryPolicy:
    """How often a prompt is tried again, separately for infrastructure and data failures.

    An infrastructure failure (the fleet) is retried with capped exponential backoff
    up to ``max_infra_attempts``; when that budget is spent the prompt is dropped,
    unless more than ``max_consecutive_dropped_prompts`` prompts in a row were
    dropped, which stops the run. A data failure (this prompt) is retried without
    backoff up to ``max_data_attempts``, then the prompt is skipped, unless the run
    already skipped ``max_skipped_prompts``, which stops the run. Within one Gym
    attempt, rows lost to an infrastructure failure are re-sent up to
    ``max_gym_row_attempts`` times. An ``EndpointConfigError`` (the model endpoint's 4xx)
    is never retried, and stops the run when the first prompts all hit the same one
    (``stop_after_config_failures``).

    This class is the one definition of every retry setting and its default (docs/reliability.md lists
    who reads each). The three attempt budgets have no default, as in NeMo-RL: a caller names them, or
    asks for :meth:`single_attempt`, which is also the policy of every door given none. An invalid value
    raises :class:`~gym_bridge.failures.errors.SettingError` naming the field; a pydantic model takes the
    class as a field type (the eval config's ``retry:`` section) and reports the same errors.
    """

    max_infra_attempts: int
    """Attempts at a prompt failing for infrastructure (timeout, dead worker, transport)."""
    max_data_attempts: int
    """Attempts at a prompt failing for its data; independent of the infrastructure budget."""
    max_gym_row_attempts: int
    """Within one Gym attempt, how often rows lost to an infrastructure failure are sent (1: no re-send)."""
    backoff_base_s: float = 1.0
    """First backoff after an infrastructure failure, doubled for each further one."""
    max_backoff_s: float = 30.0
    """The cap on that backoff."""
    max_skipped_prompts: int = 0
    """Prompts the run may skip after spending their data budget; one more stops it (0: the first one)."""
    max_consecutive_dropped_prompts: int = 0
    """Prompts in a row the run may drop after spending their infrastructure budget; one more stops it."""
    stop_after_config_failures: int = 2
    """The run stops (``RunConfigurationError``) when its first this-many prompts all fail with the
    same ``EndpointConfigError``; 0 turns the rule off."""

    def __post_init__(self) -> None:
        for name in ("max_infra_attempts", "max_data_attempts", "max_gym_row_attempts"):
            _check_count(name, getattr(self, name), 1)
        for name in ("max_skipped_prompts", "max_consecutive_dropped_prompts", "stop_after_config_failures"):
            _check_count(name, getattr(self, name), 0)
        for name in ("backoff_base_s", "max_backoff_s"):
            _check_backoff(name, getattr(self, name))

    @classmethod
    def single_attempt(cls, **overrides: Any) -> RolloutRetryPolicy:
        """One attempt of everything: a failure propagates (plus any overrides)."""
        return replace(cls(max_infra_attempts=1, max_data_attempts=1, max_gym_row_attempts=1), **overrides)

    def backoff_for(self, attempt: int) -> float:
        """Seconds to wait before infrastructure retry number ``attempt`` (1-based)."""
        return backoff_delay(attempt, self.backoff_base_s, self.max_backoff_s)


def deadline_expired(description: str, seconds: float | None) -> RolloutTimeout:
    """The failure a deadline's expiry raises: ``RolloutTimeout("<description> exceeded <seconds>s")``."""
    return RolloutTimeout(f"{description} exceeded {seconds}s")


@asynccontextmanager
async def deadline(
    seconds: float | None, description: str, *, shown_seconds: float | None = None
) -> AsyncIterator[asyncio.Timeout]:
    """Bound the body by ``seconds``; expiry raises :class:`RolloutTimeout`.

    ``None`` disables the deadline. Only this deadline's own expiry becomes
    ``RolloutTimeout("<description> exceeded <seconds>s")``, chained from the
    ``TimeoutError``; a ``TimeoutError`` raised by the body propagates unchanged,
    and cancellation from outside stays cancellation. ``shown_seconds`` is the number the
    message names instead of ``seconds`` (a deadline that resumes with the time left names its whole
    budget). The body gets the ``asyncio.Timeout``, whose ``expired()`` says whether it was this one.
    """
    _check_seconds("seconds", seconds)
    timeout = asyncio.timeout(seconds)
    try:
        async with timeout:
            yield timeout
    except TimeoutError as exc:
        if not timeout.expired():
            raise
        raise deadline_expired(description, seconds if shown_seconds is None else shown_seconds) from exc


async def gather_cancel_siblings[T](*aws: Awaitable[T]) -> list[T]:
    """Run ``aws`` concurrently and return their results in input order.

    Unlike ``asyncio.gather``, the first failure cancels the others and waits for
    them to finish before it propagates with its own type, so a failed prompt
    group stops occupying generation capacity. Cancelling the caller cancels and
    drains every child too.
    """
    not_awaitable = [type(aw).__name__ for aw in aws if not inspect.isawaitable(aw)]
    if not_awaitable:
        for aw in aws:
            if inspect.iscoroutine(aw):
                aw.close()
        raise TypeError(f"gather_cancel_siblings takes awaitables, got {not_awaitable}")
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
