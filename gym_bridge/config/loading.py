"""Reading a NeMo-RL YAML as NeMo-RL's ``load_config`` does: ``defaults:`` parents, ``_override_`` sections,
``${...}`` interpolation with NeMo-RL's resolvers; and any config (a mapping or attribute-style) as a plain dict.

A child's mapping merges into its parent's (OmegaConf's merge, NeMo-RL's rule): ``key: {}`` keeps the parent's keys,
``key: null`` drops them, and ``_override_: true`` on a top-level section replaces the parent's section; NeMo-RL reads
``_override_`` on top-level sections only. The two cases that read otherwise than they look (an empty mapping over a
parent's keys, an ``_override_`` below the top level) are each one warning naming the key and the file.

Values that ``${oc.env:NAME}`` interpolations resolve to are often secrets (API keys). Resolution notes them, and
:func:`without_env_values` puts the interpolations back in a resolved config before it is written anywhere, so a run
folder's ``config.yaml`` never holds them.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.text import shown
from gym_bridge.boundary.yaml_io import MAX_CONFIG_BYTES
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.values import check_values, config_yaml
from gym_bridge.json_types import JsonMapping, JsonObject

logger = logging.getLogger(__name__)

_RESOLVERS: dict[str, Callable[[float, float], float]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
_OVERRIDE = "_override_"
_ENV_REFERENCE = re.compile(r"oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")
_ENV_VALUES: dict[str, str] = {}
"""Each non-empty value an ``${oc.env:NAME}`` interpolation resolved to in this process -> ``NAME``."""
MIN_EMBEDDED_SECRET = 8
"""Environment values at least this long are put back where they appear inside a longer string too."""


def _register_resolvers() -> None:
    """The interpolation functions NeMo-RL registers (``nemo_rl/utils/config.py``): add, mul, div, max."""
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _load_with_defaults(path: Path, children: tuple[Path, ...] = ()) -> DictConfig:
    """The YAML at ``path`` with its ``defaults:`` parents merged under it, ``${...}`` still unresolved. The file is
    read through the boundary (a regular file under a cap, aliases bounded, JSON types only, numbers finite, nesting
    bounded: :func:`~gym_bridge.config.values.config_yaml`) before OmegaConf builds anything."""
    if path in children:
        raise TrainingConfigError(
            f"{shown(path)}: its defaults: chain comes back to it ({' -> '.join(map(shown, children))})"
        )
    try:
        text = read_text(path, MAX_CONFIG_BYTES)
        config_yaml(text, shown(path))
    except OSError as exc:
        raise TrainingConfigError(f"cannot read the training config {shown(path)}: {exc.strerror or exc}") from None
    except UntrustedInputError as exc:
        raise TrainingConfigError(str(exc)) from None
    node = OmegaConf.load(io.StringIO(text))
    if not isinstance(node, DictConfig):
        raise TrainingConfigError(f"{path}: a training config must be a mapping, not a list")
    parents = node.pop("defaults", None)
    if parents is None:
        return node
    merged = OmegaConf.create()
    for parent in [parents] if isinstance(parents, str) else list(parents):
        parent_path = (path.parent / str(parent)).resolve()
        merged = _merge_with_override(merged, _load_with_defaults(parent_path, (*children, path)), shown(parent_path))
    return _merge_with_override(merged, node, shown(path))


def _merge_with_override(base: DictConfig, child: DictConfig, where: str = "") -> DictConfig:
    """Merge ``child`` over ``base``; a top-level section of ``child`` marked ``_override_: true`` replaces
    the parent's section instead of merging into it (NeMo-RL's rule). ``where`` names ``child`` in the warnings
    (:func:`_warn_merge`)."""
    for key in list(child.keys()):
        if OmegaConf.is_missing(child, key):
            continue
        value = child[key]
        if isinstance(value, DictConfig) and value.get(_OVERRIDE, False):
            value.pop(_OVERRIDE)
            if key in base:
                base.pop(key)
    _warn_merge(base, child, where)
    merged = OmegaConf.merge(base, child)
    assert isinstance(merged, DictConfig)  # two mappings merge into a mapping
    return merged


def _warn_merge(base: DictConfig, child: DictConfig, where: str) -> None:
    """One warning for each mapping of ``child`` that merges otherwise than it reads: an empty mapping over a parent's
    keys (they stay), and an ``_override_`` marker below the top level (NeMo-RL reads it on top-level sections only,
    so the section merges and the marker stays a key)."""
    if not base:
        return
    command_line = where == "the command line"
    parent = OmegaConf.to_container(base, resolve=False)
    for key, kept in _empty_over_keys(parent, OmegaConf.to_container(child, resolve=False)):
        fix = (
            f"~{key} removes them"
            if command_line
            else f"'{key.rsplit('.', 1)[-1]}: null' there (or ~{key} on the command line) removes them"
        )
        logger.warning(
            "%s sets %s to {}, which keeps the parent's %d key(s) (%s): NeMo-RL merges a mapping into its parent's "
            "(OmegaConf.merge; nemo_rl/utils/config.py); %s",
            where or "a child config",
            key,
            len(kept),
            ", ".join(kept[:5]),
            fix,
        )
    for key in _nested_overrides(OmegaConf.to_container(child, resolve=False)):
        logger.warning(
            "%s: %s._override_ is below the top level, where NeMo-RL does not read it (only top-level sections, "
            "nemo_rl/utils/config.py merge_with_override): %s merges with its parent's and keeps '_override_' as a "
            "key. Put _override_: true on the top-level section, or set the key to null to drop the parent's value",
            where or "a child config",
            key,
            key,
        )


def _empty_over_keys(parent: object, child: object, prefix: str = "") -> list[tuple[str, list[str]]]:
    """``(dotted key, the parent's keys)`` for each empty mapping of ``child`` over a non-empty one of ``parent``."""
    if not isinstance(parent, dict) or not isinstance(child, dict):
        return []
    found = []
    for key, value in child.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        below = parent.get(key)
        if isinstance(value, dict) and isinstance(below, dict):
            if not value and below:
                found.append((dotted, [str(k) for k in below]))
            else:
                found += _empty_over_keys(below, value, dotted)
    return found


def _nested_overrides(child: object, prefix: str = "") -> list[str]:
    """The dotted sections of ``child`` below the top level that carry an ``_override_`` marker."""
    if not isinstance(child, dict):
        return []
    found = []
    for key, value in child.items():
        if isinstance(value, dict):
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if prefix and _OVERRIDE in value:
                found.append(dotted)
            found += _nested_overrides(value, dotted)
    return found


def load_training_config(path: str | Path, *, child: JsonMapping | None = None) -> JsonObject:
    """A NeMo-RL YAML as a plain dict: ``defaults:`` parents merged under it, ``child`` (the command line's overrides,
    plain data already checked) merged over it as a child config would be, ``${...}`` resolved; the result's numbers
    finite (an interpolation can compute ``inf``)."""
    _register_resolvers()
    node = _load_with_defaults(Path(path).resolve())
    if child:  # as a child file whose defaults: is ``path`` merges: the file over nothing, then the child over it
        node = _merge_with_override(OmegaConf.create(), node, shown(path))
        node = _merge_with_override(node, OmegaConf.create(copy.deepcopy(dict(child))), "the command line")
    config = resolved_config(node)
    try:
        check_values(config, f"the training config {shown(path)}")
    except UntrustedInputError as exc:
        raise TrainingConfigError(str(exc)) from None
    return config


def _asplain_config(config: object) -> object:
    """An attribute-style config (a pydantic model such as NeMo-RL's ``MasterConfig``, a dataclass, a namespace)
    as nested plain containers; mappings, lists and scalars as they are."""
    if OmegaConf.is_config(config) or isinstance(config, (str, bytes, int, float, bool)) or config is None:
        return config
    if isinstance(config, Mapping):
        return {key: _asplain_config(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [_asplain_config(value) for value in config]
    if isinstance(config, BaseModel):
        return _asplain_config(config.model_dump())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return _asplain_config({field.name: getattr(config, field.name) for field in dataclasses.fields(config)})
    if isinstance(config, SimpleNamespace):
        return _asplain_config(vars(config))
    return config


def resolved_config(config: object) -> JsonObject:
    """``config`` (OmegaConf, a mapping or an attribute-style config) as a plain dict with ``${...}`` resolved."""
    _register_resolvers()
    if isinstance(config, (DictConfig, ListConfig)):
        node: DictConfig | ListConfig = config
    else:
        plain = _asplain_config(config)
        if not isinstance(plain, dict):
            raise TrainingConfigError(f"a training config must be a mapping, not {type(plain).__name__}")
        node = OmegaConf.create(copy.deepcopy(plain))
    _note_env_values(node)
    container = OmegaConf.to_container(node, resolve=True)
    if not isinstance(container, dict):
        raise TrainingConfigError(f"a training config must be a mapping, not {type(container).__name__}")
    return cast("JsonObject", container)  # OmegaConf types keys as any DictKeyType; a YAML config's are str


def _has_interpolation(value: object) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_interpolation(v) for v in value)
    return False


def plain_config(config: JsonMapping) -> JsonMapping:
    """``config`` with any ``${...}`` left unresolved (e.g. read with ``yaml.safe_load``) resolved."""
    return resolved_config(config) if _has_interpolation(config) else config


def _strings(value: object) -> list[str]:
    """Every string in a nested container of mappings and lists, keys included."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _note_env_values(node: DictConfig | ListConfig) -> None:
    """Remember what ``node``'s ``${oc.env:NAME}`` interpolations resolve to, for :func:`without_env_values`."""
    for text in _strings(OmegaConf.to_container(node, resolve=False)):
        for name in _ENV_REFERENCE.findall(text):
            value = os.environ.get(name)
            if value:
                _ENV_VALUES[value] = name


def _put_back(text: str, values: list[tuple[str, str]]) -> str:
    """``text`` with each environment value in ``values`` (longest first) replaced by its interpolation: whole, or
    inside a longer string when it is at least :data:`MIN_EMBEDDED_SECRET` characters long."""
    for value, name in values:
        if text == value:
            return f"${{oc.env:{name}}}"
        if len(value) >= MIN_EMBEDDED_SECRET and value in text:
            text = text.replace(value, f"${{oc.env:{name}}}")
    return text


def without_env_values(config: JsonMapping) -> JsonObject:
    """A copy of ``config`` with every value an ``${oc.env:NAME}`` interpolation resolved to (in this process, see
    :func:`resolved_config`, and still ``NAME``'s value) written as that interpolation again: what a run folder may
    hold, since those values are often secrets."""
    current = [(value, name) for value, name in _ENV_VALUES.items() if os.environ.get(name) == value]
    values = sorted(current, key=lambda item: -len(item[0]))

    def walk(value: object) -> object:
        if isinstance(value, str):
            return _put_back(value, values) if values else value
        if isinstance(value, Mapping):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(item) for item in value]
        return value

    return cast("JsonObject", walk(config))
