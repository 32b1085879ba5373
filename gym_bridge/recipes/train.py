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

The config's keys are rewritten in NeMo-RL's key space first (overrides; with ``--smoke``, :func:`smoke_recipe`,
into a short CPU run: :mod:`gym_bridge.config.smoke`), then read once into typed settings
(:func:`~gym_bridge.config.run_settings.grpo_run_keys`). Before Ray starts, every check that can run then does, on
those settings (:func:`~gym_bridge.recipes.pre_start.check_before_start`: the batch against the dataset, the longest
prompt plus ``max_new_tokens`` against the context, the Gym configs and agents), and the GPU-only keys a CPU run
ignores are listed once (a warning with a table).
``checkpointing.enabled: false`` writes no checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import file_kind, make_dir, write_atomic
from gym_bridge.boundary.text import shown
from gym_bridge.config.distillation import with_grpo_keys
from gym_bridge.config.gpu_keys import gpu_only_keys
from gym_bridge.config.keys import config_value
from gym_bridge.config.loading import without_env_values
from gym_bridge.config.logger import logger_settings
from gym_bridge.config.smoke import SMOKE_MODEL, SmokePlan, smoke_config
from gym_bridge.config.smoke_table import format_table, shown_value
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject
from gym_bridge.recipes.pre_start import check_before_start
from gym_bridge.recipes.smoke_facts import smoke_facts
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
    checkpoint: Path | None
    """None: ``checkpointing.enabled: false``, no checkpoint written."""
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


def _check_out(run_dir: Path) -> None:
    """``run_dir`` is a folder or can be made one: neither it nor the nearest path above it that exists is a file.
    Nothing is made here (:func:`_make_run_folder` makes it once every check has passed).

    Raises:
        UntrustedInputError: naming ``run_dir`` and the file in the way.
    """
    existing = next((p for p in (run_dir, *run_dir.parents) if os.path.lexists(p)), None)
    if existing is None or existing.is_dir():
        return
    try:
        mode = os.stat(existing).st_mode
        what = "a file" if stat.S_ISREG(mode) else file_kind(mode)
    except OSError:
        what = "a link to nothing"
    if existing == run_dir:
        raise UntrustedInputError(f"{shown(run_dir)}: exists and is {what}, not a folder")
    raise UntrustedInputError(f"{shown(run_dir)}: cannot be made, {shown(existing)} is {what}")


def _make_run_folder(run_dir: Path, plan: LoggerPlan) -> None:
    """``run_dir`` made (``--out`` a file, under a file or not makeable: one line, before Ray starts), and the
    loggers' folder in it made without following a link planted there.

    Raises:
        UntrustedInputError: naming the path and what is wrong.
    """
    make_dir(run_dir)
    inside = run_dir.absolute()
    if plan.enabled and plan.log_dir.is_relative_to(inside):
        make_dir(plan.log_dir, root=inside)


def smoke_recipe(
    config: JsonObject, *, model: str = SMOKE_MODEL, pinned: Sequence[str] = (), run_dir: Path | None = None
) -> SmokePlan:
    """``--smoke``: ``config`` rewritten into a short CPU run of its Gym environments on ``model``
    (:func:`~gym_bridge.config.smoke.smoke_config` over what :func:`~gym_bridge.recipes.smoke_facts.smoke_facts`
    reads: the data, the Gym configs, the model's tokenizer and context). ``pinned``: the keys the command line set,
    left as they are (a ``policy.model_name`` set there is the model the facts are read for). ``run_dir``: where the
    copies of data files without their rows past the smoke context go (None: no copies; such rows stay)."""
    config = with_grpo_keys(config)
    if "policy.model_name" in pinned:
        model = str(config_value(config, "policy.model_name"))
    facts = smoke_facts(config, model, pinned=pinned, run_dir=run_dir)
    return smoke_config(config, facts, model=model, pinned=pinned)


def gpu_keys_table(config: JsonObject) -> str | None:
    """The GPU-only keys ``config`` sets that a CPU run ignores, as one table (None: there are none)."""
    ignored = gpu_only_keys(config)
    if not ignored:
        return None
    return format_table(
        f"{len(ignored)} GPU-only key(s) of this config change nothing in a CPU run (gym-bridge train --smoke turns "
        "the GPU features off and lists them the same way)",
        ("key", "value", "why"),
        [(i.key, shown_value(i.value), i.why) for i in ignored],
    )


def train(
    config: JsonObject,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_line: Callable[[MetricsLine], object] | None = None,
    list_gpu_keys: bool = True,
) -> TrainOutcome:
    """Train ``config`` into ``run_dir`` (resumed from its checkpoint with ``resume``); Ray is started if needed.

    Before anything starts: every key read into typed settings
    (:func:`~gym_bridge.config.run_settings.grpo_run_keys`), the checks on them
    (:func:`~gym_bridge.recipes.pre_start.check_before_start`: one :class:`~gym_bridge.config.keys.TrainingConfigError`
    naming every problem), the rows read, a running Gym's policy endpoint (``env.nemo_gym.gym_head``) checked, and
    (``list_gpu_keys``)
    one warning listing the GPU-only keys the run ignores (``--smoke`` has listed them in its table already)."""
    from gym_bridge.config.run_settings import grpo_run_keys, with_rows
    from gym_bridge.gym.servers.log_folder import check_gym_logs
    from gym_bridge.ray_utils import init_ray
    from gym_bridge.recipes.grpo_run import check_checkpoint, running_gym_policy, start_grpo_run

    run_dir = Path(run_dir)
    _check_out(run_dir)  # a file in the way: one line now, before the checks below take their seconds
    config = with_grpo_keys(config)  # a distillation config in the trainer's keys (NeMo-RL's key space)
    keys = grpo_run_keys(config)  # every key read and checked once, into typed settings, before anything starts
    check_before_start(keys)  # the data, the context and the agents: seconds, before Ray, Gym or a model start
    settings = with_rows(keys)  # the rows read and validated
    if settings.gym_head is not None:  # a running Gym's policy endpoint: checked now, read again when the run binds it
        running_gym_policy(settings.gym_head, settings.served_model_name)
    save_checkpoints = settings.save_checkpoints
    table = gpu_keys_table(config) if list_gpu_keys else None
    if table is not None:
        logger.warning("%s", table)
    plan = logger_settings(config).plan(run_dir)
    _check_run_dir(run_dir, resume)
    if resume:
        check_checkpoint(run_dir)  # a planted or broken checkpoint file is one line here, before Ray and Gym start
        check_gym_logs(run_dir)  # so is a gym-logs entry a log append would follow out of the folder
    written = without_env_values(config)  # secrets from the environment stay out of the run folder and the loggers
    _make_run_folder(run_dir, plan)
    write_atomic(run_dir / CONFIG_FILE, yaml.safe_dump(written, sort_keys=False), root=run_dir)
    init_ray()
    run = start_grpo_run(settings, run_dir, resume=resume)
    run.trainer.save_checkpoints = save_checkpoints  # checkpointing.enabled: read in run() only
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
    checkpoint = run.trainer.checkpoint_dir if save_checkpoints else None
    return TrainOutcome(run_dir, lines, plots, checkpoint, plan)


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
