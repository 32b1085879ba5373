"""How a rollout fails: the exception tree, failure classification, deadlines.

Exception tree::

    RolloutFailure                  one attempt at a prompt failed; the retry policy decides
     ├── RolloutInfraFailure        the prompt is fine, the fleet is not: retry, maybe elsewhere
     │    ├── RolloutTimeout        a deadline expired (generation turn, environment step,
     │    │                         NeMo-Gym prompt group)
     │    ├── GenerationUnavailable a generation worker could not serve the request
     │    ├── NoHealthyShards       no generation shard is healthy
     │    ├── EnvironmentUnavailable an environment actor died or is unreachable
     │    └── GymTransportError     NeMo-Gym /run failed in transport (HTTP 5xx/408/429,
     │                              broken stream)
     └── RolloutDataFailure         deterministic and prompt-specific: retrying will not help

    RuntimeError                    terminal for the run; deliberately not RolloutFailure,
     ├── RolloutRedispatchExhausted so per-attempt handlers do not catch them
     └── RolloutStall               the watchdog saw nothing committed within its deadline

Every class takes a single message string, so it pickles across Ray. The
``__cause__`` chain does not survive pickling; the message carries what matters.

:func:`classify_rollout_failure` maps any other exception to :class:`FailureClass`:
an explicit ``RolloutDataFailure`` is DATA; otherwise any infra link in the
``__cause__`` chain makes it INFRA; anything unrecognised is DATA, so unknown bugs
fail loudly instead of being retried.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

__all__ = [
    "EnvironmentUnavailable",
    "FailureClass",
    "GenerationUnavailable",
    "GymTransportError",
    "NoHealthyShards",
    "RolloutDataFailure",
    "RolloutFailure",
    "RolloutInfraFailure",
    "RolloutRedispatchExhausted",
    "RolloutRetryPolicy",
    "RolloutStall",
    "RolloutStats",
    "RolloutTimeout",
    "RolloutTimeouts",
    "classify_environment_failure",
    "classify_generation_failure",
    "classify_rollout_failure",
    "deadline",
    "gather_cancel_siblings",
    "gym_status_failure",
    "http_status_is_infra",
    "typed_gym_failure",
]


class FailureClass(str, Enum):
    INFRA = "infra"
    DATA = "data"


class RolloutFailure(Exception):
    """One failed attempt at a prompt."""


class RolloutInfraFailure(RolloutFailure):
    """The prompt is fine; the infrastructure serving it is not."""


class RolloutTimeout(RolloutInfraFailure):
    """A rollout deadline expired."""


class GenerationUnavailable(RolloutInfraFailure):
    """A generation worker could not serve the request (dead, unreachable, out of memory)."""


class NoHealthyShards(RolloutInfraFailure):
    """No generation shard is healthy enough to take the request."""


class EnvironmentUnavailable(RolloutInfraFailure):
    """An environment actor died or could not be reached."""


class GymTransportError(RolloutInfraFailure):
    """NeMo-Gym's /run failed in transport: an infra HTTP status or a broken stream."""


class RolloutDataFailure(RolloutFailure):
    """A deterministic, prompt-specific failure."""


class RolloutRedispatchExhausted(RuntimeError):
    """Terminal: a prompt spent its infrastructure retry budget."""


class RolloutStall(RuntimeError):
    """Terminal: nothing was committed within the watchdog deadline."""


_MAX_CAUSE_LINKS = 8

_RAY_INFRA_NAMES = (
    "RayActorError",
    "ActorUnavailableError",
    "ActorUnschedulableError",
    "TaskUnschedulableError",
    "WorkerCrashedError",
    "NodeDiedError",
    "LocalRayletDiedError",
    "OwnerDiedError",
    "RpcError",
    "GetTimeoutError",
    "ObjectFetchTimedOutError",
    "ObjectLostError",
    "OutOfMemoryError",
    "ObjectStoreFullError",
    "RaySystemError",
)
_AIOHTTP_INFRA_NAMES = ("ClientConnectionError", "ClientPayloadError")
# httpx's UnsupportedProtocol and LocalProtocolError are our own mistakes, so stay DATA.
_HTTPX_INFRA_NAMES = ("TimeoutException", "NetworkError", "RemoteProtocolError", "ProxyError")
# Recognised by name anywhere in the MRO, for aiohttp errors seen without aiohttp's classes.
_INFRA_CLASS_NAMES = frozenset(
    {
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerConnectionError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
    }
)


