"""Assemble a GRPO run through NeMo-Gym from a NeMo-RL-style config: engine, server, Gym, manager, policy.

Keys read (NeMo-RL's names where NeMo-RL has them):

- ``policy.model_name`` (a local folder or a built-in model name), ``policy.max_total_sequence_length``,
  ``policy.generation`` (sampling and ``max_new_tokens``), ``policy.optimizer.kwargs`` (``lr``,
  ``weight_decay``, ``betas``), ``policy.max_grad_norm``, ``policy.train_micro_batch_size``,
  ``policy.freeze_embeddings`` (ours);
- ``grpo.num_prompts_per_step``, ``grpo.num_generations_per_prompt``, ``grpo.max_num_steps``,
  ``grpo.normalize_rewards``, ``grpo.use_leave_one_out_baseline``, ``grpo.seed``,
  ``grpo.async_grpo.enabled``, ``grpo.async_grpo.max_trajectory_age_steps``, ``grpo.pass_threshold`` (ours);
- ``loss_fn.ratio_clip_min``; ``checkpointing.enabled``, ``checkpointing.save_period``;
- ``env.nemo_gym`` (see :mod:`gym_bridge.build.training_config`); ``data.path`` (Gym rows, JSONL).

The engine is :class:`~gym_bridge.generation.hf.HFGeneration` behind our
:class:`~gym_bridge.serving.OpenAIServer` (a thread of this process), which Gym's model
server calls; the trained copy is an :class:`~gym_bridge.policy.hf.HFPolicy`. A run folder
with a checkpoint resumes from it: both copies load the checkpoint's weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gym_bridge.data import datum_from_gym_row
from gym_bridge.generation.hf import HFGeneration, HFGenerationConfig
from gym_bridge.policy.hf import HFPolicy, HFPolicyConfig
from gym_bridge.build.training_config import (
    NemoGymRollouts,
    NemoGymRolloutSettings,
    TrainingConfigError,
    nemo_gym_rollout_settings,
    start_nemo_gym_rollouts,
)
from gym_bridge.serving import OpenAIServer
from gym_bridge.training.loop import GRPOLoopConfig, GRPOTrainer, load_trainer_state

logger = logging.getLogger(__name__)


def _section(config: Mapping[str, Any], dotted: str) -> Mapping[str, Any]:
    node: Any = config
    for part in dotted.split("."):
        node = (node or {}).get(part) if isinstance(node, Mapping) else None
    return node or {}


def loop_config_from(config: Mapping[str, Any], settings: NemoGymRolloutSettings) -> GRPOLoopConfig:
    """The loop's settings from ``grpo``, ``loss_fn``, ``policy``, ``checkpointing`` and the rollout settings
    (``grpo.async_grpo``, ``async_rl.stall_watchdog``, ``async_rl.rollout_failure.min_step_batch_fraction``)."""
    grpo = _section(config, "grpo")
    checkpointing = _section(config, "checkpointing")
    values: dict[str, Any] = {
        "num_prompts_per_step": grpo.get("num_prompts_per_step"),
        "max_num_steps": grpo.get("max_num_steps"),
        "use_leave_one_out_baseline": grpo.get("use_leave_one_out_baseline"),
        "normalize_rewards": grpo.get("normalize_rewards"),
        "pass_threshold": grpo.get("pass_threshold"),
        "async_rollouts": settings.async_grpo.enabled,
        "max_trajectory_age_steps": settings.async_grpo.max_trajectory_age_steps,
        "in_flight_weight_updates": settings.async_grpo.in_flight_weight_updates,
        "stall_timeout_s": settings.stall_watchdog.stall_timeout_s,
        "stall_action": settings.stall_watchdog.stall_action,
        "stall_interval_s": settings.stall_watchdog.interval_s,
        "min_step_batch_fraction": settings.min_step_batch_fraction,
        "ratio_clip": _section(config, "loss_fn").get("ratio_clip_min"),
        "train_micro_batch_size": _section(config, "policy").get("train_micro_batch_size"),
        "checkpoint_every_steps": checkpointing.get("save_period") if checkpointing.get("enabled", True) else None,
    }
    return GRPOLoopConfig(**{key: value for key, value in values.items() if value is not None})


def _result_logging(settings: NemoGymRolloutSettings, out_dir: Path) -> dict[str, Any]:
    """``env.should_log_nemo_gym_responses`` or ``logger.wandb.log_nemo_gym_full_result_tables``: every Gym result
    goes to ``<run>/nemo_gym_full_results.jsonl`` (one line per completion; NeMo-RL's tables hold the same JSON)."""
    if settings.log_nemo_gym_responses or settings.log_full_result_tables:
        return {"full_results_path": out_dir / "nemo_gym_full_results.jsonl"}
    return {}


def load_gym_rows(path: str | Path) -> list[dict[str, Any]]:
    """Gym rows from a JSONL file; a bad line is an error naming its line number."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(row, dict) or "responses_create_params" not in row:
            raise ValueError(f"{path}:{number}: a Gym row needs 'responses_create_params'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


@dataclass
class GRPORun:
    """Everything a run started; :meth:`close` stops it all (Gym servers, actors, server, engine)."""

    trainer: GRPOTrainer
    engine: HFGeneration
    server: OpenAIServer
    rollouts: NemoGymRollouts
    policy: HFPolicy

    def close(self) -> None:
        try:
            self.rollouts.shutdown()
        finally:
            self.server.stop_thread()
            self.engine.shutdown()
            self.policy.shutdown()


def build_grpo_run(config: Mapping[str, Any], out_dir: str | Path, *, resume: bool = True) -> GRPORun:
    """Start the engine, its server, Gym and the manager; load the policy; resume from ``out_dir`` if it can.

    Ray must be initialised (:func:`gym_bridge.ray_utils.init_ray`).
    """
    out_dir = Path(out_dir)
    policy_cfg = _section(config, "policy")
    seed = int(_section(config, "grpo").get("seed", 0))
    torch.manual_seed(seed)
    checkpoint = out_dir / "checkpoint"
    state = load_trainer_state(checkpoint) if resume else None
    weights = str(checkpoint) if state is not None else str(policy_cfg["model_name"])
    if state is not None:
        logger.info("resuming from %s at step %d (weight version %d)", checkpoint, state.step, state.weight_version)
    max_len = int(policy_cfg["max_total_sequence_length"])
    generation = dict(_section(config, "policy.generation"))
    engine = HFGeneration(
        HFGenerationConfig.from_generation_config(
            generation, model=weights, max_model_len=max_len, seed=seed + (state.step if state else 0)
        )
    )
    server = OpenAIServer(
        engine, engine.tokenizer, served_model_name=str(policy_cfg["model_name"]), max_model_len=max_len
    )
    try:
        base_url = server.start_in_thread()
        settings = nemo_gym_rollout_settings(config, base_urls=[base_url])
        if settings.is_trajectory_collection:
            raise TrainingConfigError(
                "env.nemo_gym.is_trajectory_collection: true collects without training; this GRPO recipe trains. "
                "Use `gym-bridge eval` to roll out a dataset and keep every result"
            )
        loop_cfg = loop_config_from(config, settings)
        rollouts = start_nemo_gym_rollouts(settings, engine.tokenizer, **_result_logging(settings, out_dir))
    except BaseException:
        server.stop_thread()
        engine.shutdown()
        raise
    try:
        optimizer = _section(config, "policy.optimizer.kwargs")
        policy = HFPolicy(
            HFPolicyConfig(
                model=weights,
                learning_rate=float(optimizer.get("lr", 1e-5)),
                weight_decay=float(optimizer.get("weight_decay", 0.0)),
                betas=tuple(optimizer.get("betas", (0.9, 0.999))),
                max_grad_norm=policy_cfg.get("max_grad_norm", 1.0),
                keep_reference_model=False,
                freeze_embeddings=bool(policy_cfg.get("freeze_embeddings", False)),
            )
        )
        if state is not None:
            policy.load_optimizer(checkpoint)
            engine.update_weights(policy.state_dict_for_refit(), state.weight_version)
        rows = load_gym_rows(_section(config, "data")["path"])
        dataset = [datum_from_gym_row(row, idx=i) for i, row in enumerate(rows)]
        trainer = GRPOTrainer(
            loop_cfg,
            manager=rollouts.manager,
            policy=policy,
            engine=engine,
            dataset=dataset,
            out_dir=out_dir,
            state=state,
        )
    except BaseException:
        rollouts.shutdown()
        server.stop_thread()
        engine.shutdown()
        raise
    return GRPORun(trainer=trainer, engine=engine, server=server, rollouts=rollouts, policy=policy)
