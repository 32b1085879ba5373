"""Building the rollout layer from a NeMo-RL-style training config.

Reads the keys a NeMo-RL GRPO config already has, so ``use_nemo_gym: true`` in an existing config just works:

- ``use_nemo_gym`` (top level) or ``env.should_use_nemo_gym``: pick the ``nemo_gym`` backend;
- ``env.nemo_gym.config_paths``: the Gym server configs, or ``env.nemo_gym.gym_head``: the head server of a Gym that
  is already running, whose config is its own (what would change it is refused, as ``NemoGymConfig`` refuses it);
  ``env.nemo_gym.base_urls`` and ``env.nemo_gym.model_name`` (else ``policy.generation.model_name``, else
  ``policy.model_name``): the endpoint; other keys of ``env.nemo_gym`` that
  :class:`~gym_bridge.gym.transport.actor.NemoGymConfig` knows are taken as such, the rest go to Gym's global config;
- ``env.nemo_gym.rollout_timeout_s`` and ``env.nemo_gym.max_row_attempts``: the group deadline and the row
  re-dispatch budget (or NeMo-RL's ``async_rl.rollout_failure``);
- ``env.should_mask_flagged_samples``, ``env.should_log_nemo_gym_responses``,
  ``logger.wandb.log_nemo_gym_full_result_tables``, ``env.nemo_gym.is_trajectory_collection``,
  ``env.nemo_gym.effort_levels``, ``reward_penalties``: carried in :class:`NemoGymRolloutSettings`;
- ``async_rl`` and ``grpo.async_grpo`` (:mod:`gym_bridge.config.async_settings`): honoured, or refused in one line;
- ``env.nemo_gym.num_actors`` (default 1) and ``env.nemo_gym.split_base_urls``: several NemoGym actors, each with
  its own Gym servers, sharing the endpoints or splitting them;
- ``policy.generation``: the generation config; ``grpo.num_generations_per_prompt``: N;
- ``policy.max_total_sequence_length`` and NeMo-RL's engine copies of it (``policy.generation.vllm_cfg.max_model_len``,
  ``trtllm_cfg.max_model_len``, ``mcore_generation_config.max_model_len``): the run's one context length
  (:func:`context_length`), the manager's ``max_seq_len`` here and the engine's and server's ``max_model_len`` in a
  GRPO run; keys that disagree are refused;
- ``grpo.seed`` (:func:`run_seed`, default 0): the run seed of the ``nemo_gym`` backend (``manager_options``),
  from which every row's sampling seed derives;
- ``env.nemo_gym.admission`` (ours; :func:`admission_settings`): how the Gym client's rows in flight adapt to a
  saturated endpoint (``manager_options``), never sent to Gym.

A NeMo-RL GRPO YAML loads unchanged (:func:`~gym_bridge.config.loading.load_training_config` resolves its
``defaults:`` parents and ``${...}`` interpolations as NeMo-RL's ``load_config`` does).
As NeMo-RL's Gym setup does, ``stop_strings``/``stop_token_ids`` are set to None (one warning) on the Gym path; every
key the rollout layer does not read is accepted and listed once at debug level.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pydantic import BaseModel, TypeAdapter, ValidationError

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.config.async_settings import (
    AsyncGRPOSettings,
    AsyncRLSettings,
    failure_policy,
    refuse_native_failure_keys,
)
from gym_bridge.config.keys import TrainingConfigError, config_value
from gym_bridge.config.launch_spec import GymLaunchSpec
from gym_bridge.config.loading import plain_config, resolved_config
from gym_bridge.config.nemo_rl_gym import should_use_nemo_gym
from gym_bridge.config.values import check_values, count
from gym_bridge.failures import SettingError
from gym_bridge.gym.servers.config_files import ROUTING_KEYS
from gym_bridge.gym.servers.server_config import head_address
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.admission import AdmissionSettings
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.rollout.nemo_gym_batch_input import CONTEXT_LENGTH_FIELD, ENGINE_CONFIG_SECTIONS, engine_context_lengths

logger = logging.getLogger(__name__)

DEFAULT_SEED = 0
"""The run seed of a config without ``grpo.seed`` (the trainer's ``GRPOLoopConfig.seed`` default is the same value;
a test holds them equal). Defined here, not read from the trainer, so reading a config never imports torch or Ray."""
CONTEXT_LENGTH_KEY = f"policy.{CONTEXT_LENGTH_FIELD}"
"""The run's context length, NeMo-RL's name for it (its recipes give every engine key below this value)."""
ENGINE_CONTEXT_KEYS = tuple(f"policy.generation.{section}.max_model_len" for section in ENGINE_CONFIG_SECTIONS)
"""NeMo-RL's engine contexts (``vllm_cfg`` -> ``trtllm_cfg`` -> ``mcore``, then :data:`CONTEXT_LENGTH_KEY`); each
recipe sets them to ``${policy.max_total_sequence_length}``."""
_BRIDGE_KEYS = ("rollout_timeout_s", "max_row_attempts", "num_actors", "split_base_urls", "admission")
_NEMO_RL_ONLY_GYM_KEYS = ("is_trajectory_collection", "effort_levels")
"""Keys of ``env.nemo_gym`` that NeMo-RL pops before Gym sees the section: read into the settings, not Gym's."""
_READ_KEYS = (
    "use_nemo_gym",
    "env.should_use_nemo_gym",
    "env.nemo_gym",
    "env.should_mask_flagged_samples",
    "env.should_log_nemo_gym_responses",
    "logger.wandb_enabled",
    "logger.wandb.log_nemo_gym_full_result_tables",
    "async_rl",
    "grpo.async_grpo",
    "reward_penalties",
    "policy.model_name",
    CONTEXT_LENGTH_KEY,
    *ENGINE_CONTEXT_KEYS,
    "policy.generation.model_name",
    "policy.generation.max_new_tokens",
    "policy.generation.temperature",
    "policy.generation.top_p",
    "policy.generation.top_k",
    "policy.generation.val_temperature",
    "policy.generation.val_top_p",
    "policy.generation.val_top_k",
    "policy.generation.stop_strings",
    "policy.generation.stop_token_ids",
    "policy.generation.backend",
    "grpo.num_generations_per_prompt",
    "grpo.seed",
    "distillation.num_generations_per_prompt",
)
"""The keys of a training config that the rollout layer reads (a prefix covers its subtree)."""
_STOP_KEYS = ("stop_strings", "stop_token_ids")


