"""GRPO settings from a NeMo-RL-style config: the loss, the loop, the policy, the data and validation sets.

Keys read (NeMo-RL's names where NeMo-RL has them):

- ``policy.model_name`` (a local folder or a built-in model name), ``policy.generation`` (sampling and
  ``max_new_tokens``; the context length, ``policy.max_total_sequence_length``, has one reader:
  :func:`~gym_bridge.config.training.context_length`), ``policy.optimizer.kwargs`` (``lr``,
  ``weight_decay``, ``betas``), ``policy.scheduler`` (NeMo-RL's list of ``torch.optim.lr_scheduler`` classes
  and milestones), ``policy.max_grad_norm``, ``policy.train_micro_batch_size``,
  ``policy.freeze_embeddings`` (ours);
- ``grpo.num_prompts_per_step``, ``grpo.num_generations_per_prompt``, ``grpo.max_num_steps``,
  ``grpo.normalize_rewards``, ``grpo.use_leave_one_out_baseline`` (``grpo.adv_estimator.*`` of the same names
  when set: NeMo-RL's estimator reads those), ``grpo.adv_estimator.name`` (``grpo``, or ``gdpo`` over a
  multi-reward environment's components, with ``grpo.adv_estimator.reward_weights``), ``grpo.seed``,
  ``grpo.overlong_filtering``,
  ``grpo.masked_samples_in_baseline`` (ours; NeMo-RL's behaviour is true),
  ``grpo.invalid_tool_call_advantage``, ``grpo.malformed_thinking_advantage``, ``grpo.advantage_clip_low``,
  ``grpo.advantage_clip_high``, ``grpo.seq_logprob_error_threshold``, ``reward_penalties`` and
  ``env.nemo_gym.effort_levels`` / ``thinking_tags`` (through the rollout settings),
  ``grpo.use_dynamic_sampling``, ``grpo.batch_multiplier``, ``grpo.dynamic_sampling_max_gen_batches``,
  ``grpo.async_grpo.enabled``, ``grpo.async_grpo.max_trajectory_age_steps``, ``grpo.val_period``,
  ``grpo.val_at_start``, ``grpo.val_at_end``, ``grpo.max_val_samples``,
  ``grpo.val_num_generations_per_prompt`` and ``grpo.pass_threshold`` (ours);
- ``loss_fn`` (:class:`~gym_bridge.training.loss.ClippedPGLossConfig`'s keys; a NeMo-RL loss variant this
  loss does not implement is refused); ``checkpointing.enabled``, ``checkpointing.save_period``;
- ``env.nemo_gym`` (see :mod:`gym_bridge.config.training`); ``data.train.data_path`` (or ``data.path``),
  ``data.validation.data_path`` and ``data.validation.extra_sets`` (ours: name -> path; read by
  :mod:`gym_bridge.config.run_data`), ``data.shuffle``.

``policy.generation.temperature`` reaches the policy too: the trainer scores tokens with the
logits divided by the temperature they were sampled with.

A NeMo-RL option this trainer does not implement is refused with :class:`TrainingConfigError` naming its
dotted key when set away from NeMo-RL's default; the keys of NeMo-RL's Gym recipes that change nothing on
this trainer by nature are listed, with the reason, in :data:`gym_bridge.config.no_effect.NO_EFFECT_KEYS`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.config.chat_template import TEMPLATE_KEYS
from gym_bridge.config.distillation import distillation_config
from gym_bridge.config.keys import TrainingConfigError, config_section, config_value
from gym_bridge.config.training import NemoGymRolloutSettings, run_seed
from gym_bridge.config.values import count
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.protocol.row_file import read_row_file, read_row_text
from gym_bridge.gym.protocol.rows import ValidGymRow
from gym_bridge.gym.servers.config_files import GymConfigError, routing_from
from gym_bridge.json_types import JsonMapping
from gym_bridge.policy.hf import HFPolicyConfig
from gym_bridge.policy.lr_scheduler import build_lr_scheduler
from gym_bridge.training.loop_config import GRPOLoopConfig
from gym_bridge.training.loss import ClippedPGLossConfig
from gym_bridge.types import GenerationSamplingParams

_LOSS_VARIANTS_NOT_IMPLEMENTED = {
    "disable_ppo_ratio": False,
    "use_kl_in_reward": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}
_NULLABLE_LOSS_KEYS = ("kl_input_clamp_value", "kl_output_clamp_value")
"""Loss keys whose None means something (no clamp); for the others None means NeMo-RL's default."""
_OUR_LOSS = (
    "gym-bridge's ClippedPGLoss (clipped PG, token- or sequence-level with GSPO's sequence ratios, optional truncated "
    "importance sampling and a reference KL, on-policy weighted or not)"
)
_NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "grpo.val_start_at": (-1,),
    "grpo.stop_at_validation_metric": (None,),
    "grpo.stop_at_validation_threshold": (None,),
    "grpo.reward_scaling.enabled": (False,),
    "grpo.reward_shaping.enabled": (False,),
    "policy.router_replay.enabled": (False,),
    "policy.megatron_cfg.enabled": (False,),
    "policy.draft.enabled": (False,),
    "policy.is_vlm": (False,),
    "policy.quant_cfg": (None,),
    "policy.hf_config_overrides": (None, {}),
    "policy.optimizer.name": ("torch.optim.AdamW",),
    "policy.optimizer.kwargs.eps": (1e-8,),
    **dict.fromkeys(TEMPLATE_KEYS, (None,)),
    "on_policy_distillation.enabled": (False,),
    "data_plane.enabled": (False,),
    "data.use_multiple_dataloader": (False,),
    "data.train.dataset_name": ("NemoGymDataset",),
    "data.validation.dataset_name": ("NemoGymDataset",),
    "data.default.dataset_name": ("NemoGymDataset",),
    "data.default.prompt_file": (None,),
    "data.default.system_prompt_file": (None,),
}
"""NeMo-RL keys (with the values that leave its behaviour at what this trainer does) whose features this trainer
lacks: the GRPO loop (delayed validation, early stop, reward scaling and DAPO shaping), the
policy (Megatron, MTP drafts, MoE routing replay, VLMs, quantisation, HF config overrides, an
optimizer other than torch AdamW with eps 1e-8, chat templates other than the tokenizer's own), distillation,
the data plane, and NeMo-RL's data pipeline (datasets other than JSONL Gym rows, prompt files)."""
logger = logging.getLogger(__name__)
_ABSENT = object()
_ADVANTAGE_ESTIMATORS = ("grpo", "gdpo", "opd", "reinforce_plus_plus")
"""NeMo-RL 7ea279a's estimators (``_create_advantage_estimator``); ``grpo`` is its default."""
_IMPLEMENTED_ESTIMATORS = ("grpo", "gdpo")
_POLICY_KEYS = {
    "learning_rate": "policy.optimizer.kwargs.lr",
    "weight_decay": "policy.optimizer.kwargs.weight_decay",
    "betas": "policy.optimizer.kwargs.betas",
    "max_grad_norm": "policy.max_grad_norm",
    "temperature": "policy.generation.temperature",
    "freeze_embeddings": "policy.freeze_embeddings",
    "logprob_batch_size": "policy.logprob_batch_size",
    "scheduler": "policy.scheduler",
}
_LOOP_KEYS = {
    "seed": "grpo.seed",
    "shuffle_data": "data.shuffle",
    "val_period": "grpo.val_period",
    "num_prompts_per_step": "grpo.num_prompts_per_step",
    "max_num_steps": "grpo.max_num_steps",
    "train_micro_batch_size": "policy.train_micro_batch_size",
    "checkpoint_every_steps": "checkpointing.save_period",
    "adv_estimator": "grpo.adv_estimator.name",
    "reward_weights": "grpo.adv_estimator.reward_weights",
}


