"""Is a failure the fleet's (INFRA: retry, maybe elsewhere) or this prompt's (DATA)?

:func:`classify_rollout_failure` maps any exception to :class:`FailureClass`: an explicit
``RolloutDataFailure`` is DATA; otherwise any infra link in the ``__cause__`` chain makes
it INFRA; anything unrecognised is DATA, so unknown bugs fail loudly instead of being
retried. The other functions turn a raw error into the typed, picklable failure.
"""

from __future__ import annotations

import re
import sys
from enum import StrEnum
from typing import Any

from gym_bridge.failures.errors import (
    EnvironmentUnavailable,
    GenerationUnavailable,
    GymRunError,
    GymTransportError,
    RolloutDataFailure,
    RolloutFailure,
    RolloutInfraFailure,
)


class FailureClass(StrEnum):
    INFRA = "infra"
    DATA = "data"


_MAX_CAUSE_LINKS = 8

# NeMo-Gym 0.7's shared failure vocabulary (nemo_gym/failure_kinds.py): the kinds that say the fleet failed
# (a transport, a sandbox provider, a session, a cancelled or killed process), not the policy or its verifier.
_INFRA_FAILURE_KINDS = frozenset(
    {
        "transport_unreachable",
        "transport_peer_drop",
        "transport_timeout",
        "transport_local_resource",
        "agent_request_failed",
        "agent_timeout",
        "provider_unavailable",
        "provider_quota_exhausted",
        "provider_oom_killed",
        "session_lost",
        "session_expired",
        "cancelled",
        "kill_shaped",
        "shutdown",
    }
)


AGENT_RUN_ERROR = "agent_run_error"
"""Gym's ``_ng_failure_class`` for a ``/run`` a Gym server answered: the rollout ran and broke (data)."""
AGENT_REQUEST_FAILED = "agent_request_failed"
"""Gym's ``_ng_failure_class`` for a ``/run`` with no answer, or a gateway's (infrastructure)."""
GATEWAY_STATUSES = frozenset({429, 502, 503, 504})
"""What something in front of a Gym server answers with; a Gym server answers 500 itself
(``rollout_collection._SERVER_DID_NOT_RUN_STATUSES``)."""
_EXCEPTION_TYPE = re.compile(r"(?P<type>[A-Za-z_][\w.]*)(?:\(|:\s)")
_TRANSPORT_EXCEPTIONS = frozenset(
    {
        "TimeoutError",
        "CancelledError",
        "ConnectionError",
        "ConnectionRefusedError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "MemoryError",
        "ClientConnectorDNSError",
        "ClientConnectorCertificateError",
        "ClientSSLError",
        "ClientResponseError",
        "ConnectTimeout",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
        "ConnectError",
        "ReadError",
        "WriteError",
        "APIConnectionError",
        "APITimeoutError",
    }
)
"""Exception names that say a connection, a timeout, a cancellation or the machine failed, not the server's code
(with :data:`_INFRA_CLASS_NAMES`, and aiohttp's, httpx's and Ray's infrastructure errors by name)."""


def gym_run_failure_class(status: int | None) -> str:
    """Gym's ``_ng_failure_class`` for a ``/run`` that came back without a result (``_agent_request_failure_row``):
    ``agent_run_error`` when a Gym server answered (any status but a gateway's), else ``agent_request_failed``."""
    return AGENT_RUN_ERROR if status is not None and status not in GATEWAY_STATUSES else AGENT_REQUEST_FAILED


def server_code_exception(message: str) -> str | None:
    """The exception type a Gym server's own code raised, read from the innermost message of its 500 (Gym's
    middleware answers ``repr(exc)``; :func:`~gym_bridge.failures.gym_chain.unwrap_gym_error` gives
    ``"<Type>: <arg>"`` or the repr), or None: no exception named, or one that says a connection, a timeout, a
    cancellation or the machine failed rather than the code."""
    match = _EXCEPTION_TYPE.match(message.strip())
    if match is None:
        return None
    name = match["type"].rsplit(".", 1)[-1]
    if not name.endswith(("Error", "Exception")):
        return None
    infra_names = _TRANSPORT_EXCEPTIONS | _INFRA_CLASS_NAMES
    if name in infra_names or name in (*_RAY_INFRA_NAMES, *_AIOHTTP_INFRA_NAMES, *_HTTPX_INFRA_NAMES):
        return None
    return match["type"]


def gym_failure_class_failure(failure_class: str, detail: str) -> RolloutFailure:
    """The typed failure for a ``/run`` result that carries Gym's ``_ng_failure_class`` (a failure row, not a
    rollout): infrastructure for the classes :func:`gym_failure_kind_class` calls so (``agent_request_failed``,
    ``cancelled``, ``kill_shaped``, ...), else :class:`GymRunError`."""
    message = f"Gym's _ng_failure_class {failure_class}: {detail}"
    if gym_failure_kind_class(failure_class) is FailureClass.INFRA:
        return GymTransportError(message)
    return GymRunError(message)


def gym_failure_kind_class(kind: str | None) -> FailureClass | None:
    """INFRA or DATA for a Gym result's ``failure_kind``; None when it names none.

    The verifier's and the agent's own kinds (``judge_*``, ``verifier_error``, ``agent_run_error``) and
    ``session_release_failed`` (measured before the release failed) are DATA; so is an unknown or
    ``<server>:<kind>`` name, as any unrecognised failure is.
    """
    if not kind:
        return None
    return FailureClass.INFRA if kind in _INFRA_FAILURE_KINDS else FailureClass.DATA


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
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return int(status) if status is not None else None
    return None


def _link_is_infra(exc: BaseException) -> bool:
    if isinstance(exc, RolloutDataFailure):
        return False
    status = _response_status(exc)
    if status is not None:
        return http_status_is_infra(status)
    infra_types = (
        RolloutInfraFailure,
        TimeoutError,
        ConnectionError,
        *_loaded_types("ray.exceptions", _RAY_INFRA_NAMES),
        *_loaded_types("aiohttp", _AIOHTTP_INFRA_NAMES),
        *_loaded_types("httpx", _HTTPX_INFRA_NAMES),
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


def shorten(text: str, limit: int = 300) -> str:
    """``text`` with runs of whitespace made one space, cut to ``limit`` characters (``...`` marks a cut)."""
    text = " ".join(text.split())
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
    return gym_status_failure(status, shorten(str(detail)))


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
    cause = getattr(exc, "cause", None)
    shown = cause if isinstance(cause, BaseException) else exc
    detail = f"prompt_idx={prompt_idx} traj_idx={traj_idx}: {type(shown).__name__}: {shown}"
    if classify_rollout_failure(exc) is FailureClass.INFRA:
        return EnvironmentUnavailable(f"environment unavailable for {detail}")
    return RolloutDataFailure(f"environment step failed for {detail}")