def _leaf_paths(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, Mapping) or not node:
        return [prefix] if prefix else []
    return [
        path for key, value in node.items() for path in _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    ]


def unused_training_keys(config: JsonMapping) -> list[str]:
    """The dotted keys of ``config`` that the rollout layer does not read (NeMo-RL's trainer settings, ...).

    The ``env`` sections of native environments (``env.math``, ...) count as read: the Gym path names them once in
    a warning (they have no effect there, as in NeMo-RL's Gym runners).
    """

    read_keys = _READ_KEYS + tuple(f"env.{name}" for name in _native_environments(config))

    def read(path: str) -> bool:
        return any(path == key or path.startswith(f"{key}.") for key in read_keys)

    return [path for path in _leaf_paths(config) if not read(path)]


def _native_environments(config: JsonMapping) -> list[str]:
    """The ``env`` sections other than ``nemo_gym`` (NeMo-RL's native environments: ``math``, ``dapo``, ...)."""
    env = config_value(config, "env", None)
    if not isinstance(env, Mapping):
        return []
    return sorted(str(name) for name, value in env.items() if name != "nemo_gym" and isinstance(value, Mapping))


def nemo_gym_generation_config(config: JsonMapping) -> JsonObject:
    """``policy.generation`` for the Gym path, with ``stop_strings``/``stop_token_ids`` set to None.

    NeMo-RL's Gym setup does the same (Gym's model server does not forward them); we
    say so with one warning instead of silently, and the backend's check never fires.
    """
    generation = copy.deepcopy(dict(config_value(plain_config(config), "policy.generation")))
    cleared = {key: generation[key] for key in _STOP_KEYS if generation.get(key)}
    if cleared:
        logger.warning(
            "NeMo-Gym rollouts ignore policy.generation %s (the Gym model server does not forward them); "
            "set to None as NeMo-RL's Gym setup does",
            ", ".join(f"{key}={value!r}" for key, value in cleared.items()),
        )
    for key in _STOP_KEYS:
        generation[key] = None
    return generation


