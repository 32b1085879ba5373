"""``gym-bridge train``: a NeMo-RL GRPO config (plus ``key=value`` overrides) trained into one run folder.

Reads the config (:func:`~gym_bridge.config.overrides.load_with_overrides`: ``defaults:`` parents, ``${...}``,
``_override_``, NeMo-RL's override grammar), checks the keys every run needs and the ``logger`` section before
anything starts, opens the experiment loggers (:mod:`gym_bridge.training.loggers`), starts the run
(:func:`~gym_bridge.recipes.grpo_run.build_grpo_run`), trains with a progress bar over the steps, and writes
``training.png`` / ``training.html`` (:mod:`gym_bridge.training.plots`). The run folder holds ``config.yaml`` (the
config as trained, its ``${oc.env:NAME}`` values, often secrets, written as those interpolations), ``metrics.jsonl``,
``val_results.jsonl``, the loggers' files under ``logs/`` and ``checkpoint/`` (a transformers folder:
``from_pretrained`` loads it; ``gym-bridge serve --model`` and eval's ``embedded_policy`` take it). With ``--resume``
the checkpoint's files are checked before anything starts (:func:`~gym_bridge.recipes.grpo_run.check_checkpoint`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from gym_bridge.config.loading import without_env_values
from gym_bridge.config.logger import logger_settings
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject
from gym_bridge.training.loggers import LoggerPlan, open_loggers
from gym_bridge.training.loop import GRPOTrainer
from gym_bridge.training.metrics import MetricsLine
from gym_bridge.training.plots import TrainingPlots, write_training_plots

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


class TrainRunError(GymBridgeError):
    """The run folder does not fit the command: a finished or started run without ``--resume``, or nothing to
    resume."""


@dataclass(frozen=True)
class TrainOutcome:
    """What a training run left: its folder, metrics lines of this invocation, plots and checkpoint."""

    run_dir: Path
    lines: list[MetricsLine]
    plots: TrainingPlots | None
    checkpoint: Path
    loggers: LoggerPlan


def step_line(m: Mapping[str, object]) -> str:
    """One metrics line in words: a validation's accuracies, or a step's reward, lengths and logprob gaps."""
    g = m.get
    if g("kind") == "val":
        sets = ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in sorted(m.items()) if k.endswith("accuracy"))
        return f"validation after {g('step')} steps: {sets} ({g('time/val_s', 0.0):.0f}s)"
    if not g("train/groups"):
        return f"step {g('step')}: no fresh groups ({g('staleness/dropped')} stale dropped)"
    if g("train/skipped_zero_advantage"):
        return f"step {g('step')}: reward {g('train/mean_reward'):.3f}, every advantage zero: no update"
    return (
        f"step {g('step')}: reward {g('train/mean_reward'):.3f} pass {g('train/pass_rate'):.2f} "
        f"len {g('train/mean_generated_tokens'):.1f} lr {g('train/lr', 0.0):.1e} "
        f"|dlogp| engine {g('train/engine_mismatch_abs_diff_mean', 0.0):.1e} "
        f"lag {g('train/policy_lag_abs_diff_mean', 0.0):.1e} step {g('train/policy_step_abs_diff_mean', 0.0):.1e} "
        f"rollout {g('time/rollout_s', 0.0):.1f}s train {g('time/train_s', 0.0):.1f}s "
        f"refit {g('time/refit_s', 0.0):.2f}s rollouts {g('train/rollout_sha256')}"
    )


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    """Without ``resume`` the folder must hold no run; with it, a run to continue."""
    started = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoint").exists()
    if started and not resume:
        raise TrainRunError(
            f"{run_dir} already holds a training run; continue it with --resume, or choose another --out"
        )
    if resume and not started:
        raise TrainRunError(f"--resume: {run_dir} holds no training run to continue")


def train(
    config: JsonObject,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_line: Callable[[MetricsLine], object] | None = None,
) -> TrainOutcome:
    """Train ``config`` into ``run_dir`` (resumed from its checkpoint with ``resume``); Ray is started if needed."""
    from gym_bridge.config.run_settings import grpo_run_settings
    from gym_bridge.ray_utils import init_ray
    from gym_bridge.recipes.grpo_run import check_checkpoint, start_grpo_run

    run_dir = Path(run_dir)
    settings = grpo_run_settings(config)  # every key read and checked before anything starts
    plan = logger_settings(config).plan(run_dir)
    _check_run_dir(run_dir, resume)
    if resume:
        check_checkpoint(run_dir)  # a planted or broken checkpoint file is one line here, before Ray and Gym start
    written = without_env_values(config)  # secrets from the environment stay out of the run folder and the loggers
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(written, sort_keys=False))
    init_ray()
    run = start_grpo_run(settings, run_dir, resume=resume)
    lines: list[MetricsLine] = []
    try:
        loggers = open_loggers(plan, written)
        run.trainer.metric_sinks.append(loggers)
        try:
            lines = _run_with_progress(run.trainer, progress, on_line)
        finally:
            loggers.close()
    finally:
        run.close()
    plots = write_training_plots(run_dir)
    return TrainOutcome(run_dir, lines, plots, run.trainer.checkpoint_dir, plan)


def _run_with_progress(
    trainer: GRPOTrainer, progress: bool, on_line: Callable[[MetricsLine], object] | None
) -> list[MetricsLine]:
    """``trainer.run()`` with a tqdm bar over the steps (each line written above it), or plain log lines."""
    from tqdm import tqdm

    bar = tqdm(
        total=trainer.max_steps, initial=trainer.state.step, desc="train", unit="step", disable=not progress, leave=True
    )

    def seen(line: MetricsLine) -> None:
        text = step_line(line)
        if progress:
            bar.write(text)
        else:
            logger.info(text)
        if line.get("kind") != "val":
            bar.update(1)
            reward = line.get("train/mean_reward")
            if isinstance(reward, float):
                bar.set_postfix(reward=f"{reward:.3f}")
        if on_line is not None:
            on_line(line)

    try:
        return asyncio.run(trainer.run(on_step=seen))
    finally:
        bar.close()
