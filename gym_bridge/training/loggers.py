"""Experiment loggers: each ``metrics.jsonl`` line also goes to TensorBoard, W&B (offline) and MLflow, as NeMo-RL logs.

NeMo-RL's ``Logger`` writes under ``log_dir``: ``tensorboard/`` (event files), ``wandb/`` and ``mlflow/``. The
backends here do the same, with NeMo-RL's metric names (:func:`nemo_rl_scalars`): ``train/...`` at the count of
steps done, ``validation/...`` and ``timing/train/...`` / ``timing/validation/...``. W&B always runs offline
(``WANDB_MODE=offline``): a training run never reaches a service. MLflow writes a local store (SQLite by default,
since MLflow 3 refuses a plain file store unless told otherwise). Each backend's package is imported only when it
is enabled.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gym_bridge.boundary.files import make_dir
from gym_bridge.json_types import JsonMapping

logger = logging.getLogger(__name__)

TIMING_NAMES = {
    "step_s": "total_step_time",
    "rollout_s": "generation",
    "train_s": "policy_training",
    "refit_s": "weight_sync",
    "val_s": "total_validation_time",
}
"""Our ``time/*`` keys and NeMo-RL's timer names for the same phases (``timing/<train|validation>/<name>``)."""
ALIASES = {"train/mean_reward": "train/reward", "val/mean_tokens": "validation/avg_length"}
"""Our keys whose NeMo-RL name differs beyond the prefix (NeMo-RL's ``reward`` and validation ``avg_length``)."""
_NOT_METRICS = ("kind", "step")


@dataclass(frozen=True)
class WandbRun:
    """A W&B run, always offline: project, run name and entity (NeMo-RL's ``logger.wandb``), and its folder."""

    dir: Path
    project: str | None = None
    name: str | None = None
    entity: str | None = None


@dataclass(frozen=True)
class MlflowRun:
    """An MLflow run in a local store: the tracking URI, experiment, run name and artifact folder."""

    tracking_uri: str
    experiment_name: str
    artifact_location: Path
    run_name: str | None = None


@dataclass(frozen=True)
class LoggerPlan:
    """Which backends a run opens and where each writes; all None: only ``metrics.jsonl``."""

    log_dir: Path
    tensorboard_dir: Path | None = None
    wandb: WandbRun | None = None
    mlflow: MlflowRun | None = None

    @property
    def enabled(self) -> list[str]:
        """The enabled backends' names."""
        names = ("tensorboard", self.tensorboard_dir), ("wandb", self.wandb), ("mlflow", self.mlflow)
        return [name for name, on in names if on is not None]


def _timing_name(key: str, kind: str) -> str:
    """``time/<x>_s`` as NeMo-RL's ``timing/<train|validation>/<timer>``."""
    short = key.removeprefix("time/")
    return f"timing/{'validation' if kind == 'val' else 'train'}/{TIMING_NAMES.get(short, short.removesuffix('_s'))}"


def nemo_rl_scalars(line: JsonMapping) -> tuple[int, dict[str, float]]:
    """``(step, scalars)`` of one ``metrics.jsonl`` line under NeMo-RL's names.

    A training line logs at the steps done (NeMo-RL's ``total_steps + 1``), a validation at its ``step``; ``val/*``
    becomes ``validation/*``, ``time/*`` ``timing/...``; numbers and flags only (digests and lists stay in the
    JSON line)."""
    kind = str(line.get("kind", "train"))
    raw_step = line.get("step", 0)
    step = int(raw_step) if isinstance(raw_step, (int, float)) else 0
    step += 0 if kind == "val" else 1
    scalars: dict[str, float] = {}
    for key, value in line.items():
        if key in _NOT_METRICS or not isinstance(value, (int, float)):
            continue
        number = float(value)
        if not math.isfinite(number):
            continue
        if key in ALIASES:
            scalars[ALIASES[key]] = number
        if key.startswith("time/"):
            name = _timing_name(key, kind)
        elif key.startswith("val/"):
            name = "validation/" + key.removeprefix("val/")
        elif key == "weight_version":
            name = f"{'validation' if kind == 'val' else 'train'}/weight_version"
        else:
            name = key
        scalars[name] = number
    return step, scalars


class MetricsBackend(Protocol):
    """One experiment logger: scalars at a step, and a close that flushes."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """Event files under ``log_dir/tensorboard`` (``torch.utils.tensorboard``'s writer)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """One scalar event per metric at ``step``, flushed."""
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbBackend:
    """A W&B run in offline mode (``wandb/offline-run-*`` under its folder); ``wandb sync`` uploads it later."""

    def __init__(self, run: WandbRun, config: JsonMapping) -> None:
        os.environ["WANDB_MODE"] = "offline"  # the service is never contacted, whatever the environment said
        import wandb

        settings = wandb.Settings(mode="offline", silent=True, x_disable_stats=True, disable_git=True)
        self.run: Any = wandb.init(
            project=run.project,
            name=run.name,
            entity=run.entity,
            dir=str(run.dir),
            config=dict(config),
            mode="offline",
            settings=settings,
            reinit="create_new",
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """One history row at ``step``."""
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        """Finish the run (writes its last records)."""
        self.run.finish()


class MlflowBackend:
    """An MLflow run in a local store (MLflow's client; no server)."""

    def __init__(self, run: MlflowRun, params: Mapping[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=run.tracking_uri)
        experiment = self.client.get_experiment_by_name(run.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(run.experiment_name, artifact_location=run.artifact_location.as_uri())
        )
        self.run_id: str = self.client.create_run(experiment_id, run_name=run.run_name).info.run_id
        for key, value in list(params.items())[:100]:
            self.client.log_param(self.run_id, key, value[:500])

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Every scalar at ``step`` in one batch."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(name), value, now, step) for name, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


def _mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_-./`` and spaces); others become ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


class ExperimentLoggers:
    """The run's enabled backends: each metrics line goes to all of them under NeMo-RL's names."""

    def __init__(self, backends: Sequence[MetricsBackend] = ()) -> None:
        self.backends = list(backends)

    def __call__(self, line: JsonMapping) -> None:
        """Log one ``metrics.jsonl`` line (a training step or a validation)."""
        if not self.backends:
            return
        step, scalars = nemo_rl_scalars(line)
        for backend in self.backends:
            backend.log(scalars, step)

    def close(self) -> None:
        """Close every backend, the later ones even when an earlier one fails."""
        errors: list[BaseException] = []
        for backend in self.backends:
            try:
                backend.close()
            except Exception as exc:
                errors.append(exc)
        self.backends = []
        if errors:
            raise errors[0]


def _flat_params(config: JsonMapping, prefix: str = "") -> dict[str, str]:
    """A nested config as ``dotted.key -> str(value)`` (MLflow's params)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat_params(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


def _folder(path: Path, log_dir: Path) -> Path:
    """``path`` made: inside ``log_dir`` without following a link planted there, elsewhere (a folder the config
    names) as the user gave it.

    Raises:
        UntrustedInputError: a link inside ``log_dir``, a file in the way, or a folder that cannot be made (named).
    """
    if path.is_relative_to(log_dir):
        return make_dir(path, root=make_dir(log_dir))
    return make_dir(path)


def open_loggers(plan: LoggerPlan, config: JsonMapping) -> ExperimentLoggers:
    """Open the backends ``plan`` enables, each in its folder (made here); ``config`` (the run's whole config) is
    their hyperparameters. A backend that fails to open closes the ones already open."""
    opened = ExperimentLoggers()
    try:
        if plan.tensorboard_dir is not None:
            opened.backends.append(TensorBoardBackend(_folder(plan.tensorboard_dir, plan.log_dir)))
        if plan.wandb is not None:
            _folder(plan.wandb.dir, plan.log_dir)
            opened.backends.append(WandbBackend(plan.wandb, config))
        if plan.mlflow is not None:
            _folder(plan.mlflow.artifact_location, plan.log_dir)
            opened.backends.append(MlflowBackend(plan.mlflow, _flat_params(config)))
    except BaseException:
        opened.close()
        raise
    if plan.enabled:
        logger.info("experiment loggers under %s: %s", plan.log_dir, ", ".join(plan.enabled))
    return opened
