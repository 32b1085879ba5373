"""Assemble a GRPO run through NeMo-Gym from a NeMo-RL-style config: engine, server, Gym, manager, policy.

The settings come from :mod:`gym_bridge.config.grpo` and :mod:`gym_bridge.config.training`. The engine is
 :class:`~gym_bridge.generation.hf.HFGeneration` behind our
:class:`~gym_bridge.serving.OpenAIServer` (a thread of this process), which Gym's model
server calls; the trained copy is an :class:`~gym_bridge.policy.hf.HFPolicy`. A run folder
with a checkpoint resumes from it: both copies load the checkpoint's weights. ``grpo.seed`` seeds
torch before the models load, and on the CPU the run uses ``torch.use_deterministic_algorithms``
(restored by :meth:`GRPORun.close`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gym_bridge.config.grpo import (
    config_section,
    engine_batch_size,
    load_gym_rows,
    loop_config_from,
    policy_config,
    result_logging,
    row_routing,
    train_data_path,
    validation_options,
    validation_sets,
)
from gym_bridge.config.training import TrainingConfigError, nemo_gym_rollout_settings
from gym_bridge.data import datum_from_gym_row
from gym_bridge.generation.hf import HFGeneration, HFGenerationConfig
from gym_bridge.gym.client import GymClient
from gym_bridge.gym.routing import GymRoutes
from gym_bridge.gym.rows import ValidGymRow
from gym_bridge.json_types import JsonMapping
from gym_bridge.policy.hf import HFPolicy
from gym_bridge.recipes.launch import NemoGymRollouts, start_nemo_gym_rollouts
from gym_bridge.serving import OpenAIServer
from gym_bridge.training.loop import GRPOLoopConfig, GRPOTrainer, load_trainer_state
from gym_bridge.training.rewards import RewardShaper
from gym_bridge.training.validation import GymValidator, ValidationSet
from gym_bridge.types import ActorHandle, Tokenizer

__all__ = ["GRPORun", "build_grpo_run", "reward_shaper_from", "validator_from"]

logger = logging.getLogger(__name__)


def validator_from(
    config: JsonMapping,
    actors: list[ActorHandle],
    out_dir: Path,
    *,
    pass_threshold: float,
    reward_shaper: RewardShaper | None = None,
    deadline_s: float | None = None,
    seed: int | None = None,
) -> GymValidator | None:
    """A :class:`GymValidator` over the run's Gym actors, or None when the config has no validation data.

    ``reward_shaper`` shapes validation rewards as training's are (NeMo-RL's ``validate`` does the same);
    ``deadline_s`` bounds each held-out group and ``seed`` seeds its rows, as training's groups are."""
    sets = validation_sets(config)
    if not sets:
        return None
    sets = [
        ValidationSet(held.name, routed_rows([ValidGymRow(r) for r in held.rows], actors[0], f"validation {held.name}"))
        for held in sets
    ]
    options = validation_options(config)
    return GymValidator(
        GymClient(actors, timer_prefix="timing/validation"),
        sets,
        sampling=options.sampling,
        max_new_tokens=options.max_new_tokens,
        num_generations=options.num_generations,
        pass_threshold=pass_threshold,
        results_path=out_dir / "val_results.jsonl",
        reward_shaper=reward_shaper,
        deadline_s=deadline_s,
        seed=seed,
    )


def routed_rows(rows: list[ValidGymRow], actor: ActorHandle, what: str = "training") -> list[ValidGymRow]:
    """``what`` rows with the agent the launched Gym config routes each to (``task_source`` rows resolved by Gym's own
    resolver); :class:`TrainingConfigError` naming every row that routes nowhere, before any step runs."""
    import ray

    routes: GymRoutes = ray.get(actor.routes.remote(), timeout=60)
    routed, problems = routes.route_all(rows, [f"{what} row {i}" for i in range(len(rows))])
    if problems:
        raise TrainingConfigError(
            f"{len(problems)} {what} row(s) route to no running agent: " + "; ".join(problems[:5])
        )
    return [row if isinstance(row, ValidGymRow) else ValidGymRow(row) for row in routed]