def loss_config_from(config: JsonMapping) -> ClippedPGLossConfig:
    """``loss_fn`` as a :class:`ClippedPGLossConfig`; a NeMo-RL variant set away from its default is an error."""
    section = config_section(config, "loss_fn")
    _refuse_unimplemented("loss_fn", section, _LOSS_VARIANTS_NOT_IMPLEMENTED, _OUR_LOSS)
    known = ClippedPGLossConfig.model_fields
    try:
        return ClippedPGLossConfig(
            **{k: v for k, v in section.items() if k in known and (v is not None or k in _NULLABLE_LOSS_KEYS)}
        )
    except ValidationError as exc:
        raise TrainingConfigError(_problems(exc, {name: f"loss_fn.{name}" for name in known})) from None


def _problems(exc: ValidationError, keys: Mapping[str, str]) -> str:
    """A validation error's problems, each named by the config key it came from."""
    return "; ".join(
        f"{keys.get(str(err['loc'][0]), str(err['loc'][0])) if err['loc'] else 'config'}: "
        f"{err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()
    )


def _refuse_unimplemented(name: str, section: JsonMapping, defaults: Mapping[str, object], by: str) -> None:
    """A NeMo-RL option we do not implement, set to anything but its default, is an error that names its key."""
    refused = [
        f"{name}.{key}={section[key]!r}"
        for key, default in defaults.items()
        if key in section and section[key] != default
    ]
    if refused:
        raise TrainingConfigError(f"{', '.join(refused)} is not implemented by {by}; remove the key or set its default")


