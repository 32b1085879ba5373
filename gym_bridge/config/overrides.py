"""A training config file plus NeMo-RL's ``key=value`` overrides, read as NeMo-RL's ``run_grpo`` reads them.

NeMo-RL parses overrides with Hydra's grammar (``parse_hydra_overrides``) onto the loaded config in struct mode and
resolves ``${...}`` afterwards. The same here: ``key=value`` changes a key the config has (a key it lacks is an
error naming it), ``+key=value`` adds one, ``++key=value`` adds or changes, ``~key`` deletes; values are Hydra's
(``1`` an int, ``[1,2]`` a list, ``null`` None). The overrides are merged over the file as a child config whose
``defaults:`` is the file (:func:`~gym_bridge.config.loading.load_training_config`), so an interpolation sees the
overridden value, as in NeMo-RL. Every problem is a :class:`TrainingConfigError` naming the override or the file.

A mapping given as ``key={}`` merges into the config's mapping and so keeps its keys, as Hydra's
``OmegaConf.update(..., merge=True)`` does in NeMo-RL (a warning says so); ``~key`` removes the key and ``key=null``
replaces its value (docs/training.md, "Overrides and parents").
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gym_bridge.config.keys import TrainingConfigError, config_value
from gym_bridge.config.loading import load_training_config
from gym_bridge.json_types import JsonObject


def _read(path: Path, shown_as: str | None = None) -> JsonObject:
    """The config file with its parents merged and interpolations resolved; an unreadable file is one error.
    ``shown_as``: how warnings name the file (the command line's overrides are a temporary child file)."""
    if not path.is_file():
        raise TrainingConfigError(f"the training config {path} does not exist or is not a file")
    try:
        config: JsonObject = load_training_config(path, shown_as=shown_as)
    except TrainingConfigError:
        raise
    except (OSError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainingConfigError(f"cannot read the training config {path}: {first}") from None
    except Exception as exc:  # OmegaConf's errors (a missing interpolation key, a bad parent) name the key
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainingConfigError(f"{path}: {first}") from None
    return config


def _has(config: Mapping[str, Any], dotted: str) -> bool:
    return config_value(config, dotted, _ABSENT) is not _ABSENT


_ABSENT = object()


def _set(tree: dict[str, Any], dotted: str, value: object) -> None:
    node = tree
    *parents, last = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def _delete(config: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = config
    for part in parents:
        node = node[part]
    del node[last]


def _parsed(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return list(OverridesParser.create().parse_overrides(list(overrides)))
    except HydraException as exc:
        raise TrainingConfigError(f"override: {str(exc).splitlines()[0]} (the form is key=value)") from None


def override_keys(overrides: Sequence[str]) -> list[str]:
    """The dotted keys ``overrides`` set, add or delete (``+``, ``++`` and ``~`` taken off), in order."""
    return [override.key_or_group for override in _parsed(overrides)] if overrides else []


def load_with_overrides(path: str | Path, overrides: Sequence[str] = ()) -> JsonObject:
    """The training config at ``path`` with ``overrides`` (NeMo-RL's ``key=value`` form) applied, resolved."""
    path = Path(path).absolute()
    base = _read(path)
    if not overrides:
        return base
    parsed = _parsed(overrides)
    child: dict[str, Any] = {"defaults": [str(path)]}
    deletions: list[str] = []
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override():
            raise TrainingConfigError(f"override {override.input_line}: a sweep runs several jobs; give one value")
        if override.is_delete():
            if not _has(base, key):
                raise TrainingConfigError(f"override ~{key}: the config has no key {key} to delete")
            deletions.append(key)
            continue
        if override.is_add() and _has(base, key):
            raise TrainingConfigError(f"override +{key}: the config already has {key}; use {key}=VALUE to change it")
        if not (override.is_add() or override.is_force_add()) and not _has(base, key):
            raise TrainingConfigError(
                f"override {key}: the config has no key {key} (NeMo-RL's rule; add it with +{key}=VALUE)"
            )
        _set(child, key, override.value())
    with tempfile.TemporaryDirectory(prefix="gym-bridge-overrides-") as folder:
        file = Path(folder) / "overrides.yaml"
        file.write_text(yaml.safe_dump(child, sort_keys=False))
        config = _read(file, shown_as="the command line")
    for key in deletions:
        _delete(config, key)
    return config
