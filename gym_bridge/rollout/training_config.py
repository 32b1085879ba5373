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
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from gym_bridge.failures import RolloutTimeouts
from gym_bridge.gym.actor import NemoGymConfig
from gym_bridge.launch import GymLaunchSpec, NemoGymRollouts, start_nemo_gym

__all__ = [
    "NemoGymRollouts",
    "TrainingConfigError",
    "build_nemo_gym_rollouts",
    "nemo_gym_config_from",
    "should_use_nemo_gym",
]

_BRIDGE_KEYS = ("rollout_timeout_s", "max_row_attempts", "num_actors", "split_base_urls")


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


def nemo_gym_config_from(config: Mapping[str, Any], *, base_urls: list[str] | None = None) -> NemoGymConfig:
    """The NemoGym actor's config from ``env.nemo_gym`` (``base_urls`` overrides the config's)."""
    section = copy.deepcopy(dict(_get(config, "env.nemo_gym")))
    for key in _BRIDGE_KEYS:
        section.pop(key, None)
    section.pop("is_trajectory_collection", None)
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
    if not should_use_nemo_gym(config):
        raise TrainingConfigError("the config does not ask for NeMo-Gym: set 'use_nemo_gym: true'")
    spec = GymLaunchSpec(
        gym=nemo_gym_config_from(config, base_urls=base_urls),
        num_generations_per_prompt=int(_get(config, "grpo.num_generations_per_prompt")),
        max_seq_len=int(_get(config, "policy.max_total_sequence_length")),
        generation_config=dict(_get(config, "policy.generation")),
        num_actors=int(_get(config, "env.nemo_gym.num_actors", 1)),
        split_base_urls=bool(_get(config, "env.nemo_gym.split_base_urls", False)),
        uses_tools=uses_tools,
        preflight=preflight,
        manager_options={
            "timeouts": RolloutTimeouts(rollout_s=_get(config, "env.nemo_gym.rollout_timeout_s", None)),
            "max_gym_row_attempts": int(_get(config, "env.nemo_gym.max_row_attempts", 3)),
            **manager_kwargs,
        },
    )
    return start_nemo_gym(spec, tokenizer)
