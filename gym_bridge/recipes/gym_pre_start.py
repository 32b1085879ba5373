"""The steps every front end takes around starting Gym, written once: the endpoints' preflight before anything starts,
and the rows routed by the launched Gym's config before any is sent (``gym-bridge eval``, training, the examples)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import SecretStr

    from gym_bridge.gym.protocol.routing import GymRoutes
    from gym_bridge.json_types import JsonObject
    from gym_bridge.preflight import EndpointCheck
    from gym_bridge.types import ActorHandle

logger = logging.getLogger(__name__)

ROUTES_TIMEOUT_S = 60.0
"""How long the launched actor has to answer with its Gym routes."""


def preflight(
    base_urls: Sequence[str],
    model_name: str,
    *,
    tools: bool,
    timeout_s: float,
    api_key: SecretStr | str | None,
    label: str | None = None,
) -> list[EndpointCheck]:
    """Check every endpoint in ``base_urls`` (:func:`~gym_bridge.preflight.preflight_endpoints`) and log each
    result (``preflight <line>``, or ``preflight <label>: <line>``); raises ``PreflightError``."""
    from gym_bridge.preflight import preflight_endpoints

    checks = preflight_endpoints(list(base_urls), model_name, tools=tools, timeout_s=timeout_s, api_key=api_key)
    for check in checks:
        if label is None:
            logger.info("preflight %s", check.line)
        else:
            logger.info("preflight %s: %s", label, check.line)
    return checks


def route_on_gym(
    rows: Sequence[JsonObject], actor: ActorHandle, labels: Sequence[str]
) -> tuple[list[JsonObject], list[str]]:
    """Each row with the agent the launched Gym config routes it to (``task_source`` rows resolved by Gym's own
    resolver; a materialized row stamped with the environment server its taskset routes to), a row that needs no
    change returned as the same object; and one problem per row that routes nowhere, named by its label."""
    import ray

    routes: GymRoutes = ray.get(actor.routes.remote(), timeout=ROUTES_TIMEOUT_S)
    return routes.route_all(list(rows), list(labels))