def nemo_gym_config_from(config: JsonMapping, *, base_urls: list[str] | None = None) -> NemoGymConfig:
    """The NemoGym actor's config from ``env.nemo_gym`` (``base_urls`` overrides the config's).

    Keys the rollout layer does not read are listed once, at debug level.
    """
    config = plain_config(config)
    unused = unused_training_keys(config)
    if unused:
        logger.debug("training config keys the rollout layer does not use: %s", ", ".join(unused))
    section = copy.deepcopy(dict(config_value(config, "env.nemo_gym")))
    for key in _BRIDGE_KEYS + _NEMO_RL_ONLY_GYM_KEYS + ROUTING_KEYS:
        section.pop(key, None)
    urls = base_urls or section.pop("base_urls", None)
    section.pop("base_urls", None)
    if not urls:
        raise TrainingConfigError("no endpoint: set 'env.nemo_gym.base_urls' (http://host:port/v1, one per replica)")
    model_name = (
        section.pop("model_name", None)
        or config_value(config, "policy.generation.model_name", None)
        or config_value(config, "policy.model_name", None)
    )
    if not model_name:
        raise TrainingConfigError("no model name: set 'env.nemo_gym.model_name' or 'policy.model_name'")
    if section.get("gym_head"):
        try:
            head_address(str(section["gym_head"]))
        except SettingError as exc:
            raise TrainingConfigError(f"env.nemo_gym.gym_head: {exc}") from None
    elif "config_paths" not in section:
        raise TrainingConfigError(
            "the training config has no 'env.nemo_gym.config_paths' (the Gym to start) or 'env.nemo_gym.gym_head' "
            "(the head server of a Gym that is already running)"
        )
    known = set(NemoGymConfig.model_fields) - {"model_name", "base_urls", "overrides"}
    fields = {key: section.pop(key) for key in list(section) if key in known}
    overrides = {**section.pop("overrides", {}), **section}
    try:
        return NemoGymConfig(model_name=model_name, base_urls=list(urls), overrides=overrides, **fields)
    except ValidationError as exc:
        raise TrainingConfigError(
            "; ".join(
                f"env.nemo_gym{''.join(f'.{p}' for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                for err in exc.errors()
            )
        ) from None


@dataclass(frozen=True)
class NemoGymRolloutSettings:
    """Everything the Gym path and the GRPO loop take from a training config, read and checked in one place.

    ``launch`` is what :func:`~gym_bridge.recipes.launch.start_nemo_gym` starts (one type for both); the rest
    is for the loop and the batch functions.
    """

    launch: GymLaunchSpec
    """The actors' Gym config, N, ``max_seq_len``, the generation config, the actor count, and the manager's
    timeouts, retry policy (``async_rl.rollout_failure`` with NeMo-RL's defaults when the section is there,
    else one attempt of each kind with ``env.nemo_gym.max_row_attempts`` row attempts, default 3) and
    ``mask_env_flagged_samples`` (``env.should_mask_flagged_samples``; absent means True, as in NeMo-RL)."""
    log_full_result_tables: bool
    """``logger.wandb_enabled`` and ``logger.wandb.log_nemo_gym_full_result_tables``: ``{agent}/full_result``."""
    log_nemo_gym_responses: bool
    """``env.should_log_nemo_gym_responses``: Gym keeps the full responses (``full_results.jsonl`` per run)."""
    is_trajectory_collection: bool
    """``env.nemo_gym.is_trajectory_collection``: collect trajectories, do not train."""
    reward_penalties: JsonObject | None
    """``reward_penalties`` (NeMo-RL's ``RewardPenaltyConfig`` keys), as written."""
    effort_levels: JsonObject | None
    """``env.nemo_gym.effort_levels`` (NeMo-RL's ``EffortLevelsConfig`` keys), as written; never sent to Gym."""
    async_grpo: AsyncGRPOSettings
    async_rl: AsyncRLSettings
    """``async_rl``: its ``rollout_failure`` gave the retry policy and timeouts."""
    min_step_batch_fraction: float
    """``async_rl.rollout_failure.min_step_batch_fraction`` when that section is there, else 0 (no floor)."""
    unused_environments: tuple[str, ...] = ()
    """``env`` sections of NeMo-RL's native environments (``math``, ...): the Gym path does not start them."""

    def with_base_urls(self, base_urls: list[str], *, model_name: str | None = None) -> NemoGymRolloutSettings:
        """These settings with the actors' endpoints (and ``model_name``, the model asked for) replaced."""
        named = {"model_name": model_name} if model_name is not None else {}
        gym = self.launch.gym.model_copy(update={"base_urls": list(base_urls), **named})
        return replace(self, launch=replace(self.launch, gym=gym))


