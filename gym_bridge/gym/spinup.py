"""Starting NemoGym actors: create them with their options, start Gym, and clean up on any failure."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from gym_bridge.gym.actor_config import NemoGymConfig, actor_configs
from gym_bridge.json_types import JsonMapping
from gym_bridge.types import ActorHandle, Tokenizer

if TYPE_CHECKING:
    import ray.actor

__all__ = [
    "NEMO_RL_GYM_KNOBS",
    "nemo_rl_gym_config",
    "spinup_nemo_gym_actor",
    "spinup_nemo_gym_actors",
    "start_nemo_gym_actor",
    "stop_nemo_gym_actors",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 65536
"""Concurrent calls on one NemoGym actor unless ``actor_options`` says otherwise (Ray's default is 1,000)."""


def actor_options(config: NemoGymConfig) -> dict[str, Any]:
    """``config.actor_options`` over our defaults: ``max_concurrency`` high enough for every group in flight.

    Each prompt group is one ``run_rollouts`` call for as long as its rows take. Ray's
    default for an async actor, 1,000 concurrent calls, would queue the 1,001st group,
    and behind it every ``health_check`` and ``shutdown``.
    """
    return {"max_concurrency": DEFAULT_MAX_CONCURRENCY, **config.actor_options}


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


def spinup_nemo_gym_actor(
    env_configs: JsonMapping,
    base_urls: list[str],
    model_name: str,
    *,
    tokenizer: Tokenizer,
    enable_router_replay: bool = False,
    routed_experts_dtype: str = "int16",
    use_fastokens: bool = False,
) -> ActorHandle:
    """NeMo-RL's spin-up: the NemoGym actor for ``env_configs["nemo_gym"]`` (NeMo-RL's ``master_config.env``)
    against ``base_urls``, started, with the tokenizer installed (:func:`nemo_rl_gym_config`, then
    :func:`start_nemo_gym_actor`).

    As NeMo-RL's, with ``env.nemo_gym.num_gpu_nodes > 0`` the actor prefers the caller's Ray node (Gym's
    GPU-hosted servers are placed where the caller expects)."""
    config = nemo_rl_gym_config(
        env_configs,
        base_urls,
        model_name,
        enable_router_replay=enable_router_replay,
        routed_experts_dtype=routed_experts_dtype,
        use_fastokens=use_fastokens,
    )
    if config.overrides.get("num_gpu_nodes") and "scheduling_strategy" not in config.actor_options:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if ray.is_initialized():
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
            config = config.model_copy(update={"actor_options": {**config.actor_options, "scheduling_strategy": here}})
    return start_nemo_gym_actor(config, tokenizer)


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


def start_nemo_gym_actor(config: NemoGymConfig, tokenizer: Tokenizer, *, margin_s: float = 60.0) -> ActorHandle:
    """Create the actor with ``config.actor_options``, start Gym and install the tokenizer; return the handle.

    Blocks at most ``startup_timeout_s + margin_s``. On failure the actor is shut
    down and killed, and the typed error (``GymStartupError``, ``GetTimeoutError``, ...)
    is re-raised.
    """
    return spinup_nemo_gym_actors(config, tokenizer, 1, margin_s=margin_s)[0]


def spinup_nemo_gym_actors(
    config: NemoGymConfig,
    tokenizer: Tokenizer,
    num_actors: int,
    *,
    split_base_urls: bool = False,
    margin_s: float = 60.0,
) -> list[ActorHandle]:
    """``num_actors`` NemoGym actors, each with its own Gym servers, started concurrently.

    ``config.actor_options`` go to every actor (``scheduling_strategy`` or resources
    place them on other nodes). On any
    failure every actor is shut down and killed and the first typed error re-raised.
    """
    import ray

    from gym_bridge.gym.actor import NemoGym  # lazily: the actor module imports aiohttp and orjson

    # By value, not ray.put: Ray re-runs the constructor on a restart, and a put object may be gone by then.
    # Ray types an actor's handle as ``ActorHandle[T] | type[T]``, whose methods lack ``.remote``; callers
    # get our ActorHandle protocol.
    handles = [
        cast(ActorHandle, ray.remote(NemoGym).options(**actor_options(cfg)).remote(cfg, tokenizer))
        for cfg in actor_configs(config, num_actors, split_base_urls=split_base_urls)
    ]
    try:
        ray.get([h.spinup.remote() for h in handles], timeout=config.startup_timeout_s + margin_s)
    except BaseException as exc:
        for handle in handles:
            try:
                ray.get(handle.shutdown.remote(), timeout=config.shutdown_timeout_s + 10)
            except Exception:
                logger.warning("NemoGym shutdown after a failed spinup did not finish; killing the actor")
            _kill(handle)
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    return handles


def stop_nemo_gym_actors(actors: Sequence[ActorHandle], timeout_s: float = 60.0) -> None:
    """Stop each actor's Gym servers (bounded by ``timeout_s`` in all), then kill the actors, even when a
    shutdown failed or timed out; the shutdown's error is re-raised after the kills."""
    import ray

    try:
        ray.get([actor.shutdown.remote() for actor in actors], timeout=timeout_s)
    finally:
        for actor in actors:
            _kill(actor)


def _kill(actor: ActorHandle) -> None:
    """``ray.kill`` for our handle protocol (Ray types the argument as its own ``ActorHandle`` class)."""
    import ray

    ray.kill(cast("ray.actor.ActorHandle[object]", actor))
