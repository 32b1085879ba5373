"""A GRPO run's data files as typed settings: which file trains and which validate (each by the key that names it),
how their rows are routed, and the rows read from them once the checks before start have looked at them."""

from __future__ import annotations

from dataclasses import dataclass

from gym_bridge.config.data_files import EXTRA_SETS_KEY, VALIDATION_KEY, data_paths, is_train_key
from gym_bridge.config.grpo import load_gym_rows, row_routing
from gym_bridge.config.keys import TrainingConfigError, config_section
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.protocol.rows import ValidGymRow
from gym_bridge.json_types import JsonMapping
from gym_bridge.training.validation import ValidationSet

VALIDATION_SET = "validation"
"""The name of ``data.validation.data_path``'s set (reported as plain ``val/*``)."""


@dataclass(frozen=True)
class DataFile:
    """One data file of a run: the config key that names it, its path, and (validation) the set it is."""

    key: str
    """``data.train.data_path`` (or ``data.path``), ``data.validation.data_path`` or
    ``data.validation.extra_sets.<name>``."""
    path: str
    set_name: str | None = None
    """The validation set's name (``validation``, or the extra set's); None for the training file."""


@dataclass(frozen=True)
class RunData:
    """The training file, the validation files in order, and the routing every row is read with (``env.nemo_gym``'s
    ``agent_name`` / ``agent_map`` / ``fan_out``)."""

    train: DataFile
    validation: tuple[DataFile, ...]
    routing: RowRouting

    @property
    def files(self) -> tuple[DataFile, ...]:
        """Every data file, training first."""
        return (self.train, *self.validation)


def run_data(config: JsonMapping) -> RunData:
    """The data files ``config`` names (:func:`~gym_bridge.config.data_files.data_paths`, the one reader of those keys)
    and its routing; :class:`TrainingConfigError` when no file trains or a section is not a mapping."""
    for section in ("data", "data.train", "data.validation"):
        config_section(config, section)
    paths = data_paths(config)
    train = next((DataFile(key, path) for key, path in paths.items() if is_train_key(key)), None)
    if train is None:
        raise TrainingConfigError("data.train.data_path (or data.path) must name a JSONL file of Gym rows")
    validation = tuple(
        DataFile(key, path, VALIDATION_SET if key == VALIDATION_KEY else key.removeprefix(f"{EXTRA_SETS_KEY}."))
        for key, path in paths.items()
        if not is_train_key(key)
    )
    return RunData(train, validation, row_routing(config))


def train_rows(data: RunData) -> list[ValidGymRow]:
    """The training file's rows, read, routed and validated (:func:`~gym_bridge.config.grpo.load_gym_rows`)."""
    return load_gym_rows(data.train.path, data.routing)


def validation_sets(data: RunData, max_samples: int | None) -> list[ValidationSet]:
    """``data.validation.data_path`` (reported as ``val/*``), then ``data.validation.extra_sets`` in order; each cut
    to ``max_samples`` rows (``grpo.max_val_samples``) when that is set."""
    return [
        ValidationSet(str(file.set_name), load_gym_rows(file.path, data.routing)[: max_samples or None])
        for file in data.validation
    ]
