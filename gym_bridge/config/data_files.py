"""Which files a training config names before anything reads them: its data files (training, validation, each extra
set) by key, and its Gym configs (``env.nemo_gym.config_paths`` and the server blocks the recipe defines itself), read
through :mod:`gym_bridge.gym.servers.config_files` from the recipe's keys or from the run's typed Gym settings."""

from __future__ import annotations

from collections.abc import Mapping

from gym_bridge.config.keys import config_section, config_value
from gym_bridge.gym.servers.config_files import GymConfigs, read_gym_configs
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.json_types import JsonMapping

TRAIN_KEY = "data.train.data_path"
TRAIN_FALLBACK_KEY = "data.path"
"""An older name of the training file, read when :data:`TRAIN_KEY` is not set."""
VALIDATION_KEY = "data.validation.data_path"
EXTRA_SETS_KEY = "data.validation.extra_sets"
GYM_SECTION = "env.nemo_gym"


def data_paths(config: JsonMapping) -> dict[str, str]:
    """Every data file the config names: its key -> its path (training, validation, each extra set)."""
    found: dict[str, str] = {}
    train = config_value(config, TRAIN_KEY, None) or config_value(config, TRAIN_FALLBACK_KEY, None)
    if isinstance(train, str) and train:
        found[TRAIN_KEY if config_value(config, TRAIN_KEY, None) else TRAIN_FALLBACK_KEY] = train
    validation = config_value(config, VALIDATION_KEY, None)
    if isinstance(validation, str) and validation:
        found[VALIDATION_KEY] = validation
    extra = config_value(config, EXTRA_SETS_KEY, None)
    if isinstance(extra, Mapping):
        found.update({f"{EXTRA_SETS_KEY}.{name}": path for name, path in extra.items() if isinstance(path, str)})
    return found


def is_train_key(key: str) -> bool:
    """Whether ``key`` (of :func:`data_paths`) names the training file."""
    return key in (TRAIN_KEY, TRAIN_FALLBACK_KEY)


def recipe_gym_configs(config: JsonMapping) -> GymConfigs:
    """The instances ``env.nemo_gym.config_paths`` define, then those the recipe defines under ``env.nemo_gym``, read
    from the recipe's keys (the ``--smoke`` rewrite reads them so, before the typed settings exist)."""
    paths = config_value(config, f"{GYM_SECTION}.config_paths", None) or []
    paths = [str(p) for p in paths] if isinstance(paths, list) else []
    return read_gym_configs(paths, config_section(config, GYM_SECTION), inline_name=GYM_SECTION)


def run_gym_configs(gym: NemoGymConfig) -> GymConfigs:
    """The instances of a run's typed Gym settings: ``env.nemo_gym.config_paths``, then the server blocks the recipe
    defines under ``env.nemo_gym`` (those keys are Gym's global config, ``gym.overrides``, once read)."""
    return read_gym_configs(gym.config_paths, gym.overrides, inline_name=GYM_SECTION)