def nemo_gym_rollout_settings(config: object, *, base_urls: list[str] | None = None) -> NemoGymRolloutSettings:
    """Read a NeMo-RL-style training config (loaded, a dict, or attribute-style) for the Gym path.

    Errors name the key (:class:`TrainingConfigError`).
    """
    from gym_bridge.rollout.nemo_gym import NemoGymOptions

    mapping = config if isinstance(config, Mapping) else resolved_config(config)
    if not should_use_nemo_gym(mapping):
        raise TrainingConfigError("the config does not ask for NeMo-Gym: set 'env.should_use_nemo_gym: true'")
    config = plain_config(mapping)
    try:
        check_values(config, "the training config")  # a config given as a dict, not read from a file, too
    except UntrustedInputError as exc:
        raise TrainingConfigError(str(exc)) from None
    async_rl = _section_model(AsyncRLSettings, config, "async_rl")
    async_grpo = _section_model(AsyncGRPOSettings, config, "grpo.async_grpo")
    refuse_native_failure_keys(config)
    native_environments = _native_environments(config)
    _warn_without_effect(async_rl, native_environments)
    has_failure_section = config_value(config, "async_rl.rollout_failure", None) is not None
    retry_policy, timeouts = failure_policy(config, async_rl, async_grpo)
    section = config_value(config, "env.nemo_gym", {}) or {}
    wandb = config_value(config, "logger.wandb", {}) or {}
    launch = GymLaunchSpec(
        gym=nemo_gym_config_from(config, base_urls=base_urls),
        generation_config=nemo_gym_generation_config(config),
        num_generations_per_prompt=_generations(config),
        max_seq_len=context_length(config),
        num_actors=count(section.get("num_actors", 1), "env.nemo_gym.num_actors"),
        split_base_urls=bool(section.get("split_base_urls", False)),
        retry_policy=retry_policy,
        timeouts=timeouts,
        mask_env_flagged_samples=config_value(config, "env.should_mask_flagged_samples", None) is not False,
        manager_options=NemoGymOptions(seed=run_seed(config), admission=admission_settings(section.get("admission"))),
    )
    return NemoGymRolloutSettings(
        launch=launch,
        log_full_result_tables=bool(config_value(config, "logger.wandb_enabled", False))
        and bool(wandb.get("log_nemo_gym_full_result_tables")),
        log_nemo_gym_responses=bool(config_value(config, "env.should_log_nemo_gym_responses", False)),
        is_trajectory_collection=bool(section.get("is_trajectory_collection") or False),
        reward_penalties=config_value(config, "reward_penalties", None),
        effort_levels=section.get("effort_levels"),
        async_grpo=async_grpo,
        async_rl=async_rl,
        min_step_batch_fraction=async_rl.rollout_failure.min_step_batch_fraction if has_failure_section else 0.0,
        unused_environments=tuple(native_environments),
    )


def nemo_gym_launch_spec(
    config: object,
    *,
    base_urls: list[str] | None = None,
    uses_tools: bool = False,
    preflight: bool = True,
    **manager_options: object,
) -> GymLaunchSpec:
    """What :func:`~gym_bridge.recipes.launch.start_nemo_gym` starts for a NeMo-RL-style training config
    (:func:`nemo_gym_rollout_settings`' ``launch``). ``uses_tools``: some rows offer tools, so preflight checks that
    every endpoint accepts chats with tools (:func:`gym_bridge.preflight.rows_use_tools` tells from the rows);
    ``manager_options``: ``nemo_gym`` backend options over the config's."""
    launch = nemo_gym_rollout_settings(config, base_urls=base_urls).launch
    return replace(launch, uses_tools=uses_tools, preflight=preflight).with_manager_options(**manager_options)


def _generations(config: JsonMapping) -> int:
    """``grpo.num_generations_per_prompt`` (else ``distillation.num_generations_per_prompt``), a count."""
    for key in ("grpo.num_generations_per_prompt", "distillation.num_generations_per_prompt"):
        value = config_value(config, key, None)
        if value:
            return count(value, key)
    return count(config_value(config, "grpo.num_generations_per_prompt"), "grpo.num_generations_per_prompt")


