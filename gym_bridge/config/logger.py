"""NeMo-RL's ``logger`` section as typed settings: which experiment loggers a training run opens, and where.

``tensorboard_enabled``, ``wandb_enabled`` and ``mlflow_enabled`` turn on each backend under ``log_dir`` (default
``<run folder>/logs``), as NeMo-RL's ``Logger`` lays them out: ``tensorboard/``, ``wandb/``, ``mlflow/``.
``wandb.project`` / ``name`` / ``entity`` name the W&B run, which is always offline; ``mlflow.experiment_name`` /
``run_name`` / ``tracking_uri`` / ``artifact_location`` the MLflow run, in a local store (SQLite under
``log_dir/mlflow`` unless ``tracking_uri`` names another local store or a loopback server). The keys that change
nothing here (``tensorboard.log_dir``, GPU monitoring, ``num_val_samples_to_print``, SwanLab's names) are in
:mod:`gym_bridge.config.no_effect`. Reads the config; starts nothing.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.json_types import JsonMapping
from gym_bridge.training.loggers import LoggerPlan, MlflowRun, WandbRun

IGNORED_KEYS = ("tensorboard", "swanlab", "monitor_gpus", "gpu_monitoring", "num_val_samples_to_print")
"""Keys of NeMo-RL's ``logger`` that change nothing here; each is in ``NO_EFFECT_KEYS`` with its reason."""
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_NAME = "gym-bridge"


class WandbSettings(BaseModel):
    """NeMo-RL's ``logger.wandb``: the run's project, name and entity, and the full-result tables flag."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    project: str | None = None
    name: str | None = None
    entity: str | None = None
    log_nemo_gym_full_result_tables: bool = False


class MlflowSettings(BaseModel):
    """NeMo-RL's ``logger.mlflow``: experiment, run name, tracking URI and artifact folder (local only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experiment_name: str | None = None
    run_id: None = None
    """NeMo-RL resumes an MLflow run by id; a resumed gym-bridge run opens a new MLflow run instead."""
    run_name: str | None = None
    tracking_uri: str | None = None
    artifact_location: str | None = None

    @field_validator("tracking_uri")
    @classmethod
    def _local_only(cls, value: str | None) -> str | None:
        """A local store (``sqlite:``, ``file:``, a path) or a server on loopback: a run never leaves the machine."""
        if value is None:
            return value
        parsed = urlparse(value)
        if parsed.scheme in ("http", "https") and parsed.hostname not in LOOPBACK_HOSTS:
            raise ValueError(
                f"{value!r} is a remote server; gym-bridge logs to a local store (leave it out for SQLite under "
                "log_dir/mlflow) or to a server on 127.0.0.1"
            )
        if parsed.scheme not in ("", "file", "sqlite", "http", "https"):
            raise ValueError(f"{value!r}: use a sqlite:/// or file: URI, a folder, or http://127.0.0.1:PORT")
        return value


class LoggerSettings(BaseModel):
    """NeMo-RL's ``logger`` section, the keys that have an effect here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    log_dir: str | None = None
    tensorboard_enabled: bool = False
    wandb_enabled: bool = False
    mlflow_enabled: bool = False
    swanlab_enabled: bool = False
    wandb: WandbSettings = WandbSettings()
    mlflow: MlflowSettings = MlflowSettings()

    @field_validator("swanlab_enabled")
    @classmethod
    def _no_swanlab(cls, value: bool) -> bool:
        """SwanLab is not installed with gym-bridge."""
        if value:
            raise ValueError("SwanLab is not supported; use tensorboard_enabled, wandb_enabled or mlflow_enabled")
        return value

    def plan(self, run_dir: Path) -> LoggerPlan:
        """Where each enabled backend writes for a run in ``run_dir`` (``log_dir`` relative to the working
        directory, as NeMo-RL reads it; absent: ``run_dir/logs``)."""
        log_dir = Path(self.log_dir) if self.log_dir is not None else run_dir / "logs"
        log_dir = log_dir.absolute()
        wandb = None
        if self.wandb_enabled:
            wandb = WandbRun(
                dir=log_dir / "wandb",
                project=self.wandb.project or DEFAULT_NAME,
                name=self.wandb.name or run_dir.name,
                entity=self.wandb.entity,
            )
        mlflow = None
        if self.mlflow_enabled:
            store = log_dir / "mlflow"
            uri = self.mlflow.tracking_uri or f"sqlite:///{store / 'mlflow.db'}"
            if urlparse(uri).scheme == "":
                uri = Path(uri).absolute().as_uri()
            mlflow = MlflowRun(
                tracking_uri=uri,
                experiment_name=self.mlflow.experiment_name or DEFAULT_NAME,
                artifact_location=Path(self.mlflow.artifact_location or store / "artifacts").absolute(),
                run_name=self.mlflow.run_name or run_dir.name,
            )
        return LoggerPlan(
            log_dir=log_dir,
            tensorboard_dir=log_dir / "tensorboard" if self.tensorboard_enabled else None,
            wandb=wandb,
            mlflow=mlflow,
        )


def logger_settings(config: JsonMapping) -> LoggerSettings:
    """The config's ``logger`` section as :class:`LoggerSettings`; a bad key or value is a
    :class:`TrainingConfigError` naming ``logger.<key>``."""
    section = config.get("logger") or {}
    if not isinstance(section, dict):
        raise TrainingConfigError(f"logger must be a mapping of keys, got {type(section).__name__}")
    read = {key: value for key, value in section.items() if key not in IGNORED_KEYS}
    for key in ("wandb", "mlflow"):
        if read.get(key) is None:
            read.pop(key, None)
    try:
        return LoggerSettings.model_validate(read)
    except ValidationError as exc:
        problems = "; ".join(
            f"logger.{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise TrainingConfigError(problems) from None
