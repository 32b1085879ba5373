"""gym-bridge: rollouts for LLM RL training loops and agent evaluations, over NeMo-Gym or natively.

The public API is importable from here (``from gym_bridge import RolloutManager, NemoGymConfig``).
Every name is resolved lazily on first use (module ``__getattr__``), so ``import gym_bridge``
and the CLI pay for torch or Ray only when a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # contract types
    "Completion": "gym_bridge.types",
    "DatumSpec": "gym_bridge.types",
    "EnvironmentReturn": "gym_bridge.types",
    "GenerationConfig": "gym_bridge.types",
    "GenerationDatumSpec": "gym_bridge.types",
    "GenerationOutputSpec": "gym_bridge.types",
    "MessageEntry": "gym_bridge.types",
    "PromptGroupRecord": "gym_bridge.types",
    # interfaces a user implements
    "EnvironmentInterface": "gym_bridge.interfaces",
    "GenerationInterface": "gym_bridge.interfaces",
    "PolicyInterface": "gym_bridge.interfaces",
    "RolloutBackend": "gym_bridge.interfaces",
    # rolling out
    "RolloutManager": "gym_bridge.rollout.manager",
    "RolloutOutcome": "gym_bridge.rollout.manager",
    "InMemorySink": "gym_bridge.rollout.sink",
    "InMemoryReplayBuffer": "gym_bridge.rollout.sink",
    "ReplayBuffer": "gym_bridge.rollout.sink",
    "BatchedDataDict": "gym_bridge.batched",
    "GenerationSamplingParams": "gym_bridge.types",
    "calculate_single_metric": "gym_bridge.metrics",
    "pct": "gym_bridge.metrics",
    # NeMo-RL's whole-batch Gym functions
    "NemoGymRolloutResult": "gym_bridge.rollout.nemo_gym_batch",
    "run_async_nemo_gym_rollout": "gym_bridge.rollout.nemo_gym_batch",
    "run_nemo_gym_rollout_sync": "gym_bridge.rollout.nemo_gym_batch",
    "should_log_nemo_gym_full_result_tables": "gym_bridge.rollout.nemo_gym_batch",
    "get_nemo_gym_thinking_tags": "gym_bridge.rollout.reward_shaping",
    "should_mask_flagged_samples": "gym_bridge.rollout.reward_shaping",
    "datum_from_chat": "gym_bridge.data",
    "datum_from_gym_row": "gym_bridge.data",
    # NeMo-Gym
    "NemoGymConfig": "gym_bridge.gym.actor",
    "spinup_nemo_gym_actor": "gym_bridge.gym.actor",
    "spinup_nemo_gym_actors": "gym_bridge.gym.actor",
    "start_nemo_gym_actor": "gym_bridge.gym.actor",
    "setup_nemo_gym_config": "gym_bridge.rollout.training_config",
    "stop_nemo_gym_actors": "gym_bridge.gym.actor",
    "GymLaunchSpec": "gym_bridge.launch",
    "NemoGymRollouts": "gym_bridge.launch",
    "launch_nemo_gym": "gym_bridge.launch",
    "start_nemo_gym": "gym_bridge.launch",
    "build_nemo_gym_rollouts": "gym_bridge.rollout.training_config",
    "nemo_gym_config_from": "gym_bridge.rollout.training_config",
    "should_use_nemo_gym": "gym_bridge.rollout.training_config",
    "init_ray": "gym_bridge.ray_utils",
    # endpoints
    "EndpointCheck": "gym_bridge.preflight",
    "PreflightError": "gym_bridge.preflight",
    "check_endpoint": "gym_bridge.preflight",
    "check_endpoints": "gym_bridge.preflight",
    "preflight_endpoints": "gym_bridge.preflight",
    "OpenAIServer": "gym_bridge.serving",
    # failures, deadlines, retries
    "GymBridgeError": "gym_bridge.failures",
    "GymResultError": "gym_bridge.failures",
    "InvalidGymRow": "gym_bridge.failures",
    "NoHealthyShards": "gym_bridge.failures",
    "RolloutDataFailure": "gym_bridge.failures",
    "RolloutFailure": "gym_bridge.failures",
    "RolloutInfraFailure": "gym_bridge.failures",
    "RolloutRedispatchExhausted": "gym_bridge.failures",
    "RolloutRetryPolicy": "gym_bridge.failures",
    "RolloutStall": "gym_bridge.failures",
    "RolloutTimeout": "gym_bridge.failures",
    "RolloutTimeouts": "gym_bridge.failures",
    # evaluation
    "EvalConfig": "gym_bridge.eval.config",
    "load_config": "gym_bridge.eval.config",
    "run_eval": "gym_bridge.eval.runner",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    # "X as X" marks each name as re-exported for type checkers and linters
    from gym_bridge.batched import (
        BatchedDataDict as BatchedDataDict,
    )
    from gym_bridge.data import (
        datum_from_chat as datum_from_chat,
        datum_from_gym_row as datum_from_gym_row,
    )
    from gym_bridge.eval.config import (
        EvalConfig as EvalConfig,
        load_config as load_config,
    )
    from gym_bridge.eval.runner import (
        run_eval as run_eval,
    )
    from gym_bridge.failures import (
        GymBridgeError as GymBridgeError,
        GymResultError as GymResultError,
        InvalidGymRow as InvalidGymRow,
        NoHealthyShards as NoHealthyShards,
        RolloutDataFailure as RolloutDataFailure,
        RolloutFailure as RolloutFailure,
        RolloutInfraFailure as RolloutInfraFailure,
        RolloutRedispatchExhausted as RolloutRedispatchExhausted,
        RolloutRetryPolicy as RolloutRetryPolicy,
        RolloutStall as RolloutStall,
        RolloutTimeout as RolloutTimeout,
        RolloutTimeouts as RolloutTimeouts,
    )
    from gym_bridge.gym.actor import (
        NemoGymConfig as NemoGymConfig,
        spinup_nemo_gym_actor as spinup_nemo_gym_actor,
        spinup_nemo_gym_actors as spinup_nemo_gym_actors,
        start_nemo_gym_actor as start_nemo_gym_actor,
        stop_nemo_gym_actors as stop_nemo_gym_actors,
    )
    from gym_bridge.interfaces import (
        EnvironmentInterface as EnvironmentInterface,
        GenerationInterface as GenerationInterface,
        PolicyInterface as PolicyInterface,
        RolloutBackend as RolloutBackend,
    )
    from gym_bridge.launch import (
        GymLaunchSpec as GymLaunchSpec,
        NemoGymRollouts as NemoGymRollouts,
        launch_nemo_gym as launch_nemo_gym,
        start_nemo_gym as start_nemo_gym,
    )
    from gym_bridge.metrics import (
        calculate_single_metric as calculate_single_metric,
        pct as pct,
    )
    from gym_bridge.preflight import (
        EndpointCheck as EndpointCheck,
        PreflightError as PreflightError,
        check_endpoint as check_endpoint,
        check_endpoints as check_endpoints,
        preflight_endpoints as preflight_endpoints,
    )
    from gym_bridge.ray_utils import (
        init_ray as init_ray,
    )
    from gym_bridge.rollout.manager import (
        RolloutManager as RolloutManager,
        RolloutOutcome as RolloutOutcome,
    )
    from gym_bridge.rollout.nemo_gym_batch import (
        NemoGymRolloutResult as NemoGymRolloutResult,
        run_async_nemo_gym_rollout as run_async_nemo_gym_rollout,
        run_nemo_gym_rollout_sync as run_nemo_gym_rollout_sync,
        should_log_nemo_gym_full_result_tables as should_log_nemo_gym_full_result_tables,
    )
    from gym_bridge.rollout.reward_shaping import (
        get_nemo_gym_thinking_tags as get_nemo_gym_thinking_tags,
        should_mask_flagged_samples as should_mask_flagged_samples,
    )
    from gym_bridge.rollout.sink import (
        InMemoryReplayBuffer as InMemoryReplayBuffer,
        InMemorySink as InMemorySink,
        ReplayBuffer as ReplayBuffer,
    )
    from gym_bridge.rollout.training_config import (
        build_nemo_gym_rollouts as build_nemo_gym_rollouts,
        nemo_gym_config_from as nemo_gym_config_from,
        setup_nemo_gym_config as setup_nemo_gym_config,
        should_use_nemo_gym as should_use_nemo_gym,
    )
    from gym_bridge.serving import (
        OpenAIServer as OpenAIServer,
    )
    from gym_bridge.types import (
        Completion as Completion,
        DatumSpec as DatumSpec,
        EnvironmentReturn as EnvironmentReturn,
        GenerationConfig as GenerationConfig,
        GenerationDatumSpec as GenerationDatumSpec,
        GenerationOutputSpec as GenerationOutputSpec,
        GenerationSamplingParams as GenerationSamplingParams,
        MessageEntry as MessageEntry,
        PromptGroupRecord as PromptGroupRecord,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gym_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
