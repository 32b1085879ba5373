"""Building the rollout layer from a NeMo-RL-style training config.

Reads the keys a NeMo-RL GRPO config already has, so ``use_nemo_gym: true`` in an
existing config just works:

- ``use_nemo_gym`` (top level) or ``env.should_use_nemo_gym``: pick the ``nemo_gym`` backend;
- ``env.nemo_gym.config_paths``: the Gym server configs; ``env.nemo_gym.base_urls`` and
  ``env.nemo_gym.model_name`` (else ``policy.generation.model_name``, else
  ``policy.model_name``): the endpoint; other keys of ``env.nemo_gym`` that
  :class:`~gym_bridge.gym.actor.NemoGymConfig` knows are taken as such, the rest go
  to Gym's global config;
- ``env.nemo_gym.rollout_timeout_s`` and ``env.nemo_gym.max_row_attempts``: the group
  deadline and the row re-dispatch budget;
- ``env.nemo_gym.num_actors`` (default 1) and ``env.nemo_gym.split_base_urls``: several
  NemoGym actors, each with its own Gym servers, sharing the endpoints or splitting them;
- ``policy.generation``: the generation config; ``policy.max_total_sequence_length``:
  ``max_seq_len``; ``grpo.num_generations_per_prompt``: N.

A NeMo-RL GRPO YAML loads unchanged (:func:`load_training_config` resolves its
``defaults:`` parents and ``${...}`` interpolations as NeMo-RL's ``load_config`` does).
As NeMo-RL's Gym setup does, ``stop_strings``/``stop_token_ids`` are set to None
(one warning) on the Gym path; every key the rollout layer does not read is
accepted and listed once at debug level.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from gym_bridge.failures import RolloutTimeouts
from gym_bridge.gym.actor import NemoGymConfig
from gym_bridge.launch import GymLaunchSpec, NemoGymRollouts, start_nemo_gym

__all__ = [
    "NemoGymRolloutSettings",
    "NemoGymRollouts",
    "TrainingConfigError",
    "build_nemo_gym_rollouts",
    "load_training_config",
    "nemo_gym_config_from",
    "nemo_gym_generation_config",
    "nemo_gym_rollout_settings",
    "should_use_nemo_gym",
]

logger = logging.getLogger(__name__)

_BRIDGE_KEYS = ("rollout_timeout_s", "max_row_attempts", "num_actors", "split_base_urls")
_NEMO_RL_ONLY_GYM_KEYS = ("is_trajectory_collection", "tokenizer_config", "pad_dynamic_image_shapes", "effort_levels")
"""Keys of ``env.nemo_gym`` that NeMo-RL pops before Gym sees the section; not Gym's, not ours."""
_READ_KEYS = (
    "use_nemo_gym",
    "env.should_use_nemo_gym",
    "env.nemo_gym",
    "policy.model_name",
    "policy.max_total_sequence_length",
    "policy.generation.model_name",
    "policy.generation.max_new_tokens",
    "policy.generation.temperature",
    "policy.generation.top_p",
    "policy.generation.top_k",
    "policy.generation.val_temperature",
    "policy.generation.val_top_p",
    "policy.generation.val_top_k",
    "policy.generation.stop_strings",
    "policy.generation.stop_token_ids",
    "grpo.num_generations_per_prompt",
)
"""The keys of a training config that the rollout layer reads (a prefix covers its subtree)."""
_STOP_KEYS = ("stop_strings", "stop_token_ids")


class TrainingConfigError(ValueError):
    """A training config lacks a key the rollout layer needs; the message names the key."""


def _get(config: Mapping[str, Any], dotted: str, default: Any = KeyError) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is KeyError:
                raise TrainingConfigError(f"the training config has no '{dotted}'")
            return default
        node = node[part]
    return node


def should_use_nemo_gym(config: Mapping[str, Any]) -> bool:
    """True when the config asks for the NeMo-Gym rollout path."""
    return bool(config.get("use_nemo_gym") or _get(config, "env.should_use_nemo_gym", False))


