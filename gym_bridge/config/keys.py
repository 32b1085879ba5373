"""How every config reader looks a key up, and the one error a config reader raises (naming the key)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonMapping


class TrainingConfigError(GymBridgeError, ValueError):
    """A training config lacks a key or holds a bad value; the message names the key."""


def config_value(config: JsonMapping, dotted: str, default: object = KeyError) -> Any:
    """The value at ``dotted`` (``a.b.c``); ``default`` when a part is missing, else a TrainingConfigError naming it."""
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is KeyError:
                raise TrainingConfigError(f"the training config has no '{dotted}'")
            return default
        node = node[part]
    return node


def config_section(config: JsonMapping, dotted: str) -> JsonMapping:
    """The sub-mapping at ``dotted`` (``a.b.c``); empty when any part is missing."""
    node = config_value(config, dotted, None)
    if not node:
        return {}
    if not isinstance(node, Mapping):
        raise TrainingConfigError(f"{dotted} must be a mapping of keys, got {type(node).__name__}")
    return node