def admission_settings(section: object) -> AdmissionSettings:
    """``env.nemo_gym.admission`` (ours, never sent to Gym):
    :class:`~gym_bridge.gym.transport.admission.AdmissionSettings`' keys, each left out at its default; a bad key or
    value is a :class:`TrainingConfigError` naming it."""
    if section is None:
        return AdmissionSettings()
    if not isinstance(section, Mapping):
        raise TrainingConfigError(
            f"env.nemo_gym.admission must be a mapping of AdmissionSettings keys, got {section!r}"
        )
    try:
        return TypeAdapter(AdmissionSettings).validate_python(dict(section), strict=False)
    except ValidationError as exc:
        problems = (
            f"env.nemo_gym.admission{''.join(f'.{p}' for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise TrainingConfigError("; ".join(problems)) from None


def run_seed(config: JsonMapping) -> int:
    """``grpo.seed``, the one reader of the run seed: torch, the engine, the loop and every row's sampling seed
    derive from it. Without the key it is :data:`DEFAULT_SEED`, for all of them alike."""
    seed = config_value(config, "grpo.seed", None)
    if seed is None:
        return DEFAULT_SEED
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TrainingConfigError(f"grpo.seed must be an int, got {seed!r}")
    return seed


def context_length(config: JsonMapping) -> int:
    """The run's one context length: the engine's and the server's ``max_model_len`` and the manager's truncation
    length (``max_seq_len``: a completion of exactly this many tokens is ``truncated``). The one reader of
    :data:`CONTEXT_LENGTH_KEY` and :data:`ENGINE_CONTEXT_KEYS` (those through
    :func:`~gym_bridge.rollout.nemo_gym_batch_input.engine_context_lengths`, which the rollout's engine limit reads).

    NeMo-RL starts its engine at the first engine key set and falls back to ``policy.max_total_sequence_length``;
    its recipes write both as one value. Here every key that is set must hold that value: two that disagree would
    start an engine whose context is not the length its completions are flagged truncated at, so they are refused
    in one line naming both keys and both values (:class:`TrainingConfigError`). One key set alone is the value.
    """
    engines = engine_context_lengths(config_value(config, "policy.generation", None))
    candidates = {CONTEXT_LENGTH_KEY: config_value(config, CONTEXT_LENGTH_KEY, None)}
    candidates.update({f"policy.generation.{key}": value for key, value in engines.items()})
    given: dict[str, int] = {}
    for key, value in candidates.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainingConfigError(f"{key} must be a positive integer, got {value!r}")
        given[key] = value
    if not given:
        raise TrainingConfigError(
            f"the training config has no '{CONTEXT_LENGTH_KEY}' (NeMo-RL's GRPO recipes set it): the context length "
            "of the engine, the server and the rollouts"
        )
    (first_key, first), *others = given.items()
    for key, value in others:
        if value != first:
            raise TrainingConfigError(
                f"{first_key} ({first}) and {key} ({value}) disagree: the engine's context and the rollouts' "
                f"truncation length are one value; set both to it (NeMo-RL's recipes write {key}: "
                f"${{{CONTEXT_LENGTH_KEY}}})"
            )
    return first


def _section_model[M: BaseModel](model: type[M], config: JsonMapping, dotted: str) -> M:
    """``model`` validated from the section at ``dotted`` (its defaults when absent); errors name the key."""
    try:
        return model.model_validate(config_value(config, dotted, None) or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{dotted}.{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}".replace(
                f"{dotted}.:", f"{dotted}:"
            )
            for err in exc.errors()
        )
        raise TrainingConfigError(problems) from None


def _warn_without_effect(async_rl: AsyncRLSettings, native_environments: list[str]) -> None:
    """One warning each for the accepted keys that change nothing on gym-bridge's Gym path."""
    pump = async_rl.without_effect()
    if pump:
        logger.warning(
            "async_rl.%s: NeMo-RL's SingleController pump settings; gym-bridge's GRPO loop dispatches a step's "
            "prompts together and bounds staleness by grpo.async_grpo.max_trajectory_age_steps, so they have no effect",
            ", async_rl.".join(pump),
        )
    if native_environments:
        logger.warning(
            "env.%s: native environment configs; the NeMo-Gym path starts only env.nemo_gym's servers (as NeMo-RL's "
            "Gym runners do), so they have no effect",
            ", env.".join(native_environments),
        )
