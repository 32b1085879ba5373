"""NeMo-RL's own Gym set-up functions over a master config: whether it asks for Gym (``should_use_nemo_gym``),
the in-place set-up (``setup_nemo_gym_config``), and the NemoGymConfig NeMo-RL's spin-up builds from
``env.nemo_gym`` (``nemo_rl_gym_config``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.json_types import JsonMapping

NEMO_RL_GYM_KNOBS = (
    "invalid_tool_call_patterns",
    "thinking_tags",
    "tokenizer_config",
    "pad_dynamic_image_shapes",
    "port_range_low",
    "port_range_high",
)
"""Keys of ``env.nemo_gym`` that are NemoGymConfig fields in NeMo-RL, not Gym's global config."""
_RUNNER_ONLY_KEYS = ("is_trajectory_collection",)
"""Keys of ``env.nemo_gym`` NeMo-RL's Gym runner pops before spin-up; dropped here too, so Gym never sees them."""

_NEMO_RL_ENGINES = {
    "vllm": "vllm_cfg",
    "dynamo": "vllm_cfg",
    "megatron": "mcore_generation_config",
    "trtllm": "trtllm_cfg",
}
"""NeMo-RL's generation backends that can serve Gym, and the section where each says ``expose_http_server``."""
_ASYNC_ENGINE_KEY = {"vllm": "vllm_cfg", "trtllm": "trtllm_cfg"}
"""The backends whose engine is async only with ``<section>.async_engine: true`` (dynamo and megatron always are)."""


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


def nemo_rl_gym_config(
    env_configs: JsonMapping,
    base_urls: list[str],
    model_name: str,
    *,
    enable_router_replay: bool,
    routed_experts_dtype: str,
    use_fastokens: bool,
) -> NemoGymConfig:
    """The NemoGymConfig NeMo-RL's spin-up builds: its knobs (:data:`NEMO_RL_GYM_KNOBS`) become fields, the rest
    of ``env_configs["nemo_gym"]`` is Gym's global config (``$NEMO_GYM_VENV_DIR``, when set, its default
    ``uv_venv_dir``, as in NeMo-RL). Options this package cannot serve (router replay, fastokens, a multimodal
    processor) raise a ``ValidationError`` naming them."""
    section = dict(env_configs["nemo_gym"])
    knobs = {key: section.pop(key) for key in NEMO_RL_GYM_KNOBS if key in section}
    for key in _RUNNER_ONLY_KEYS:
        section.pop(key, None)
    if os.environ.get("NEMO_GYM_VENV_DIR"):
        section.setdefault("uv_venv_dir", os.environ["NEMO_GYM_VENV_DIR"])
    return NemoGymConfig(
        model_name=model_name,
        base_urls=list(base_urls),
        initial_global_config_dict=section,
        require_routed_experts=enable_router_replay,
        routed_experts_dtype=routed_experts_dtype,
        use_fastokens=use_fastokens,
        **knobs,
    )
