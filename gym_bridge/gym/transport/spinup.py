"""Starting and stopping NemoGym actors: create them with their options, start Gym, and clean up on any failure."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from gym_bridge.gym.transport.actor_config import NemoGymConfig, actor_configs
from gym_bridge.types import ActorHandle, Tokenizer

if TYPE_CHECKING:
    import ray.actor


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


def start_nemo_gym_actors(
    config: NemoGymConfig,
    tokenizer: Tokenizer,
    num_actors: int = 1,
    *,
    split_base_urls: bool = False,
    margin_s: float = 60.0,
) -> list[ActorHandle]:
    """``num_actors`` NemoGym actors, each with its own Gym servers, started concurrently (with
    ``config.gym_head``: each using the Gym already running there, which stopping them leaves running), each with
    the tokenizer installed: the one way to start actors without a manager (a whole stack:
    :func:`~gym_bridge.recipes.launch.start_nemo_gym`).

    ``config.actor_options`` go to every actor (``scheduling_strategy`` or resources place them on other nodes).
    Blocks at most ``startup_timeout_s + margin_s``. On any failure every actor is shut down and killed and the first
    typed error (``GymStartupError``, ``GetTimeoutError``, ...) re-raised.
    """
    import ray

    from gym_bridge.gym.transport.actor import NemoGym  # lazily: the actor module imports aiohttp and orjson

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


def start_nemo_gym_actor(config: NemoGymConfig, tokenizer: Tokenizer, *, margin_s: float = 60.0) -> ActorHandle:
    """:func:`start_nemo_gym_actors` for one actor, same parameters: its handle."""
    return start_nemo_gym_actors(config, tokenizer, 1, margin_s=margin_s)[0]


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
