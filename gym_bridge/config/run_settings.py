"""One typed value for a whole GRPO run read from a NeMo-RL-style config, read and checked before anything starts.

:func:`grpo_run_keys` reads every key once into :class:`GRPORunKeys` (the checks before start run on it), and
:func:`with_rows` reads the data files' rows into :class:`GRPORunSettings`; :func:`grpo_run_settings` is both.
After them nothing reads a raw config key: the recipe starts the engine, the server, Gym and the trainer from
:class:`GRPORunSettings` alone, so every key has one reader and every default one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Self

from pydantic import ValidationError

from gym_bridge.config.chat_template import chat_template_kwargs
from gym_bridge.config.grpo import (
    ValidationOptions,
    check_sampling,
    checkpointing_enabled,
    engine_batch_size,
    engine_prefix_caching,
    loop_config_from,
    policy_config,
    validation_options,
)
from gym_bridge.config.keys import TrainingConfigError, config_section, config_value
from gym_bridge.config.run_data import RunData, run_data, train_rows, validation_sets
from gym_bridge.config.training import NemoGymRolloutSettings, nemo_gym_rollout_settings, run_seed
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.gym.protocol.rows import ValidGymRow
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.models.registry import ModelNotFoundError, check_model_reference
from gym_bridge.policy.hf import HFPolicyConfig
from gym_bridge.training.loop_config import GRPOLoopConfig
from gym_bridge.training.validation import ValidationSet

REQUIRED_KEYS = (
    "policy.model_name",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "env.nemo_gym.config_paths",
)
"""Keys a GRPO run cannot start without (NeMo-RL's recipes set them all; its config schema requires them), except
that ``env.nemo_gym.gym_head`` (a Gym that is already running) stands for ``env.nemo_gym.config_paths``. The context
length, ``policy.max_total_sequence_length`` (or an engine key of the same value), is required by its one reader,
:func:`~gym_bridge.config.training.context_length`."""
GYM_HEAD_KEY = "env.nemo_gym.gym_head"

ENDPOINT_PENDING = "http://127.0.0.1:0/v1"
"""The endpoint the rollout settings name until the run's own server is up (:meth:`GRPORunSettings.serving_at`)."""


@dataclass(frozen=True)
class GRPORunKeys:
    """Every key a GRPO run through Gym takes from its config, read and checked once; the data files named, their
    rows not yet read (:func:`with_rows`)."""

    seed: int
    """``grpo.seed``: torch, the engine, the loop and every row's sampling seed (one value, one default)."""
    served_model_name: str
    """``policy.model_name``: the weights at the start and the name the endpoint serves them under (with
    ``env.nemo_gym.gym_head``, the running Gym's ``policy_model_name`` once :meth:`serving_at` names it)."""
    engine: HFGenerationConfig
    """The engine from ``policy.generation``, ``policy.generation.vllm_kwargs.max_num_seqs`` and
    ``enable_prefix_caching`` (:func:`~gym_bridge.config.grpo.engine_prefix_caching`), seeded ``seed``."""
    rollout: NemoGymRolloutSettings
    """The Gym path (``env.nemo_gym``, ``async_rl``, ...); its endpoint is :data:`ENDPOINT_PENDING` until
    :meth:`serving_at` names the run's server."""
    loop: GRPOLoopConfig
    policy: HFPolicyConfig
    data: RunData
    """``data.train.data_path``, the validation files and the routing their rows are read with."""
    validation: ValidationOptions
    save_checkpoints: bool
    """``checkpointing.enabled`` (absent: true): false writes no checkpoint, at the end either."""
    chat_template_kwargs: JsonObject
    """Every prompt renders with these (:func:`~gym_bridge.config.chat_template.chat_template_kwargs`): the run's
    server, and the early check of prompt length."""

    def __post_init__(self) -> None:
        if self.engine.max_model_len != self.max_model_len:
            raise TrainingConfigError(
                f"the engine's max_model_len ({self.engine.max_model_len}) is not the rollouts' max_seq_len "
                f"({self.max_model_len}): a run has one context length"
            )

    @property
    def max_model_len(self) -> int:
        """The run's one context length (:func:`~gym_bridge.config.training.context_length`), stored once, as the
        rollouts' ``max_seq_len``: the engine's and the server's ``max_model_len`` are this value."""
        return self.rollout.launch.max_seq_len

    @property
    def gym_head(self) -> str | None:
        """``env.nemo_gym.gym_head``: the head server of a Gym that is already running, whose model server calls the
        endpoint it was started with (the run serves its policy there), or None: the run starts its own Gym."""
        return self.rollout.launch.gym.gym_head

    def serving_at(self, base_urls: list[str], model_name: str | None = None) -> Self:
        """These settings with the rollout endpoint set to the run's own server; ``model_name``: the name it serves
        the policy under when that is not ``policy.model_name`` (a running Gym's ``policy_model_name``)."""
        if model_name is None:
            return replace(self, rollout=self.rollout.with_base_urls(base_urls))
        return replace(
            self, served_model_name=model_name, rollout=self.rollout.with_base_urls(base_urls, model_name=model_name)
        )

    def resumed_from(self, weights: str, step: int) -> Self:
        """These settings with both model copies loading ``weights`` and the engine seeded for ``step``."""
        return replace(
            self,
            engine=self.engine.model_copy(update={"model": weights, "seed": self.seed + step}),
            policy=self.policy.model_copy(update={"model": weights}),
        )


@dataclass(frozen=True)
class GRPORunSettings(GRPORunKeys):
    """Everything a GRPO run through Gym takes from its config: one reader per key, every check already done, and
    the data files' rows read."""

    train_rows: list[ValidGymRow]
    """``data.train.data_path``, read and validated (routed against the launched Gym once it runs)."""
    validation_sets: list[ValidationSet]


def grpo_run_settings(config: JsonMapping) -> GRPORunSettings:
    """Read and check every key a GRPO run uses, then its rows (:func:`grpo_run_keys`, :func:`with_rows`)."""
    return with_rows(grpo_run_keys(config))


def with_rows(keys: GRPORunKeys) -> GRPORunSettings:
    """``keys`` with the training rows and the validation sets read (a bad line is a :class:`TrainingConfigError`
    naming it)."""
    rows = train_rows(keys.data)
    held_out = validation_sets(keys.data, keys.validation.max_samples)
    read = {field.name: getattr(keys, field.name) for field in fields(GRPORunKeys)}
    return GRPORunSettings(**read, train_rows=rows, validation_sets=held_out)


def grpo_run_keys(config: JsonMapping) -> GRPORunKeys:
    """Read and check every key a GRPO run uses; :class:`TrainingConfigError` names the first bad or missing key."""
    attached = bool(config_value(config, GYM_HEAD_KEY, None))
    for key in REQUIRED_KEYS:
        if attached and key == "env.nemo_gym.config_paths":
            continue
        if config_value(config, key, None) is None:
            raise TrainingConfigError(f"the training config has no '{key}' (NeMo-RL's GRPO recipes set it)")
    seed = run_seed(config)
    model_name = str(config_value(config, "policy.model_name"))
    try:
        check_model_reference(model_name)  # a built-in name or an existing folder; nothing is built or loaded
    except ModelNotFoundError as exc:
        raise TrainingConfigError(f"policy.model_name: {exc}") from None
    rollout = nemo_gym_rollout_settings(config, base_urls=[ENDPOINT_PENDING])
    if rollout.is_trajectory_collection:
        raise TrainingConfigError(
            "env.nemo_gym.is_trajectory_collection: true collects without training; this GRPO recipe trains. "
            "Use `gym-bridge eval` to roll out a dataset and keep every result"
        )
    loop = loop_config_from(config, rollout)
    if loop.distillation is not None:
        try:
            check_model_reference(loop.distillation.teacher_model)
        except ModelNotFoundError as exc:
            raise TrainingConfigError(f"teacher.model_name: {exc}") from None
    engine_keys: dict[str, object] = {"model": model_name, "max_model_len": rollout.launch.max_seq_len, "seed": seed}
    batch_size = engine_batch_size(config)
    if batch_size is not None:
        engine_keys["max_batch_size"] = batch_size
    prefix_caching = engine_prefix_caching(config)
    if prefix_caching is not None:
        engine_keys["enable_prefix_caching"] = prefix_caching
    check_sampling(config_section(config, "policy.generation"))  # numbers before the engine's float() of them
    try:
        engine = HFGenerationConfig.from_generation_config(
            config_section(config, "policy.generation"), validation=False, **engine_keys
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"policy.generation.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise TrainingConfigError(problems) from None
    return GRPORunKeys(
        seed=seed,
        served_model_name=model_name,
        engine=engine,
        rollout=rollout,
        loop=loop,
        policy=policy_config(config, model_name, loop),
        data=run_data(config),
        validation=validation_options(config),
        save_checkpoints=checkpointing_enabled(config),
        chat_template_kwargs=chat_template_kwargs(config),
    )
