"""GymLaunchSpec: what a Gym rollout stack is made of, as one value (read from a config or written by hand)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts
from gym_bridge.json_types import JsonMapping

if TYPE_CHECKING:
    from gym_bridge.gym.transport.actor_config import NemoGymConfig
    from gym_bridge.rollout.nemo_gym import NemoGymOptions


def no_manager_options() -> NemoGymOptions:
    """The ``nemo_gym`` backend's defaults (imported on use: reading a config starts no Ray import)."""
    from gym_bridge.rollout.nemo_gym import NemoGymOptions

    return NemoGymOptions()


@dataclass(frozen=True)
class GymLaunchSpec:
    """What to start: the actors' Gym config, how many actors, and the manager's settings."""

    gym: NemoGymConfig
    num_generations_per_prompt: int
    max_seq_len: int
    """The context length: the manager's ``max_seq_len`` (NeMo-RL's name; a completion of exactly this many tokens
    is ``truncated``). From a training config it is :func:`~gym_bridge.config.training.context_length`, the value a
    GRPO run's engine and server take as their ``max_model_len`` too."""
    generation_config: JsonMapping
    """NeMo-RL's ``policy.generation`` keys (``GenerationConfig``)."""
    num_actors: int = 1
    split_base_urls: bool = False
    uses_tools: bool = False
    """Some rows offer tools: preflight then checks that every endpoint accepts chats with tools."""
    preflight: bool = True
    preflight_timeout_s: float = 20.0
    ray_num_cpus: int | None = None
    """CPUs of a Ray started here (None: all); ignored when Ray is already running."""
    timeouts: RolloutTimeouts = field(default_factory=RolloutTimeouts)
    retry_policy: RolloutRetryPolicy | None = None
    """None: the manager's default (one attempt of everything)."""
    mask_env_flagged_samples: bool = True
    manager_options: NemoGymOptions = field(default_factory=no_manager_options)
    """The ``nemo_gym`` backend's options (``full_results_path``, ``seed``, ``admission``, ...); the manager is given
    the ones set (``model_fields_set``)."""

    def with_manager_options(self, **options: object) -> GymLaunchSpec:
        """This spec with ``options`` set over its ``manager_options``, validated as the manager validates a
        backend's keywords (an unknown or mistyped one is a ``BackendOptionsError`` before anything starts)."""
        if not options:
            return self
        from gym_bridge.rollout.backend import BackendClass, backend_options
        from gym_bridge.rollout.nemo_gym import NEMO_GYM_TASK, AsyncNemoGymRolloutImpl, NemoGymOptions

        given = {name: getattr(self.manager_options, name) for name in self.manager_options.model_fields_set}
        backend = cast("type[BackendClass]", AsyncNemoGymRolloutImpl)
        merged = backend_options(backend, NEMO_GYM_TASK, {**given, **options})
        assert isinstance(merged, NemoGymOptions)
        return replace(self, manager_options=merged)
