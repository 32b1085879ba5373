"""The typed contract between the manager and a rollout backend: one context, one options model per backend.

The manager builds a :class:`RolloutContext` once (what every backend may need) and validates the caller's
backend keywords against the backend's ``Options`` model before constructing it, so a misspelt or mistyped
option is a one-line :class:`BackendOptionsError` naming it, never a silently dropped keyword. A backend class
is checked against :class:`BackendClass` when :func:`~gym_bridge.rollout.registry.load_backend` loads it, as
pluggy checks a hook implementation when it registers.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

from gym_bridge.failures import GymBridgeError, RolloutRetryPolicy, RolloutStats, RolloutTimeouts
from gym_bridge.interfaces import GenerationInterface, RolloutBackend
from gym_bridge.types import ActorHandle, GenerationConfig, Tokenizer


@dataclass(frozen=True)
class RolloutContext:
    """What the manager hands every backend, built once per manager (NeMo-RL's common constructor arguments)."""

    tokenizer: Tokenizer
    task_to_env: Mapping[str, ActorHandle]
    num_generations_per_prompt: int
    max_seq_len: int
    """The context length (NeMo-RL's name for the manager's): a completion of exactly this many tokens is
    ``truncated``. A training config's one reader of it is :func:`~gym_bridge.config.training.context_length`, whose
    value the engine and the server take as their ``max_model_len``."""
    max_rollout_turns: int | None
    policy_generation: GenerationInterface | None
    generation_config: GenerationConfig | None
    mask_env_flagged_samples: bool
    timeouts: RolloutTimeouts
    retry_policy: RolloutRetryPolicy
    stats: RolloutStats


class BackendOptions(BaseModel):
    """A backend's own keywords: unknown names and wrong types are refused, values are frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


@runtime_checkable
class BackendClass(Protocol):
    """What a class registered under ``gym_bridge.rollout_backends`` provides: its options model, a constructor
    from the manager's context and those options, and instances that meet :class:`RolloutBackend`."""

    Options: ClassVar[type[BackendOptions]]

    @classmethod
    def from_context(cls, context: RolloutContext, options: Any) -> RolloutBackend: ...


class BackendOptionsError(GymBridgeError, TypeError):
    """A keyword given for a rollout backend is unknown to its ``Options`` model or has the wrong type."""


def backend_contract_problem(backend: object) -> str | None:
    """Why ``backend`` is not a rollout backend class (:class:`BackendClass` whose instances have an async
    ``run_rollout``), or None when it is one."""
    if not isinstance(backend, type):
        return "is not a class"
    options = getattr(backend, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BackendOptions)):
        return "declares no Options model (a gym_bridge.rollout.backend.BackendOptions subclass)"
    if not callable(getattr(backend, "from_context", None)):
        return "has no from_context(context, options) classmethod"
    if not inspect.iscoroutinefunction(getattr(backend, "run_rollout", None)):
        return "has no async run_rollout(datum) method"
    return None


def backend_options(backend: type[BackendClass], name: str, given: Mapping[str, object]) -> BackendOptions:
    """``given`` validated into ``backend``'s ``Options``; a :class:`BackendOptionsError` names every problem."""
    try:
        return backend.Options.model_validate(dict(given))
    except ValidationError as exc:
        takes = ", ".join(sorted(backend.Options.model_fields)) or "no options"
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise BackendOptionsError(f"rollout backend {name!r}: {problems} (it takes: {takes})") from None


def _problem(error: Any) -> str:
    """One pydantic error as ``option 'x': what is wrong``."""
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown option {field!r}"
    return f"option {field!r}: {error['msg']}"
