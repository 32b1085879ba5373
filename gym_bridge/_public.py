"""The public API for type checkers: one import per name from the module that defines it.

``gym_bridge/__init__.py``'s ``_EXPORTS`` lists the same names for the lazy imports at run time; add a name
to both (``tests/house/test_public_api.py`` fails when they differ).
"""

from __future__ import annotations

from gym_bridge.batched import (
    BatchedDataDict as BatchedDataDict,
    batched_message_log_to_flat_message as batched_message_log_to_flat_message,
)
from gym_bridge.cli import (
    main as main,
)
from gym_bridge.config.launch_spec import (
    GymLaunchSpec as GymLaunchSpec,
)
from gym_bridge.config.nemo_rl_gym import (
    setup_nemo_gym_config as setup_nemo_gym_config,
    should_use_nemo_gym as should_use_nemo_gym,
)
from gym_bridge.config.training import (
    nemo_gym_config_from as nemo_gym_config_from,
    nemo_gym_launch_spec as nemo_gym_launch_spec,
)
from gym_bridge.data import (
    datum_from_chat as datum_from_chat,
    datum_from_gym_row as datum_from_gym_row,
)
from gym_bridge.environments.arithmetic import (
    arithmetic_env_actor as arithmetic_env_actor,
)
from gym_bridge.environments.guessing import (
    guessing_env_actor as guessing_env_actor,
)
from gym_bridge.eval.config import (
    EvalConfig as EvalConfig,
    load_config as load_config,
)
from gym_bridge.eval.runner import (
    run_eval as run_eval,
)
from gym_bridge.failures.errors import (
    GymBridgeError as GymBridgeError,
    GymResultError as GymResultError,
    InvalidGymRow as InvalidGymRow,
    NoHealthyShards as NoHealthyShards,
    RefitMismatch as RefitMismatch,
    RolloutDataFailure as RolloutDataFailure,
    RolloutFailure as RolloutFailure,
    RolloutInfraFailure as RolloutInfraFailure,
    RolloutRedispatchExhausted as RolloutRedispatchExhausted,
    RolloutStall as RolloutStall,
    RolloutTimeout as RolloutTimeout,
    SettingError as SettingError,
)
from gym_bridge.failures.retry import (
    RolloutRetryPolicy as RolloutRetryPolicy,
    RolloutTimeouts as RolloutTimeouts,
)
from gym_bridge.failures.stats import (
    RolloutStats as RolloutStats,
)
from gym_bridge.generation.factory import (
    EngineSpec as EngineSpec,
)
from gym_bridge.generation.hf import (
    HFGeneration as HFGeneration,
)
from gym_bridge.generation.hf_config import (
    HFGenerationConfig as HFGenerationConfig,
)
from gym_bridge.gym.transport.actor_config import (
    NemoGymConfig as NemoGymConfig,
)
from gym_bridge.gym.transport.spinup import (
    start_nemo_gym_actor as start_nemo_gym_actor,
    start_nemo_gym_actors as start_nemo_gym_actors,
    stop_nemo_gym_actors as stop_nemo_gym_actors,
)
from gym_bridge.interfaces import (
    ColocatablePolicyInterface as ColocatablePolicyInterface,
    EnvironmentInterface as EnvironmentInterface,
    GenerationInterface as GenerationInterface,
    PolicyInterface as PolicyInterface,
    RolloutBackend as RolloutBackend,
)
from gym_bridge.metrics import (
    calculate_single_metric as calculate_single_metric,
    pct as pct,
)
from gym_bridge.models.registry import (
    resolve_model_path as resolve_model_path,
)
from gym_bridge.policy.hf import (
    HFPolicy as HFPolicy,
    HFPolicyConfig as HFPolicyConfig,
)
from gym_bridge.policy.loss import (
    policy_gradient_loss as policy_gradient_loss,
)
from gym_bridge.preflight import (
    EndpointCheck as EndpointCheck,
    PreflightError as PreflightError,
    check_endpoint as check_endpoint,
    check_endpoints as check_endpoints,
    preflight_endpoints as preflight_endpoints,
    rows_use_tools as rows_use_tools,
)
from gym_bridge.ray_utils import (
    init_ray as init_ray,
)
from gym_bridge.recipes.engine_server import (
    EngineServer as EngineServer,
    ServeOptions as ServeOptions,
    build_engine_server as build_engine_server,
    serve_engine as serve_engine,
)
from gym_bridge.recipes.launch import (
    NemoGymRollouts as NemoGymRollouts,
    launch_nemo_gym as launch_nemo_gym,
    spinup_nemo_gym_actor as spinup_nemo_gym_actor,
    start_nemo_gym as start_nemo_gym,
)
from gym_bridge.rollout.env_step import (
    calculate_rewards as calculate_rewards,
)
from gym_bridge.rollout.manager import (
    RolloutManager as RolloutManager,
    RolloutOutcome as RolloutOutcome,
)
from gym_bridge.rollout.native import (
    AsyncRolloutImpl as AsyncRolloutImpl,
)
from gym_bridge.rollout.nemo_gym import (
    AsyncNemoGymRolloutImpl as AsyncNemoGymRolloutImpl,
)
from gym_bridge.rollout.nemo_gym_batch import (
    run_async_nemo_gym_rollout as run_async_nemo_gym_rollout,
    run_nemo_gym_rollout_sync as run_nemo_gym_rollout_sync,
    should_log_nemo_gym_full_result_tables as should_log_nemo_gym_full_result_tables,
)
from gym_bridge.rollout.nemo_gym_batch_result import (
    NemoGymRolloutResult as NemoGymRolloutResult,
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
from gym_bridge.rollout.sync import (
    generate_responses as generate_responses,
    run_multi_turn_rollout as run_multi_turn_rollout,
)
from gym_bridge.serving.server import (
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
    LogprobOutputSpec as LogprobOutputSpec,
    MessageEntry as MessageEntry,
    PromptGroupRecord as PromptGroupRecord,
    ReferenceLogprobOutputSpec as ReferenceLogprobOutputSpec,
    TopkLogitsOutputSpec as TopkLogitsOutputSpec,
)