def _register_resolvers() -> None:
    """The interpolation functions NeMo-RL's recipes register (``${mul:a,b}``, ``${max:a,b}``)."""
    for name, fn in (("mul", lambda a, b: a * b), ("max", lambda a, b: max(a, b))):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _load_with_defaults(path: Path) -> Any:
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise ValueError(f"{path}: a training config must be a mapping, not a list")
    parents = node.pop("defaults", None)
    if parents is None:
        return node
    merged: DictConfig | ListConfig = OmegaConf.create()
    for parent in [parents] if isinstance(parents, str) else list(parents):
        merged = OmegaConf.merge(merged, _load_with_defaults((path.parent / str(parent)).resolve()))
    return OmegaConf.merge(merged, node)


def load_training_config(path: str | Path) -> dict[str, Any]:
    """A NeMo-RL YAML as a plain dict: ``defaults:`` parents merged under it, ``${...}`` resolved."""
    _register_resolvers()
    return _resolved(_load_with_defaults(Path(path)))


def _resolved(config: Any) -> dict[str, Any]:
    _register_resolvers()
    node = config if OmegaConf.is_config(config) else OmegaConf.create(copy.deepcopy(dict(config)))
    container = OmegaConf.to_container(node, resolve=True)
    if not isinstance(container, dict):
        raise ValueError(f"a training config must be a mapping, not {type(container).__name__}")
    return cast("dict[str, Any]", container)  # OmegaConf types keys as any DictKeyType; a YAML config's are str


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_interpolation(v) for v in value)
    return False


