"""Starting Ray the way these machines need it: local, loopback only, small, no dashboard."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

logger = logging.getLogger(__name__)

#: How often a local start is tried: Ray gives its raylet a fixed 30 s to register, which a busy
#: 2-core machine can miss ("The current node timed out during startup").
START_ATTEMPTS = 3

LOOPBACK_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for clusters beyond one machine. While it is on (Linux's default), Ray swaps a node address of
127.0.0.1 for the machine's routable one (``services.resolve_ip_for_localhost``), in ``ray.init`` and in every
``ray.init(address="127.0.0.1:...")`` that joins, and its servers then bind every interface. Off, a node keeps
127.0.0.1, and the GCS, raylet, object manager, agents and workers bind loopback only; ``ray start --address``
(a second node) refuses to run."""

_RAY_ENV_DEFAULTS = {
    # Under `uv run`, Ray would otherwise try to ship the working directory to workers.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def apply_ray_env() -> None:
    """Set this process's Ray environment defaults (no uv runtime env, no usage stats) before it joins a Ray."""
    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # Ray reads this flag once, at import; honour the environment even if ray was imported first.
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] not in (
        "0",
        "false",
        "False",
    )


def _keep_node_on_loopback() -> None:
    """Turn Ray's multi-machine switch off here and for every process started from here (Ray's own processes,
    the workers, the servers a worker starts that join this Ray by its ``127.0.0.1`` address)."""
    os.environ[LOOPBACK_FLAG] = "0"
    # Ray reads the flag once, at import.
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray(*, num_cpus: int | None = None, object_store_memory: int = 256 * 1024**2, **kwargs: Any) -> None:
    """Connect to a running Ray (``RAY_ADDRESS``) or start a local one whose processes listen on 127.0.0.1 only
    (retried when the raylet misses Ray's start-up window on a busy machine).

    A local start turns Ray's multi-machine switch (:data:`LOOPBACK_FLAG`) off in this process's environment,
    so processes started from it join this Ray by its loopback address; a second node cannot join it."""
    apply_ray_env()
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(ignore_reinit_error=True, **kwargs)
        return
    _keep_node_on_loopback()
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(
                num_cpus=num_cpus,
                object_store_memory=object_store_memory,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                ignore_reinit_error=True,
                logging_level=logging.WARNING,
                **kwargs,
            )
            return
        except Exception as exc:
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(exc):
                raise
            logger.warning("Ray did not start (%s); attempt %d of %d", exc, attempt + 1, START_ATTEMPTS)
            ray.shutdown()