def _refuse_not_implemented(config: JsonMapping) -> None:
    """Each :data:`_NOT_IMPLEMENTED` key set to another value is an error naming it, in one line."""
    for dotted, allowed in _NOT_IMPLEMENTED.items():
        value = config_value(config, dotted, _ABSENT)
        if value is not _ABSENT and value not in allowed:
            raise TrainingConfigError(
                f"{dotted}={value!r} is not implemented by gym-bridge's GRPO trainer; remove the key or set "
                f"{' or '.join(repr(a) for a in allowed)}"
            )


def _check_batch_size(config: JsonMapping, grpo: JsonMapping) -> None:
    """``policy.train_global_batch_size`` must be one step's samples: the loop takes one optimizer step per step."""
    gbs = config_section(config, "policy").get("train_global_batch_size")
    step = (grpo.get("num_prompts_per_step") or 0) * (grpo.get("num_generations_per_prompt") or 0)
    if gbs is not None and step and gbs != step:
        raise TrainingConfigError(
            f"policy.train_global_batch_size={gbs}: gym-bridge's GRPO loop takes one optimizer step per step, on "
            f"num_prompts_per_step * num_generations_per_prompt = {step} samples; set it to {step} or remove it"
        )


def _advantage_key(grpo: JsonMapping, name: str) -> object:
    """``grpo.adv_estimator.<name>`` (what NeMo-RL's estimator reads), else ``grpo.<name>`` (older NeMo-RL configs).
    Both set and different: the estimator's value, as in NeMo-RL, with one warning (NeMo-RL reads ``grpo.<name>``
    only for its dynamic-sampling filter and logged baseline; our filter reads the reward spread)."""
    estimator, top = config_section(grpo, "adv_estimator").get(name), grpo.get(name)
    if estimator is not None and top is not None and estimator != top:
        logger.warning(
            "grpo.adv_estimator.%s=%r sets the advantages, as in NeMo-RL; grpo.%s=%r is not used for them", name,
            estimator, name, top,
        )  # fmt: skip
    return estimator if estimator is not None else top


def _val_period(value: object) -> object:
    """``grpo.val_period``: a negative period is no periodic validation, as NeMo-RL reads it (``val_period > 0``)."""
    return 0 if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def _estimator(grpo: JsonMapping) -> str:
    """``grpo.adv_estimator.name``: ``grpo`` (NeMo-RL's default) or ``gdpo``; any other is refused by name."""
    name = config_section(grpo, "adv_estimator").get("name", "grpo")
    if name in _IMPLEMENTED_ESTIMATORS:
        return str(name)
    known = f"NeMo-RL's {name!r} estimator" if name in _ADVANTAGE_ESTIMATORS else f"an unknown estimator {name!r}"
    raise TrainingConfigError(
        f"grpo.adv_estimator.name={name!r}: {known} is not implemented by gym-bridge's GRPO trainer, which has "
        "NeMo-RL's 'grpo' and 'gdpo' estimators"
    )


