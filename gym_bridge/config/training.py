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
  deadline and the row re-dispatch budget (or NeMo-RL's ``async_rl.rollout_failure``);
- ``env.should_mask_flagged_samples``, ``env.should_log_nemo_gym_responses``,
  ``logger.wandb.log_nemo_gym_full_result_tables``, ``env.nemo_gym.is_trajectory_collection``,
  ``env.nemo_gym.effort_levels``, ``reward_penalties``: carried in :class:`NemoGymRolloutSettings`;
- ``async_rl`` and ``grpo.async_grpo`` (:mod:`gym_bridge.config.async_settings`): honoured, or refused in one line;
- ``env.nemo_gym.num_actors`` (default 1) and ``env.nemo_gym.split_base_urls``: several
  NemoGym actors, each with its own Gym servers, sharing the endpoints or splitting them;
- ``policy.generation``: the generation config; ``policy.max_total_sequence_length``:
  ``max_seq_len``; ``grpo.num_generations_per_prompt``: N;
- ``grpo.seed``: the run seed of the ``nemo_gym`` backend (``manager_options``), from which
  every row's sampling seed derives.

A NeMo-RL GRPO YAML loads unchanged (:func:`load_training_config` resolves its
``defaults:`` parents and ``${...}`` interpolations as NeMo-RL's ``load_config`` does).
As NeMo-RL's Gym setup does, ``stop_strings``/``stop_token_ids`` are set to None
(one warning) on the Gym path; every key the rollout layer does not read is
accepted and listed once at debug level.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel, ValidationError

from gym_bridge.config.async_settings import AsyncGRPOSettings, AsyncRLSettings, StallWatchdogSettings
from gym_bridge.config.launch_spec import GymLaunchSpec
from gym_bridge.failures import GymBridgeError, RolloutRetryPolicy, RolloutTimeouts
from gym_bridge.gym.actor import NemoGymConfig
from gym_bridge.json_types import JsonMapping, JsonObject

__all__ = [
    "NemoGymRolloutSettings",
    "TrainingConfigError",
    "load_training_config",
    "nemo_gym_config_from",
    "nemo_gym_generation_config",
    "nemo_gym_rollout_settings",
    "setup_nemo_gym_config",
    "should_use_nemo_gym",
]

logger = logging.getLogger(__name__)

_BRIDGE_KEYS = ("rollout_timeout_s", "max_row_attempts", "num_actors", "split_base_urls")
ROUTING_KEYS = ("agent_name", "agent_map", "fan_out")
"""Gym's collection keys under ``env.nemo_gym``: read into :class:`~gym_bridge.gym.routing.RowRouting` where rows
enter (``config.grpo.row_routing``), not Gym's global config."""
_NEMO_RL_ONLY_GYM_KEYS = ("is_trajectory_collection", "effort_levels")
"""Keys of ``env.nemo_gym`` that NeMo-RL pops before Gym sees the section: read into the settings, not Gym's."""
_READ_KEYS = (
    "use_nemo_gym",
    "env.should_use_nemo_gym",
    "env.nemo_gym",
    "env.should_mask_flagged_samples",
    "env.should_log_nemo_gym_responses",
    "logger.wandb_enabled",
    "logger.wandb.log_nemo_gym_full_result_tables",
    "async_rl",
    "grpo.async_grpo",
    "reward_penalties",
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
    "policy.generation.backend",
    "policy.generation.vllm_cfg.max_model_len",
    "grpo.num_generations_per_prompt",
    "grpo.seed",
    "distillation.num_generations_per_prompt",
)
"""The keys of a training config that the rollout layer reads (a prefix covers its subtree)."""
_STOP_KEYS = ("stop_strings", "stop_token_ids")
_NEMO_RL_ENGINES = {
    "vllm": "vllm_cfg",
    "dynamo": "vllm_cfg",
    "megatron": "mcore_generation_config",
    "trtllm": "trtllm_cfg",
}
"""NeMo-RL's generation backends that can serve Gym, and the section where each says ``expose_http_server``."""
_ASYNC_ENGINE_KEY = {"vllm": "vllm_cfg", "trtllm": "trtllm_cfg"}
"""The backends whose engine is async only with ``<section>.async_engine: true`` (dynamo and megatron always are)."""
_RESOLVERS: dict[str, Callable[[float, float], float]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
_OVERRIDE = "_override_"


class TrainingConfigError(GymBridgeError, ValueError):
    """A training config lacks a key the rollout layer needs; the message names the key."""


def _get(config: JsonMapping, dotted: str, default: object = KeyError) -> Any:
    """The value at ``dotted`` (``a.b.c``); ``default`` when a part is missing, else a TrainingConfigError naming it."""
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is KeyError:
                raise TrainingConfigError(f"the training config has no '{dotted}'")
            return default
        node = node[part]
    return node


def _section(config: object, name: str) -> Any:
    """``config.name`` or ``config[name]``: NeMo-RL passes attribute-style master configs, we take mappings too."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def should_use_nemo_gym(master_config: object) -> bool:
    """True when the config asks for the NeMo-Gym path (``env.should_use_nemo_gym``, or our top-level
    ``use_nemo_gym``), after NeMo-RL's check that a NeMo-RL generation backend is async and serves HTTP.

    ``master_config`` is a mapping or an attribute-style config with ``env`` and ``policy`` (NeMo-RL's).
    Raises :class:`TrainingConfigError` naming the key to set when the engine cannot serve Gym.
    """
    env = _section(master_config, "env") or {}
    top = master_config.get("use_nemo_gym") if isinstance(master_config, Mapping) else None
    if not (env.get("should_use_nemo_gym") or top):
        return False
    generation = (_section(master_config, "policy") or {}).get("generation") or {}
    backend = generation.get("backend")
    if backend is None:
        return True
    engine_key = _NEMO_RL_ENGINES.get(str(backend))
    if engine_key is None:
        raise TrainingConfigError(
            f"NeMo-Gym needs an async generation server exposed over HTTP, which policy.generation.backend: {backend} "
            f"does not offer: use one of {', '.join(_NEMO_RL_ENGINES)}"
        )
    engine = generation.get(engine_key) or {}
    async_key = _ASYNC_ENGINE_KEY.get(str(backend))
    if async_key is not None and not engine.get("async_engine"):
        raise TrainingConfigError(
            f"NeMo-Gym needs an async generation engine: set policy.generation.{async_key}.async_engine: true"
        )
    if backend == "megatron" and engine.get("async_engine") is not None:
        raise TrainingConfigError(
            "policy.generation.mcore_generation_config.async_engine: Megatron inference is always async and "
            "NeMo-RL no longer accepts the key; remove it"
        )
    if not engine.get("expose_http_server"):
        raise TrainingConfigError(
            f"NeMo-Gym needs the generation server exposed over HTTP: set "
            f"policy.generation.{engine_key}.expose_http_server: true"
        )
    return True


def setup_nemo_gym_config(config: object, tokenizer: object) -> None:
    """NeMo-RL's Gym set-up, in place: the vLLM engine async and served over HTTP, stop strings and stop token
    ids cleared (Gym's model server does not forward them), and for a VLM policy the tokenizer config copied
    to ``env.nemo_gym.tokenizer_config``. ``tokenizer`` is accepted for NeMo-RL's signature."""
    policy = _section(config, "policy")
    generation = policy["generation"]
    if generation.get("vllm_cfg") is None:
        generation["vllm_cfg"] = {}
    # index again after each assignment: an OmegaConf node stores a copy of the dict it is given
    generation["vllm_cfg"]["async_engine"] = True
    generation["vllm_cfg"]["expose_http_server"] = True
    generation["stop_strings"] = None
    generation["stop_token_ids"] = None
    if policy.get("is_vlm"):
        env = _section(config, "env")
        if env.get("nemo_gym") is None:
            env["nemo_gym"] = {}
        if env["nemo_gym"].get("tokenizer_config") is None:
            env["nemo_gym"]["tokenizer_config"] = dict(policy["tokenizer"])


def _register_resolvers() -> None:
    """The interpolation functions NeMo-RL registers (``nemo_rl/utils/config.py``): add, mul, div, max."""
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _load_with_defaults(path: Path) -> DictConfig:
    """The YAML at ``path`` with its ``defaults:`` parents merged under it, ``${...}`` still unresolved."""
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise TrainingConfigError(f"{path}: a training config must be a mapping, not a list")
    parents = node.pop("defaults", None)
    if parents is None:
        return node
    merged = OmegaConf.create()
    for parent in [parents] if isinstance(parents, str) else list(parents):
        merged = _merge_with_override(merged, _load_with_defaults((path.parent / str(parent)).resolve()))
    return _merge_with_override(merged, node)


def _merge_with_override(base: DictConfig, child: DictConfig) -> DictConfig:
    """Merge ``child`` over ``base``; a top-level section of ``child`` marked ``_override_: true`` replaces
    the parent's section instead of merging into it (NeMo-RL's rule)."""
    for key in list(child.keys()):
        if OmegaConf.is_missing(child, key):
            continue
        value = child[key]
        if isinstance(value, DictConfig) and value.get(_OVERRIDE, False):
            value.pop(_OVERRIDE)
            if key in base:
                base.pop(key)
    merged = OmegaConf.merge(base, child)
    assert isinstance(merged, DictConfig)  # two mappings merge into a mapping
    return merged


def load_training_config(path: str | Path) -> JsonObject:
    """A NeMo-RL YAML as a plain dict: ``defaults:`` parents merged under it, ``${...}`` resolved."""
    _register_resolvers()
    return _resolved(_load_with_defaults(Path(path)))


def _as_plain(config: object) -> object:
    """An attribute-style config (a pydantic model such as NeMo-RL's ``MasterConfig``, a dataclass, a namespace)
    as nested plain containers; mappings, lists and scalars as they are."""
    if OmegaConf.is_config(config) or isinstance(config, (str, bytes, int, float, bool)) or config is None:
        return config
    if isinstance(config, Mapping):
        return {key: _as_plain(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [_as_plain(value) for value in config]
    if isinstance(config, BaseModel):
        return _as_plain(config.model_dump())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return _as_plain({field.name: getattr(config, field.name) for field in dataclasses.fields(config)})
    if isinstance(config, SimpleNamespace):
        return _as_plain(vars(config))
    return config


def _resolved(config: object) -> JsonObject:
    """``config`` (OmegaConf, a mapping or an attribute-style config) as a plain dict with ``${...}`` resolved."""
    _register_resolvers()
    if isinstance(config, (DictConfig, ListConfig)):
        node: DictConfig | ListConfig = config
    else:
        plain = _as_plain(config)
        if not isinstance(plain, dict):
            raise TrainingConfigError(f"a training config must be a mapping, not {type(plain).__name__}")
        node = OmegaConf.create(copy.deepcopy(plain))
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


def _plain(config: JsonMapping) -> JsonMapping:
    """``config`` with any ``${...}`` left unresolved (e.g. read with ``yaml.safe_load``) resolved."""
    return _resolved(config) if _has_interpolation(config) else config


def _leaf_paths(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, Mapping) or not node:
        return [prefix] if prefix else []
    return [
        path for key, value in node.items() for path in _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    ]


def unused_training_keys(config: JsonMapping) -> list[str]:
    """The dotted keys of ``config`` that the rollout layer does not read (NeMo-RL's trainer settings, ...).

    The ``env`` sections of native environments (``env.math``, ...) count as read: the Gym path names them once in
    a warning (they have no effect there, as in NeMo-RL's Gym runners).
    """

    read_keys = _READ_KEYS + tuple(f"env.{name}" for name in _native_environments(config))

    def read(path: str) -> bool:
        return any(path == key or path.startswith(f"{key}.") for key in read_keys)

    return [path for path in _leaf_paths(config) if not read(path)]


def _native_environments(config: JsonMapping) -> list[str]:
    """The ``env`` sections other than ``nemo_gym`` (NeMo-RL's native environments: ``math``, ``dapo``, ...)."""
    env = _get(config, "env", None)
    if not isinstance(env, Mapping):
        return []
    return sorted(str(name) for name, value in env.items() if name != "nemo_gym" and isinstance(value, Mapping))


def nemo_gym_generation_config(config: JsonMapping) -> JsonObject:
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


def nemo_gym_config_from(config: JsonMapping, *, base_urls: list[str] | None = None) -> NemoGymConfig:
    """The NemoGym actor's config from ``env.nemo_gym`` (``base_urls`` overrides the config's).

    Keys the rollout layer does not read are listed once, at debug level.
    """
    config = _plain(config)
    unused = unused_training_keys(config)
    if unused:
        logger.debug("training config keys the rollout layer does not use: %s", ", ".join(unused))
    section = copy.deepcopy(dict(_get(config, "env.nemo_gym")))
    for key in _BRIDGE_KEYS + _NEMO_RL_ONLY_GYM_KEYS + ROUTING_KEYS:
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
    try:
        return NemoGymConfig(model_name=model_name, base_urls=list(urls), overrides=overrides, **fields)
    except ValidationError as exc:
        raise TrainingConfigError(
            "; ".join(
                f"env.nemo_gym{''.join(f'.{p}' for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                for err in exc.errors()
            )
        ) from None


@dataclass(frozen=True)
class NemoGymRolloutSettings:
    """Everything the Gym path and the GRPO loop take from a training config, read and checked in one place.

    ``launch`` is what :func:`~gym_bridge.recipes.launch.start_nemo_gym` starts (one type for both); the rest
    is for the loop and the batch functions.
    """

    launch: GymLaunchSpec
    """The actors' Gym config, N, ``max_seq_len``, the generation config, the actor count, and the manager's
    timeouts, retry policy (``async_rl.rollout_failure`` with NeMo-RL's defaults when the section is there,
    else one attempt of each kind with ``env.nemo_gym.max_row_attempts`` row attempts, default 3) and
    ``mask_env_flagged_samples`` (``env.should_mask_flagged_samples``; absent means True, as in NeMo-RL)."""
    log_full_result_tables: bool
    """``logger.wandb_enabled`` and ``logger.wandb.log_nemo_gym_full_result_tables``: ``{agent}/full_result``."""
    log_nemo_gym_responses: bool
    """``env.should_log_nemo_gym_responses``: Gym keeps the full responses (``full_results.jsonl`` per run)."""
    is_trajectory_collection: bool
    """``env.nemo_gym.is_trajectory_collection``: collect trajectories, do not train."""
    reward_penalties: JsonObject | None
    """``reward_penalties`` (NeMo-RL's ``RewardPenaltyConfig`` keys), as written."""
    effort_levels: JsonObject | None
    """``env.nemo_gym.effort_levels`` (NeMo-RL's ``EffortLevelsConfig`` keys), as written; never sent to Gym."""
    async_grpo: AsyncGRPOSettings
    async_rl: AsyncRLSettings
    """``async_rl``: its ``rollout_failure`` gave the retry policy and timeouts."""
    min_step_batch_fraction: float
    """``async_rl.rollout_failure.min_step_batch_fraction`` when that section is there, else 0 (no floor)."""
    unused_environments: tuple[str, ...] = ()
    """``env`` sections of NeMo-RL's native environments (``math``, ...): the Gym path does not start them."""

    @property
    def stall_watchdog(self) -> StallWatchdogSettings:
        """``async_rl.stall_watchdog``; :meth:`StallWatchdogSettings.off` when the section is absent."""
        return self.async_rl.stall_watchdog

    @property
    def gym(self) -> NemoGymConfig:
        return self.launch.gym

    @property
    def generation_config(self) -> JsonObject:
        return dict(self.launch.generation_config)

    @property
    def num_generations_per_prompt(self) -> int:
        return self.launch.num_generations_per_prompt

    @property
    def max_seq_len(self) -> int:
        return self.launch.max_seq_len

    @property
    def num_actors(self) -> int:
        return self.launch.num_actors

    @property
    def split_base_urls(self) -> bool:
        return self.launch.split_base_urls

    @property
    def retry_policy(self) -> RolloutRetryPolicy:
        assert self.launch.retry_policy is not None  # nemo_gym_rollout_settings always sets one
        return self.launch.retry_policy

    @property
    def timeouts(self) -> RolloutTimeouts:
        return self.launch.timeouts

    @property
    def mask_env_flagged_samples(self) -> bool:
        return self.launch.mask_env_flagged_samples

    @property
    def rollout_timeout_s(self) -> float | None:
        return self.timeouts.rollout_s

    @property
    def max_row_attempts(self) -> int:
        return self.retry_policy.max_gym_row_attempts


def nemo_gym_rollout_settings(config: object, *, base_urls: list[str] | None = None) -> NemoGymRolloutSettings:
    """Read a NeMo-RL-style training config (loaded, a dict, or attribute-style) for the Gym path.

    Errors name the key (:class:`TrainingConfigError`).
    """
    mapping = config if isinstance(config, Mapping) else _resolved(config)
    if not should_use_nemo_gym(mapping):
        raise TrainingConfigError("the config does not ask for NeMo-Gym: set 'env.should_use_nemo_gym: true'")
    config = _plain(mapping)
    async_rl = _section_model(AsyncRLSettings, config, "async_rl")
    async_grpo = _section_model(AsyncGRPOSettings, config, "grpo.async_grpo")
    _refuse_native_failure_keys(config)
    native_environments = _native_environments(config)
    _warn_without_effect(async_rl, native_environments)
    has_failure_section = _get(config, "async_rl.rollout_failure", None) is not None
    retry_policy, timeouts = _failure_policy(config, async_rl, async_grpo)
    section = _get(config, "env.nemo_gym", {}) or {}
    wandb = _get(config, "logger.wandb", {}) or {}
    launch = GymLaunchSpec(
        gym=nemo_gym_config_from(config, base_urls=base_urls),
        generation_config=nemo_gym_generation_config(config),
        num_generations_per_prompt=int(
            _get(config, "grpo.num_generations_per_prompt", None)
            or _get(config, "distillation.num_generations_per_prompt", None)
            or _get(config, "grpo.num_generations_per_prompt")  # raises, naming GRPO's key
        ),
        max_seq_len=_manager_max_seq_len(config),
        num_actors=int(section.get("num_actors", 1)),
        split_base_urls=bool(section.get("split_base_urls", False)),
        retry_policy=retry_policy,
        timeouts=timeouts,
        mask_env_flagged_samples=_get(config, "env.should_mask_flagged_samples", None) is not False,
        manager_options=_rollout_seed_option(config),
    )
    return NemoGymRolloutSettings(
        launch=launch,
        log_full_result_tables=bool(_get(config, "logger.wandb_enabled", False))
        and bool(wandb.get("log_nemo_gym_full_result_tables")),
        log_nemo_gym_responses=bool(_get(config, "env.should_log_nemo_gym_responses", False)),
        is_trajectory_collection=bool(section.get("is_trajectory_collection") or False),
        reward_penalties=_get(config, "reward_penalties", None),
        effort_levels=section.get("effort_levels"),
        async_grpo=async_grpo,
        async_rl=async_rl,
        min_step_batch_fraction=async_rl.rollout_failure.min_step_batch_fraction if has_failure_section else 0.0,
        unused_environments=tuple(native_environments),
    )


def _rollout_seed_option(config: JsonMapping) -> dict[str, int]:
    """``{"seed": grpo.seed}`` for the ``nemo_gym`` backend, which derives every row's sampling seed from it;
    empty without ``grpo.seed`` (rows go unseeded)."""
    seed = _get(config, "grpo.seed", None)
    if seed is None:
        return {}
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TrainingConfigError(f"grpo.seed must be an int, got {seed!r}")
    return {"seed": seed}


def _manager_max_seq_len(config: JsonMapping) -> int:
    """The engine's context, as NeMo-RL's single controller sizes its manager: ``vllm_cfg.max_model_len`` for a
    vLLM backend that sets it, else ``policy.max_total_sequence_length``."""
    if _get(config, "policy.generation.backend", None) == "vllm":
        max_model_len = _get(config, "policy.generation.vllm_cfg.max_model_len", None)
        if max_model_len is not None:
            return int(max_model_len)
    return int(_get(config, "policy.max_total_sequence_length"))


def _section_model[M: BaseModel](model: type[M], config: JsonMapping, dotted: str) -> M:
    """``model`` validated from the section at ``dotted`` (its defaults when absent); errors name the key."""
    try:
        return model.model_validate(_get(config, dotted, None) or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{dotted}.{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}".replace(
                f"{dotted}.:", f"{dotted}:"
            )
            for err in exc.errors()
        )
        raise TrainingConfigError(problems) from None


def _failure_policy(
    config: JsonMapping, async_rl: AsyncRLSettings, async_grpo: AsyncGRPOSettings
) -> tuple[RolloutRetryPolicy, RolloutTimeouts]:
    """NeMo-RL's ``async_rl.rollout_failure`` when present; else our ``env.nemo_gym`` keys over one attempt
    (``single_attempt()``), with ``env.nemo_gym.max_row_attempts`` defaulting to NeMo-RL's row budget.

    ``grpo.async_grpo.max_generation_failures`` (async on) bounds the prompts dropped in a row, as
    ``async_rl.rollout_failure.max_consecutive_dropped_prompts`` does; both set to different values is an error.
    """
    ours = {key: _get(config, f"env.nemo_gym.{key}", None) for key in ("rollout_timeout_s", "max_row_attempts")}
    failure = async_rl.rollout_failure
    generation_failures = (
        async_grpo.max_generation_failures
        if async_grpo.enabled and "max_generation_failures" in async_grpo.model_fields_set
        else None
    )
    if _get(config, "async_rl.rollout_failure", None) is not None:
        clash = [key for key, value in ours.items() if value is not None]
        if clash:
            raise TrainingConfigError(
                f"env.nemo_gym.{clash[0]} and async_rl.rollout_failure.nemo_gym.{clash[0]} both set; keep NeMo-RL's"
            )
        dropped = failure.max_consecutive_dropped_prompts
        both_set = generation_failures is not None and "max_consecutive_dropped_prompts" in failure.model_fields_set
        if both_set and generation_failures != dropped:
            raise TrainingConfigError(
                f"grpo.async_grpo.max_generation_failures ({generation_failures}) and "
                f"async_rl.rollout_failure.max_consecutive_dropped_prompts ({dropped}) set the same budget; keep one"
            )
        return failure.retry_policy(max_consecutive_dropped_prompts=generation_failures), failure.timeouts()
    timeout = ours["rollout_timeout_s"]
    row_attempts = ours["max_row_attempts"] or failure.nemo_gym.max_row_attempts
    policy = RolloutRetryPolicy.single_attempt(max_gym_row_attempts=int(row_attempts))
    if async_grpo.enabled:
        policy = replace(policy, max_consecutive_dropped_prompts=async_grpo.max_generation_failures)
    return policy, RolloutTimeouts(rollout_s=float(timeout) if timeout is not None else None)


def _refuse_native_failure_keys(config: JsonMapping) -> None:
    """NeMo-RL's rule: ``async_rl.rollout_failure.native`` settings on a Gym run would be silently ignored."""
    native = _get(config, "async_rl.rollout_failure.native", None) or {}
    populated = [f"{key}={value!r}" for key, value in native.items() if value is not None]
    if populated:
        raise TrainingConfigError(
            f"async_rl.rollout_failure.native.{', '.join(populated)}: this run uses the nemo_gym rollout path, where "
            "native-only deadlines do nothing; move them under async_rl.rollout_failure.nemo_gym or remove them"
        )


def _warn_without_effect(async_rl: AsyncRLSettings, native_environments: list[str]) -> None:
    """One warning each for the accepted keys that change nothing on gym-bridge's Gym path."""
    pump = async_rl.without_effect()
    if pump:
        logger.warning(
            "async_rl.%s: NeMo-RL's SingleController pump settings; gym-bridge's GRPO loop dispatches a step's "
            "prompts together and bounds staleness by grpo.async_grpo.max_trajectory_age_steps, so they have no effect",
            ", async_rl.".join(pump),
        )
    if native_environments:
        logger.warning(
            "env.%s: native environment configs; the NeMo-Gym path starts only env.nemo_gym's servers (as NeMo-RL's "
            "Gym runners do), so they have no effect",
            ", env.".join(native_environments),
        )
