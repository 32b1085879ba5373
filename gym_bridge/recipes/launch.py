"""The one public way to start a NeMo-Gym rollout stack: preflight, Ray, NemoGym actors, manager.

``gym-bridge eval``, ``gym-bridge train`` and the examples all start Gym through :func:`start_nemo_gym` (or its
``with`` form :func:`launch_nemo_gym`, same parameters) from a :class:`GymLaunchSpec`, written by hand or read from a
training config (:func:`~gym_bridge.config.training.nemo_gym_launch_spec`), so the order is the same everywhere:
every endpoint is checked first (a bad one fails in seconds, before Ray or Gym start), then Ray is started if nothing
started it, then the actors (each with its own Gym servers, or, with ``NemoGymConfig.gym_head``, each using the Gym
already running there, which nothing here starts or stops), then the ``RolloutManager``. A failure at any step
undoes the steps before it. :func:`spinup_nemo_gym_actor` is NeMo-RL's spin-up of one actor, with NeMo-RL's
signature.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from gym_bridge.config.launch_spec import GymLaunchSpec
from gym_bridge.config.nemo_rl_gym import nemo_rl_gym_config
from gym_bridge.json_types import JsonMapping
from gym_bridge.recipes.gym_pre_start import preflight

if TYPE_CHECKING:
    from gym_bridge.gym.transport.admission import AdmissionControl
    from gym_bridge.rollout.manager import RolloutManager
    from gym_bridge.types import ActorHandle, GenerationConfig, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class NemoGymRollouts:
    """What :func:`start_nemo_gym` started: the manager, the actors it owns, and whether it started Ray."""

    manager: RolloutManager
    actors: list[ActorHandle]
    started_ray: bool = False

    @property
    def actor(self) -> ActorHandle:
        """The first (usually the only) actor."""
        return self.actors[0]

    @property
    def admission(self) -> AdmissionControl:
        """The rollout client's admission control, for other clients on the same engine (validation) to share."""
        from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl

        backend = self.manager.backend
        if not isinstance(backend, AsyncNemoGymRolloutImpl):
            raise TypeError(f"the manager's backend is {type(backend).__name__}, not the nemo_gym backend")
        return backend.client.admission

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every actor's Gym servers and the actors; safe to call more than once. A running Gym the actors used
        (``gym_head``) is left running."""
        from gym_bridge.gym.transport.spinup import stop_nemo_gym_actors

        stop_nemo_gym_actors(self.actors, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """:meth:`shutdown`, then stop Ray if :func:`start_nemo_gym` started it."""
        try:
            self.shutdown(timeout_s)
        finally:
            if self.started_ray:
                import ray

                ray.shutdown()
                self.started_ray = False


def start_nemo_gym(spec: GymLaunchSpec, tokenizer: Tokenizer) -> NemoGymRollouts:
    """Preflight every endpoint, start Ray (unless running), the actors and the manager; the caller stops them.

    Raises:
        PreflightError: an endpoint failed its checks (nothing was started).
        GymStartupError, ...: an actor could not start its Gym servers (Ray stopped again if started here).
    """
    if spec.preflight:
        preflight(
            spec.gym.base_urls,
            spec.gym.model_name,
            tools=spec.uses_tools,
            timeout_s=spec.preflight_timeout_s,
            api_key=spec.gym.api_key,
        )
    import ray

    from gym_bridge.gym.transport.spinup import start_nemo_gym_actors, stop_nemo_gym_actors
    from gym_bridge.ray_utils import init_ray
    from gym_bridge.rollout.manager import RolloutManager

    started_ray = not ray.is_initialized()
    init_ray(num_cpus=spec.ray_num_cpus)
    if spec.gym.gym_head is not None:  # the actors' own attach line is logged in their Ray workers, not here
        logger.info("using the NeMo-Gym already running at %s: its servers are neither started nor stopped here",
                    spec.gym.gym_head)  # fmt: skip
    try:
        actors = start_nemo_gym_actors(spec.gym, tokenizer, spec.num_actors, split_base_urls=spec.split_base_urls)
        try:
            manager = RolloutManager(
                tokenizer=tokenizer,
                # the nemo_gym backend takes one actor or a list of them (nemo_gym_actors); the manager's type
                # names one
                task_to_env={"nemo_gym": cast("ActorHandle", actors) if len(actors) > 1 else actors[0]},
                num_generations_per_prompt=spec.num_generations_per_prompt,
                max_seq_len=spec.max_seq_len,
                # the spec holds it as a plain mapping of GenerationConfig keys
                generation_config=cast("GenerationConfig", dict(spec.generation_config)),
                use_nemo_gym=True,
                mask_env_flagged_samples=spec.mask_env_flagged_samples,
                timeouts=spec.timeouts,
                retry_policy=spec.retry_policy,
                **{name: getattr(spec.manager_options, name) for name in spec.manager_options.model_fields_set},
            )
        except BaseException:
            stop_nemo_gym_actors(actors, spec.gym.shutdown_timeout_s + 10)
            raise
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    return NemoGymRollouts(manager=manager, actors=actors, started_ray=started_ray)


@contextmanager
def launch_nemo_gym(
    spec: GymLaunchSpec, tokenizer: Tokenizer, *, stop_timeout_s: float = 60.0
) -> Iterator[NemoGymRollouts]:
    """:func:`start_nemo_gym` for a ``with`` block: everything it started is stopped at the end."""
    rollouts = start_nemo_gym(spec, tokenizer)
    try:
        yield rollouts
    finally:
        rollouts.close(stop_timeout_s)


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
    """NeMo-RL's spin-up, with its signature: the NemoGym actor for ``env_configs["nemo_gym"]`` (NeMo-RL's
    ``master_config.env``) against ``base_urls``, started, with the tokenizer installed
    (:func:`~gym_bridge.config.nemo_rl_gym.nemo_rl_gym_config`, then
    :func:`~gym_bridge.gym.transport.spinup.start_nemo_gym_actor`).

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
    from gym_bridge.gym.transport.spinup import start_nemo_gym_actor

    return start_nemo_gym_actor(config, tokenizer)