def loop_config_from(config: JsonMapping, settings: NemoGymRolloutSettings) -> GRPOLoopConfig:
    """The loop's settings from ``grpo``, ``loss_fn``, ``policy``, ``checkpointing``, ``data.shuffle`` and the
    rollout settings (``grpo.async_grpo``, ``async_rl.stall_watchdog``,
    ``async_rl.rollout_failure.min_step_batch_fraction``)."""
    grpo = config_section(config, "grpo")
    _refuse_not_implemented(config)
    _check_batch_size(config, grpo)
    loss = loss_config_from(config)
    if grpo.get("skip_reference_policy_logprobs_calculation") and loss.reference_policy_kl_penalty:
        raise TrainingConfigError(
            "grpo.skip_reference_policy_logprobs_calculation: true needs loss_fn.reference_policy_kl_penalty: 0 "
            "(NeMo-RL asserts the same); the loop computes reference logprobs only for the KL penalty"
        )
    checkpointing = config_section(config, "checkpointing")
    values: dict[str, object] = {
        "seed": run_seed(config),
        "shuffle_data": config_section(config, "data").get("shuffle"),
        "val_period": _val_period(grpo.get("val_period")),
        "val_at_start": grpo.get("val_at_start"),
        "val_at_end": grpo.get("val_at_end"),
        "num_prompts_per_step": grpo.get("num_prompts_per_step"),
        "max_num_steps": grpo.get("max_num_steps"),
        "max_num_epochs": grpo.get("max_num_epochs", 1),
        "adv_estimator": _estimator(grpo),
        "reward_weights": config_section(grpo, "adv_estimator").get("reward_weights"),
        "use_leave_one_out_baseline": _advantage_key(grpo, "use_leave_one_out_baseline"),
        "normalize_rewards": _advantage_key(grpo, "normalize_rewards"),
        "overlong_filtering": grpo.get("overlong_filtering"),
        "masked_samples_in_baseline": grpo.get("masked_samples_in_baseline"),
        "invalid_tool_call_advantage": grpo.get("invalid_tool_call_advantage"),
        "malformed_thinking_advantage": grpo.get("malformed_thinking_advantage"),
        "advantage_clip_low": grpo.get("advantage_clip_low"),
        "advantage_clip_high": grpo.get("advantage_clip_high"),
        "seq_logprob_error_threshold": grpo.get("seq_logprob_error_threshold"),
        "effort_levels": settings.effort_levels,
        "reward_penalties": settings.reward_penalties,
        "thinking_tags": settings.launch.gym.thinking_tags,
        "pass_threshold": grpo.get("pass_threshold"),
        "use_dynamic_sampling": grpo.get("use_dynamic_sampling"),
        "batch_multiplier": grpo.get("batch_multiplier"),
        "dynamic_sampling_max_gen_batches": grpo.get("dynamic_sampling_max_gen_batches"),
        "async_rollouts": settings.async_grpo.enabled,
        "max_trajectory_age_steps": settings.async_grpo.max_trajectory_age_steps,
        "in_flight_weight_updates": settings.async_grpo.in_flight_weight_updates,
        "stall_timeout_s": settings.async_rl.stall_watchdog.stall_timeout_s,
        "stall_action": settings.async_rl.stall_watchdog.stall_action,
        "stall_interval_s": settings.async_rl.stall_watchdog.interval_s,
        "min_step_batch_fraction": settings.min_step_batch_fraction,
        "loss": loss,
        "distillation": distillation_config(config),
        "train_micro_batch_size": config_section(config, "policy").get("train_micro_batch_size"),
        "checkpoint_every_steps": checkpointing.get("save_period") if checkpointing.get("enabled", True) else None,
    }
    try:
        return GRPOLoopConfig(**{key: value for key, value in values.items() if value is not None})
    except ValidationError as exc:
        keys = {name: _LOOP_KEYS.get(name, f"grpo.{name}") for name in GRPOLoopConfig.model_fields}
        keys.update({"effort_levels": "env.nemo_gym.effort_levels", "reward_penalties": "reward_penalties"})
        raise TrainingConfigError(_problems(exc, keys)) from None