def _loaded_types(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    """The named classes of ``module`` if it is already imported, else none.

    An instance of a library's exception can only exist once that library is
    imported, so nothing is imported here (importing Ray alone takes seconds), and
    a name a library version lacks is skipped.
    """
    mod = sys.modules.get(module)
    if mod is None:
        return ()
    return tuple(t for name in names if isinstance(t := getattr(mod, name, None), type))


def http_status_is_infra(status: int) -> bool:
    """Whether an HTTP status means the server side failed: 5xx, 408 or 429."""
    return status >= 500 or status in (408, 429)


def _response_status(exc: BaseException) -> int | None:
    """The HTTP status of an aiohttp ``ClientResponseError`` or httpx ``HTTPStatusError``."""
    response_errors = _loaded_types("aiohttp", ("ClientResponseError",))
    if response_errors and isinstance(exc, response_errors):
        status = getattr(exc, "status", None)
        return status if isinstance(status, int) and not isinstance(status, bool) else None
    status_errors = _loaded_types("httpx", ("HTTPStatusError",))
    if status_errors and isinstance(exc, status_errors):
        return int(exc.response.status_code)  # type: ignore[attr-defined]
    return None


def _link_is_infra(exc: BaseException) -> bool:
    if isinstance(exc, RolloutDataFailure):
        return False
    status = _response_status(exc)
    if status is not None:
        return http_status_is_infra(status)
    infra_types = (
        (RolloutInfraFailure, TimeoutError, ConnectionError)
        + _loaded_types("ray.exceptions", _RAY_INFRA_NAMES)
        + _loaded_types("aiohttp", _AIOHTTP_INFRA_NAMES)
        + _loaded_types("httpx", _HTTPX_INFRA_NAMES)
    )
    if isinstance(exc, infra_types):
        return True
    return any(cls.__name__ in _INFRA_CLASS_NAMES for cls in type(exc).__mro__)


def classify_rollout_failure(exc: BaseException) -> FailureClass:
    """INFRA or DATA for a failed attempt.

    1. A ``RolloutDataFailure`` is DATA, even when caused by an infra error.
    2. INFRA if ``exc`` or any exception in its ``__cause__`` chain (not
       ``__context__``; at most 8 links; cycles end the walk) is infra: a
       ``RolloutInfraFailure``, ``TimeoutError``, ``ConnectionError``, a Ray
       worker/actor/node/object-store error, an aiohttp or httpx connection,
       timeout or payload error, or an HTTP error whose status
       :func:`http_status_is_infra`.
    3. Otherwise DATA: unknown errors are not retried as if the fleet were sick.
    """
    if isinstance(exc, RolloutDataFailure):
        return FailureClass.DATA
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen and len(seen) < _MAX_CAUSE_LINKS:
        if _link_is_infra(link):
            return FailureClass.INFRA
        seen.add(id(link))
        link = link.__cause__
    return FailureClass.DATA


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def typed_gym_failure(exc: BaseException) -> BaseException:
    """A picklable typed failure for an HTTP error from NeMo-Gym's /run; other errors unchanged.

    aiohttp errors carry unpicklable headers, so across the Ray boundary the driver
    would see an opaque error classified DATA. With an int ``status`` (aiohttp) or
    an httpx ``HTTPStatusError``, this returns :class:`GymTransportError` when the
    status is infra and :class:`RolloutDataFailure` otherwise. Raise the result
    ``from None``.
    """
    status = _response_status(exc)
    if status is None:
        raw = getattr(exc, "status", None)
        status = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if status is None:
        return exc
    detail = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return gym_status_failure(status, _short(str(detail)))


def gym_status_failure(status: int, detail: str) -> RolloutFailure:
    """The typed failure for NeMo-Gym's ``/run`` answering HTTP ``status``: infra or data by the status."""
    message = f"NeMo-Gym /run failed with HTTP {status}: {detail}"
    return GymTransportError(message) if http_status_is_infra(status) else RolloutDataFailure(message)


def classify_generation_failure(exc: Exception, prompt_idx: Any, traj_idx: int) -> RolloutFailure:
    """The typed failure for an error raised while generating; raise it ``from exc``.

    Any Ray error is infrastructure here, whatever it wraps: a worker-side error
    (dead engine, CUDA OOM) arrives as a bare ``RayTaskError`` the classifier
    cannot see into, and another shard may serve the request. Infra errors become
    :class:`GenerationUnavailable`. An explicit ``RolloutDataFailure`` (even one
    carried by a Ray error) and anything else unrecognised become
    :class:`RolloutDataFailure`. Both messages name the prompt and trajectory.

    Raises:
        TypeError: ``exc`` is not an ``Exception``; cancellation is never reclassified.
    """
    if not isinstance(exc, Exception):
        raise TypeError(f"{type(exc).__name__} is not a generation failure and must propagate as is")
    detail = f"prompt_idx={prompt_idx} traj_idx={traj_idx}: {type(exc).__name__}: {exc}"
    ray_errors = _loaded_types("ray.exceptions", ("RayError",))
    if not isinstance(exc, RolloutDataFailure) and (
        (ray_errors and isinstance(exc, ray_errors)) or classify_rollout_failure(exc) is FailureClass.INFRA
    ):
        return GenerationUnavailable(f"generation unavailable for {detail}")
    return RolloutDataFailure(f"generation failed for {detail}")


def classify_environment_failure(exc: Exception, prompt_idx: Any, traj_idx: int) -> RolloutFailure:
    """The typed failure for an error raised by an environment step; raise it ``from exc``.

    Unlike generation, an error raised by the environment's own code (a ``RayTaskError``
    wrapping a verifier crash) is about this prompt: DATA. A dead or unreachable
    actor, and anything else the classifier calls infrastructure, is
    :class:`EnvironmentUnavailable`. Both messages name the prompt and trajectory.
    """
    if not isinstance(exc, Exception):
        raise TypeError(f"{type(exc).__name__} is not an environment failure and must propagate as is")
    # A RayTaskError's text is the remote traceback; its .cause is the error the environment raised.
    shown = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
    detail = f"prompt_idx={prompt_idx} traj_idx={traj_idx}: {type(shown).__name__}: {shown}"
    if classify_rollout_failure(exc) is FailureClass.INFRA:
        return EnvironmentUnavailable(f"environment unavailable for {detail}")
    return RolloutDataFailure(f"environment step failed for {detail}")


def _check_seconds(name: str, seconds: float | None) -> None:
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise ValueError(f"{name} must be None or a positive finite number of seconds, got {seconds!r}")


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
    ``max_gym_row_attempts`` times.
    """

    max_infra_attempts: int
    max_data_attempts: int
    max_gym_row_attempts: int
    backoff_base_s: float = 1.0
    max_backoff_s: float = 30.0
    max_skipped_prompts: int = 0
    max_consecutive_dropped_prompts: int = 0

    def __post_init__(self) -> None:
        for name in ("max_infra_attempts", "max_data_attempts", "max_gym_row_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.backoff_base_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    @classmethod
    def single_attempt(cls, **overrides: Any) -> RolloutRetryPolicy:
        """One attempt of everything: a failure propagates (plus any overrides)."""
        return replace(cls(max_infra_attempts=1, max_data_attempts=1, max_gym_row_attempts=1), **overrides)

    def backoff_for(self, attempt: int) -> float:
        """Seconds to wait before infrastructure retry number ``attempt`` (1-based)."""
        return min(self.backoff_base_s * 2 ** (attempt - 1), self.max_backoff_s)


def _bump(counter: dict[str, int], reason: str, by: int = 1) -> None:
    counter[reason] = counter.get(reason, 0) + by


@dataclass
class RolloutStats:
    """Run-wide rollout counters; reasons are exception class names."""

    committed: int = 0
    skipped: int = 0
    redispatches_by_reason: dict[str, int] = field(default_factory=dict)
    data_retries_by_reason: dict[str, int] = field(default_factory=dict)
    data_failures_by_reason: dict[str, int] = field(default_factory=dict)
    infra_drops_by_reason: dict[str, int] = field(default_factory=dict)
    max_consecutive_infra_drops: int = 0
    gym_row_redispatches: int = 0

    def record_redispatch(self, reason: str) -> None:
        _bump(self.redispatches_by_reason, reason)

    def record_data_retry(self, reason: str) -> None:
        _bump(self.data_retries_by_reason, reason)

    def record_data_failure(self, reason: str) -> None:
        _bump(self.data_failures_by_reason, reason)

    def record_infra_drop(self, reason: str, consecutive: int) -> None:
        _bump(self.infra_drops_by_reason, reason)
        self.max_consecutive_infra_drops = max(self.max_consecutive_infra_drops, consecutive)

    def as_metrics(self) -> dict[str, float]:
        """NeMo-RL's ``rollout/*`` metric names, all floats."""
        metrics = {
            "rollout/committed_total": float(self.committed),
            "rollout/skipped_total": float(self.skipped),
            "rollout/redispatch_total": float(sum(self.redispatches_by_reason.values())),
            "rollout/data_retry_total": float(sum(self.data_retries_by_reason.values())),
            "rollout/data_failures_total": float(sum(self.data_failures_by_reason.values())),
            "rollout/gym_row_redispatch_total": float(self.gym_row_redispatches),
            "rollout/infra_drops_total": float(sum(self.infra_drops_by_reason.values())),
            "rollout/max_consecutive_infra_drops": float(self.max_consecutive_infra_drops),
        }
        for prefix, counter in (
            ("rollout/redispatch_total", self.redispatches_by_reason),
            ("rollout/data_retry_total", self.data_retries_by_reason),
            ("rollout/data_failures_total", self.data_failures_by_reason),
            ("rollout/infra_drops_total", self.infra_drops_by_reason),
        ):
            metrics.update({f"{prefix}/{reason}": float(n) for reason, n in sorted(counter.items())})
        return metrics


@asynccontextmanager
async def deadline(seconds: float | None, description: str) -> AsyncIterator[None]:
    """Bound the body by ``seconds``; expiry raises :class:`RolloutTimeout`.

    ``None`` disables the deadline. Only this deadline's own expiry becomes
    ``RolloutTimeout("<description> exceeded <seconds>s")``, chained from the
    ``TimeoutError``; a ``TimeoutError`` raised by the body propagates unchanged,
    and cancellation from outside stays cancellation.
    """
    _check_seconds("seconds", seconds)
    timeout = asyncio.timeout(seconds)
    try:
        async with timeout:
            yield
    except TimeoutError as exc:
        if not timeout.expired():
            raise
        raise RolloutTimeout(f"{description} exceeded {seconds}s") from exc


async def gather_cancel_siblings(*aws: Awaitable[Any]) -> list[Any]:
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
