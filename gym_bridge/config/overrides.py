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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.config.keys import TrainingConfigError, config_value
from gym_bridge.config.loading import load_training_config
from gym_bridge.config.values import check_values, key_parts
from gym_bridge.json_types import JsonObject


def _read(path: Path, child: JsonObject | None = None) -> JsonObject:
    """The config file with its parents merged, ``child`` (the command line's overrides) merged over it, and
    interpolations resolved; an unreadable file is one error."""
    if not path.is_file():
        raise TrainingConfigError(f"the training config {shown(path)} does not exist or is not a file")
    try:
        config: JsonObject = load_training_config(path, child=child)
    except TrainingConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise TrainingConfigError(f"cannot read the training config {shown(path)}: {_first_line(exc)}") from None
    except Exception as exc:  # OmegaConf's errors (a missing interpolation key, a bad parent) name the key
        raise TrainingConfigError(f"{shown(path)}: {_first_line(exc)}") from None
    return config


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return shown(text.splitlines()[0][:300]) if text else type(exc).__name__


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
        parsed = list(OverridesParser.create().parse_overrides(list(overrides)))
    except HydraException as exc:
        raise TrainingConfigError(f"override: {_first_line(exc)} (the form is key=value)") from None
    except RecursionError:
        raise TrainingConfigError("override: nested too deeply to read (the form is key=value)") from None
    except ValueError as exc:  # Hydra's int() of a number past Python's 4,300-digit limit
        raise TrainingConfigError(f"override: {_first_line(exc)}") from None
    for override in parsed:
        try:
            line = override.input_line or override.key_or_group
            key_parts(override.key_or_group, f"override {shown(line[:200])}")
        except UntrustedInputError as exc:
            raise TrainingConfigError(str(exc)) from None
    return parsed


def _value(override: Any) -> object:
    """An override's value (Hydra's types: int, float, str, bool, None, lists and mappings of them)."""
    try:
        return override.value()
    except RecursionError:
        raise TrainingConfigError(f"override {shown(override.key_or_group)}: nested too deeply to read") from None


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
    child: dict[str, Any] = {}
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
        _set(child, key, _value(override))
    try:
        check_values(child, "the command line")
    except UntrustedInputError as exc:
        raise TrainingConfigError(str(exc)) from None
    config = _read(path, child)
    for key in deletions:
        _delete(config, key)
    return config