def _plain(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` with any ``${...}`` left unresolved (e.g. read with ``yaml.safe_load``) resolved."""
    return _resolved(config) if _has_interpolation(config) else config


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, Mapping) or not node:
        return [prefix] if prefix else []
    return [
        path for key, value in node.items() for path in _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    ]


def unused_training_keys(config: Mapping[str, Any]) -> list[str]:
    """The dotted keys of ``config`` that the rollout layer does not read (NeMo-RL's trainer settings, ...)."""
    section = _get(config, "env.nemo_gym", {})
    section = section if isinstance(section, Mapping) else {}
    ignored_gym = [f"env.nemo_gym.{key}" for key in _NEMO_RL_ONLY_GYM_KEYS if key in section]

    def read(path: str) -> bool:
        if any(path == key or path.startswith(f"{key}.") for key in ignored_gym):
            return False
        return any(path == key or path.startswith(f"{key}.") for key in _READ_KEYS)

    return [path for path in _leaf_paths(config) if not read(path)]


def nemo_gym_generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``policy.generation`` for the Gym path, with ``stop_strings``/``stop_token_ids`` set to None.

    NeMo-RL's Gym setup does the same (Gym's model server does not forward them); we
    say so with one warning instead of silently, and the backend's check never fires.
    """
    generation = copy.deepcopy(dict(_get(_plain(config), "policy.generation")))
    cleared = {key: generation[key] for key in _STOP_KEYS if generation.get(key)}
    if cleared:
        logger.warning(
            "NeMo-Gym rollouts ignore policy.generation %s (the Gym model server does not forward them); "
            "set to None as NeMo-RL's Gym setup does",
            ", ".join(f"{key}={value!r}" for key, value in cleared.items()),
        )
    for key in _STOP_KEYS:
        generation[key] = None
    return generation


def nemo_gym_config_from(config: Mapping[str, Any], *, base_urls: list[str] | None = None) -> NemoGymConfig:
    """The NemoGym actor's config from ``env.nemo_gym`` (``base_urls`` overrides the config's).

    Keys the rollout layer does not read are listed once, at debug level.
    """
    config = _plain(config)
    unused = unused_training_keys(config)
    if unused:
        logger.debug("training config keys the rollout layer does not use: %s", ", ".join(unused))
    section = copy.deepcopy(dict(_get(config, "env.nemo_gym")))
    for key in _BRIDGE_KEYS + _NEMO_RL_ONLY_GYM_KEYS:
        section.pop(key, None)
    urls = base_urls or section.pop("base_urls", None)
    section.pop("base_urls", None)
    if not urls:
        raise TrainingConfigError("no endpoint: set 'env.nemo_gym.base_urls' (http://host:port/v1, one per replica)")
    model_name = (
        section.pop("model_name", None)
        or _get(config, "policy.generation.model_name", None)
        or _get(config, "policy.model_name", None)
    )
    if not model_name:
        raise TrainingConfigError("no model name: set 'env.nemo_gym.model_name' or 'policy.model_name'")
    if "config_paths" not in section:
        raise TrainingConfigError("the training config has no 'env.nemo_gym.config_paths'")
    known = set(NemoGymConfig.model_fields) - {"model_name", "base_urls", "overrides"}
    fields = {key: section.pop(key) for key in list(section) if key in known}
    overrides = {**section.pop("overrides", {}), **section}
    return NemoGymConfig(model_name=model_name, base_urls=list(urls), overrides=overrides, **fields)


@dataclass(frozen=True)
class NemoGymRolloutSettings:
    """Everything the Gym path takes from a training config, read and checked in one place."""

    gym: NemoGymConfig
    generation_config: dict[str, Any]
    num_generations_per_prompt: int
    max_seq_len: int
    rollout_timeout_s: float | None
    max_row_attempts: int
    num_actors: int
    split_base_urls: bool


def nemo_gym_rollout_settings(
    config: Mapping[str, Any], *, base_urls: list[str] | None = None
) -> NemoGymRolloutSettings:
    """Read a NeMo-RL-style training config (loaded or a dict) for the Gym path; errors name the key."""
    if not should_use_nemo_gym(config):
        raise TrainingConfigError("the config does not ask for NeMo-Gym: set 'use_nemo_gym: true'")
    config = _plain(config)
    timeout = _get(config, "env.nemo_gym.rollout_timeout_s", None)
    return NemoGymRolloutSettings(
        gym=nemo_gym_config_from(config, base_urls=base_urls),
        generation_config=nemo_gym_generation_config(config),
        num_generations_per_prompt=int(_get(config, "grpo.num_generations_per_prompt")),
        max_seq_len=int(_get(config, "policy.max_total_sequence_length")),
        rollout_timeout_s=float(timeout) if timeout is not None else None,
        max_row_attempts=int(_get(config, "env.nemo_gym.max_row_attempts", 3)),
        num_actors=int(_get(config, "env.nemo_gym.num_actors", 1)),
        split_base_urls=bool(_get(config, "env.nemo_gym.split_base_urls", False)),
    )


def build_nemo_gym_rollouts(
    config: Mapping[str, Any],
    tokenizer: Any,
    *,
    base_urls: list[str] | None = None,
    uses_tools: bool = False,
    preflight: bool = True,
    **manager_kwargs: Any,
) -> NemoGymRollouts:
    """Preflight the endpoints, then start the NemoGym actor(s) and a ``RolloutManager(use_nemo_gym=True)``
    from a training config (through :func:`gym_bridge.launch.start_nemo_gym`).

    ``uses_tools``: the data offers tools, so every endpoint must accept chats with tools
    (:func:`gym_bridge.preflight.rows_use_tools` tells from the rows).
    """
    settings = nemo_gym_rollout_settings(config, base_urls=base_urls)
    spec = GymLaunchSpec(
        gym=settings.gym,
        num_generations_per_prompt=settings.num_generations_per_prompt,
        max_seq_len=settings.max_seq_len,
        generation_config=settings.generation_config,
        num_actors=settings.num_actors,
        split_base_urls=settings.split_base_urls,
        uses_tools=uses_tools,
        preflight=preflight,
        manager_options={
            "timeouts": RolloutTimeouts(rollout_s=settings.rollout_timeout_s),
            "max_gym_row_attempts": settings.max_row_attempts,
            **manager_kwargs,
        },
    )
    return start_nemo_gym(spec, tokenizer)