def result_logging(settings: NemoGymRolloutSettings, out_dir: Path) -> dict[str, Any]:
    """Every Gym result goes to ``<run>/nemo_gym_full_results.jsonl`` (one line per completion), NeMo-RL's local
    per-step dump, unless ``env.should_log_nemo_gym_responses`` says Gym logs the responses itself (NeMo-RL's
    meaning); ``logger.wandb.log_nemo_gym_full_result_tables`` writes it too (NeMo-RL's tables hold the same JSON)."""
    if not settings.log_nemo_gym_responses or settings.log_full_result_tables:
        return {"full_results_path": out_dir / "nemo_gym_full_results.jsonl"}
    return {}


def checkpointing_enabled(config: JsonMapping) -> bool:
    """NeMo-RL's ``checkpointing.enabled`` (absent: true): false writes no checkpoint at all, at the end either
    (the loop's periodic checkpoints are off too: :func:`loop_config_from`)."""
    value = config_value(config, "checkpointing.enabled", True)
    if not isinstance(value, bool):
        raise TrainingConfigError(f"checkpointing.enabled must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class ValidationOptions:
    """How validation rolls out: ``grpo.val_num_generations_per_prompt``, ``grpo.max_val_samples`` and
    ``policy.generation``'s validation sampling profile (``val_temperature``, ``val_top_p``, ``val_top_k``)."""

    num_generations: int
    max_samples: int | None
    sampling: GenerationSamplingParams
    max_new_tokens: int | None


_SAMPLING_RANGES = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0)}
"""The sampling numbers of ``policy.generation`` (and their ``val_`` twins): each a number in this range (top_p
above its low end)."""


def check_sampling(generation: JsonMapping) -> None:
    """``policy.generation``'s temperatures and top_p values are numbers in range, else one line naming the key."""
    for name, (low, high) in _SAMPLING_RANGES.items():
        for key in (name, f"val_{name}"):
            value = generation.get(key)
            if value is None:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not (low < value <= high if name == "top_p" else low <= value <= high):
                span = f"({low:g}, {high:g}]" if name == "top_p" else f"[{low:g}, {high:g}]"
                raise TrainingConfigError(
                    f"policy.generation.{key} must be a number in {span}, got {shown(repr(value)[:40])}"
                )


def validation_options(config: JsonMapping) -> ValidationOptions:
    grpo, generation = config_section(config, "grpo"), config_section(config, "policy.generation")
    check_sampling(generation)
    generations = grpo.get("val_num_generations_per_prompt") or 1
    return ValidationOptions(
        num_generations=count(generations, "grpo.val_num_generations_per_prompt"),
        max_samples=grpo.get("max_val_samples"),
        sampling=GenerationSamplingParams.from_generation_config(generation, validation=True),
        max_new_tokens=generation.get("max_new_tokens"),
    )


def row_routing(config: JsonMapping) -> RowRouting:
    """Gym's routing keys under ``env.nemo_gym`` (``agent_name``, ``agent_map``, ``fan_out``), as Gym names them
    (:func:`~gym_bridge.gym.servers.config_files.routing_from`); a problem is a :class:`TrainingConfigError`."""
    try:
        return routing_from(config_section(config, "env.nemo_gym"))
    except GymConfigError as exc:
        raise TrainingConfigError(f"env.nemo_gym: {exc}") from None


def load_gym_rows(path: str | Path, routing: RowRouting | None = None) -> list[ValidGymRow]:
    """The tasks of a JSONL file of Gym rows, read as every entrance reads them
    (:func:`~gym_bridge.gym.protocol.row_file.read_row_file`); bad lines are one error naming each."""
    path = Path(path)
    try:
        text = read_row_text(path)
    except OSError as exc:
        raise TrainingConfigError(f"cannot read {shown(path)}: {exc.strerror or exc}") from None
    except UntrustedInputError as exc:
        raise TrainingConfigError(str(exc)) from None
    rows, problems = read_row_file(path, text, routing=routing)
    if problems:
        raise TrainingConfigError(f"{len(problems)} bad line(s): " + "; ".join(problems[:5]))
    if not rows:
        raise TrainingConfigError(f"{path}: no rows")
    return [item.row for item in rows]