def reward_shaper_from(loop_cfg: GRPOLoopConfig, tokenizer: Tokenizer) -> RewardShaper:
    """The loop's effort levels, reward penalties and thinking tags over ``tokenizer``."""
    return RewardShaper(
        tokenizer,
        effort_levels=loop_cfg.effort_levels,
        reward_penalties=loop_cfg.reward_penalties,
        thinking_tags=loop_cfg.thinking_tags,
    )


@dataclass
class GRPORun:
    """Everything a run started; :meth:`close` stops it all (Gym servers, actors, server, engine)."""

    trainer: GRPOTrainer
    engine: HFGeneration
    server: OpenAIServer
    rollouts: NemoGymRollouts
    policy: HFPolicy
    deterministic_before: bool = False
    """``torch.are_deterministic_algorithms_enabled()`` before the run set it; :meth:`close` restores it."""

    def close(self) -> None:
        try:
            self.rollouts.shutdown()
        finally:
            self.server.stop_thread()
            self.engine.shutdown()
            self.policy.shutdown()
            torch.use_deterministic_algorithms(self.deterministic_before)


def build_grpo_run(config: JsonMapping, out_dir: str | Path, *, resume: bool = True) -> GRPORun:
    """Start the engine, its server, Gym and the manager; load the policy; resume from ``out_dir`` if it can.

    Ray must be initialised (:func:`gym_bridge.ray_utils.init_ray`).
    """
    out_dir = Path(out_dir)
    policy_cfg = config_section(config, "policy")
    seed = int(config_section(config, "grpo").get("seed", 0))
    torch.manual_seed(seed)
    logger.info("grpo.seed %d", seed)
    checkpoint = out_dir / "checkpoint"
    state = load_trainer_state(checkpoint) if resume else None
    weights = str(checkpoint) if state is not None else str(policy_cfg["model_name"])
    if state is not None:
        logger.info("resuming from %s at step %d (weight version %d)", checkpoint, state.step, state.weight_version)
    max_len = int(policy_cfg["max_total_sequence_length"])
    generation = dict(config_section(config, "policy.generation"))
    engine = HFGeneration(
        HFGenerationConfig.from_generation_config(
            generation,
            model=weights,
            max_model_len=max_len,
            seed=seed + (state.step if state else 0),
            max_batch_size=engine_batch_size(config) or HFGenerationConfig.model_fields["max_batch_size"].default,
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
        rollouts = start_nemo_gym_rollouts(settings, engine.tokenizer, **result_logging(settings, out_dir))
    except BaseException:
        server.stop_thread()
        engine.shutdown()
        raise
    try:
        policy = HFPolicy(policy_config(config, weights, loop_cfg))
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        if policy.device.type == "cpu" and engine.device.type == "cpu":
            # CPU kernels are deterministic already, so this costs nothing; on a GPU it would need
            # CUBLAS_WORKSPACE_CONFIG and slower kernels, and still not make batched decoding batch-invariant.
            torch.use_deterministic_algorithms(True)
        if state is not None:
            policy.load_optimizer(checkpoint)
            engine.update_weights(policy.state_dict_for_refit(), state.weight_version)
        rows = routed_rows(load_gym_rows(train_data_path(config), row_routing(config)), rollouts.actor)
        dataset = [datum_from_gym_row(row, idx=i) for i, row in enumerate(rows)]
        trainer = GRPOTrainer(
            loop_cfg,
            manager=rollouts.manager,
            policy=policy,
            engine=engine,
            dataset=dataset,
            out_dir=out_dir,
            state=state,
            validator=validator_from(
                config,
                rollouts.actors,
                out_dir,
                pass_threshold=loop_cfg.pass_threshold,
                reward_shaper=reward_shaper_from(loop_cfg, engine.tokenizer),
                deadline_s=rollouts.manager.timeouts.rollout_s,
                seed=settings.launch.manager_options.get("seed"),
            ),
        )
    except BaseException:
        rollouts.shutdown()
        server.stop_thread()
        engine.shutdown()
        raise
    return GRPORun(
        trainer=trainer,
        engine=engine,
        server=server,
        rollouts=rollouts,
        policy=policy,
        deterministic_before=deterministic_before,
    )
