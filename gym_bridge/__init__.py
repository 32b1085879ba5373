"""gym-bridge: rollouts for LLM RL training loops and agent evaluations, over NeMo-Gym or natively.

The public API is importable from here (``from gym_bridge import RolloutManager, NemoGymConfig``).
``_EXPORTS`` below maps each defining module to its public names; every name is resolved lazily on
first use (module ``__getattr__``), so ``import gym_bridge`` and the CLI pay for torch or Ray only
when a name that needs them is used. :mod:`gym_bridge._public` imports the same names for type
checkers (``tests/house/test_public_api.py`` keeps the two equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gym_bridge._public import *  # noqa: F403  (every public name, for type checkers)


_EXPORTS: dict[str, tuple[str, ...]] = {
    "gym_bridge.batched": (
        "BatchedDataDict",
        "batched_message_log_to_flat_message",
    ),
    "gym_bridge.cli": ("main",),
    "gym_bridge.config.launch_spec": ("GymLaunchSpec",),
    "gym_bridge.config.nemo_rl_gym": (
        "setup_nemo_gym_config",
        "should_use_nemo_gym",
    ),
    "gym_bridge.config.training": (
        "nemo_gym_config_from",
        "nemo_gym_launch_spec",
    ),
    "gym_bridge.data": (
        "datum_from_chat",
        "datum_from_gym_row",
    ),
    "gym_bridge.environments.arithmetic": ("arithmetic_env_actor",),
    "gym_bridge.environments.guessing": ("guessing_env_actor",),
    "gym_bridge.eval.config": (
        "EvalConfig",
        "load_config",
    ),
    "gym_bridge.eval.runner": ("run_eval",),
    "gym_bridge.failures.errors": (
        "GymBridgeError",
        "GymResultError",
        "InvalidGymRow",
        "NoHealthyShards",
        "RefitMismatch",
        "RolloutDataFailure",
        "RolloutFailure",
        "RolloutInfraFailure",
        "RolloutRedispatchExhausted",
        "RolloutStall",
        "RolloutTimeout",
        "SettingError",
    ),
    "gym_bridge.failures.retry": (
        "RolloutRetryPolicy",
        "RolloutTimeouts",
    ),
    "gym_bridge.failures.stats": ("RolloutStats",),
    "gym_bridge.generation.factory": ("EngineSpec",),
    "gym_bridge.generation.hf": ("HFGeneration",),
    "gym_bridge.generation.hf_config": ("HFGenerationConfig",),
    "gym_bridge.gym.transport.actor_config": ("NemoGymConfig",),
    "gym_bridge.gym.transport.spinup": (
        "start_nemo_gym_actor",
        "start_nemo_gym_actors",
        "stop_nemo_gym_actors",
    ),
    "gym_bridge.interfaces": (
        "ColocatablePolicyInterface",
        "EnvironmentInterface",
        "GenerationInterface",
        "PolicyInterface",
        "RolloutBackend",
    ),
    "gym_bridge.metrics": (
        "calculate_single_metric",
        "pct",
    ),
    "gym_bridge.models.registry": ("resolve_model_path",),
    "gym_bridge.policy.hf": (
        "HFPolicy",
        "HFPolicyConfig",
    ),
    "gym_bridge.policy.loss": ("policy_gradient_loss",),
    "gym_bridge.preflight": (
        "EndpointCheck",
        "PreflightError",
        "check_endpoint",
        "check_endpoints",
        "preflight_endpoints",
        "rows_use_tools",
    ),
    "gym_bridge.ray_utils": ("init_ray",),
    "gym_bridge.recipes.engine_server": (
        "EngineServer",
        "ServeOptions",
        "build_engine_server",
        "serve_engine",
    ),
    "gym_bridge.recipes.launch": (
        "NemoGymRollouts",
        "launch_nemo_gym",
        "spinup_nemo_gym_actor",
        "start_nemo_gym",
    ),
    "gym_bridge.rollout.env_step": ("calculate_rewards",),
    "gym_bridge.rollout.manager": (
        "RolloutManager",
        "RolloutOutcome",
    ),
    "gym_bridge.rollout.native": ("AsyncRolloutImpl",),
    "gym_bridge.rollout.nemo_gym": ("AsyncNemoGymRolloutImpl",),
    "gym_bridge.rollout.nemo_gym_batch": (
        "run_async_nemo_gym_rollout",
        "run_nemo_gym_rollout_sync",
        "should_log_nemo_gym_full_result_tables",
    ),
    "gym_bridge.rollout.nemo_gym_batch_result": ("NemoGymRolloutResult",),
    "gym_bridge.rollout.reward_shaping": (
        "get_nemo_gym_thinking_tags",
        "should_mask_flagged_samples",
    ),
    "gym_bridge.rollout.sink": (
        "InMemoryReplayBuffer",
        "InMemorySink",
        "ReplayBuffer",
    ),
    "gym_bridge.rollout.sync": (
        "generate_responses",
        "run_multi_turn_rollout",
    ),
    "gym_bridge.serving.server": ("OpenAIServer",),
    "gym_bridge.types": (
        "Completion",
        "DatumSpec",
        "EnvironmentReturn",
        "GenerationConfig",
        "GenerationDatumSpec",
        "GenerationOutputSpec",
        "GenerationSamplingParams",
        "LogprobOutputSpec",
        "MessageEntry",
        "PromptGroupRecord",
        "ReferenceLogprobOutputSpec",
        "TopkLogitsOutputSpec",
    ),
}
"""Defining module -> its public names: the public API."""

_MODULE_OF: dict[str, str] = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [*_MODULE_OF, "__version__"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'gym_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