def policy_config(config: JsonMapping, weights: str, loop_cfg: GRPOLoopConfig) -> HFPolicyConfig:
    """The trained copy's settings: optimizer, clipping, frozen embeddings, and the sampling temperature
    (so its logprobs are those of the distribution the engine sampled from)."""
    policy_cfg = config_section(config, "policy")
    optimizer = config_section(config, "policy.optimizer.kwargs")
    generation = config_section(config, "policy.generation")
    check_sampling(generation)
    scheduler = policy_cfg.get("scheduler") or None
    _check_scheduler(scheduler)
    values = {
        "model": weights,
        "learning_rate": optimizer.get("lr", 1e-5),
        "weight_decay": optimizer.get("weight_decay", 0.0),
        "betas": optimizer.get("betas", (0.9, 0.999)),
        "max_grad_norm": policy_cfg.get("max_grad_norm", 1.0),
        "temperature": generation.get("temperature", 1.0),
        "keep_reference_model": loop_cfg.loss.reference_policy_kl_penalty > 0,
        "freeze_embeddings": bool(policy_cfg.get("freeze_embeddings", False)),
        "scheduler": scheduler,
        **({"logprob_batch_size": policy_cfg["logprob_batch_size"]} if policy_cfg.get("logprob_batch_size") else {}),
    }
    try:  # pydantic reads each number (a bad one named by its key), as the float() and int() before it did
        return HFPolicyConfig.model_validate(values)
    except ValidationError as exc:
        raise TrainingConfigError(_problems(exc, _POLICY_KEYS)) from None


def engine_batch_size(config: JsonMapping) -> int | None:
    """``policy.generation.vllm_kwargs.max_num_seqs`` (vLLM's most sequences in one decode batch, which NeMo-RL
    passes to vLLM): our engine's ``max_batch_size``; None when unset."""
    value = config_section(config, "policy.generation.vllm_kwargs").get("max_num_seqs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainingConfigError(
            f"policy.generation.vllm_kwargs.max_num_seqs must be a positive integer, got {value!r}"
        )
    return value


def engine_prefix_caching(config: JsonMapping) -> bool | None:
    """``policy.generation.vllm_kwargs.enable_prefix_caching`` (vLLM's name for it), else NeMo-RL's
    ``policy.generation.vllm_cfg.enable_prefix_caching``: our engine's prefix caching; None when neither is set
    (the engine's default, on). Both set and different is refused: vLLM would get the keyword twice."""
    values = {
        key: config_section(config, f"policy.generation.{key.split('.')[0]}").get("enable_prefix_caching")
        for key in ("vllm_kwargs.enable_prefix_caching", "vllm_cfg.enable_prefix_caching")
    }
    given = {key: value for key, value in values.items() if value is not None}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise TrainingConfigError(f"policy.generation.{key} must be true or false, got {value!r}")
    if len(set(given.values())) > 1:
        raise TrainingConfigError(
            "policy.generation.vllm_kwargs.enable_prefix_caching and policy.generation.vllm_cfg.enable_prefix_caching "
            f"disagree ({given['vllm_kwargs.enable_prefix_caching']} and {given['vllm_cfg.enable_prefix_caching']}); "
            "set one"
        )
    return next(iter(given.values()), None)


def _check_scheduler(spec: Sequence[JsonMapping] | JsonMapping | None) -> None:
    """``policy.scheduler`` builds (on a stand-in optimizer), or a :class:`TrainingConfigError` says why."""
    if spec is None:
        return
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        build_lr_scheduler(optimizer, spec)
    except (ValueError, TypeError) as exc:
        raise TrainingConfigError(f"policy.scheduler: {exc}") from None
