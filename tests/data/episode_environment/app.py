"""An environment server written to NeMo-Gym 0.7's episode protocol, for tests (``tests/gym/test_gym_episodes.py``).

It takes Gym's episode request (``BaseEpisodeRequest``: ``episode_id`` plus the materialized task) on ``POST /run``, as
Gym's own environment servers (``single_agent_turn``, ``legacy_agent``) are written: a ``BaseEnvironmentServer`` with
its request and response models. The task's ``task_input`` is an ordinary Gym row (``responses_create_params`` and
verifier fields); the server runs it through the agent it binds (``agent_server``: its ``/run``, model calls and
``/verify``) and answers ``BaseEpisodeResponse`` with that result, so the record is scored by its top-level ``reward``.

Two keys of ``task_input`` are the test's own: ``fail`` ("terminal" or "retryable") answers a handled ``failure``
(``HandledEpisodeError``) with that terminality instead of running the agent; ``attempts_log`` names a file to which
every episode this server receives appends ``{"rollout_id", "attempt"}``, one JSON line each.
"""

import json
from typing import Any, Literal

from fastapi import Body
from nemo_gym.base_environment_server import (
    BaseEnvironmentServer,
    BaseEnvironmentServerConfig,
    CleanupContext,
    HandledEpisodeError,
)
from nemo_gym.config_types import AgentServerRef, AggregateMetrics, AggregateMetricsRequest
from nemo_gym.episode_types import BaseEpisodeRequest, BaseEpisodeResponse, EpisodeFailure
from nemo_gym.server_utils import get_response_json, is_nemo_gym_fastapi_entrypoint, raise_for_status
from pydantic import BaseModel, ConfigDict, PositiveFloat

TEST_KEYS = ("fail", "attempts_log")


class EpisodeTaskInput(BaseModel):
    """A Gym row: the agent's request and the verifier's fields, plus the test's own keys."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: dict[str, Any]
    fail: Literal["terminal", "retryable"] | None = None
    attempts_log: str | None = None


class EpisodeRequest(BaseEpisodeRequest[EpisodeTaskInput]):
    """One episode: its identity and the materialized task."""


class EpisodeResponse(BaseEpisodeResponse[dict[str, Any]]):
    """The agent's ``/run`` result, or a handled failure."""


class EpisodeEnvironmentServerConfig(BaseEnvironmentServerConfig):
    model_config = ConfigDict(extra="forbid")

    agent_server: AgentServerRef
    cleanup_timeout_seconds: PositiveFloat = 30


class EpisodeEnvironmentServer(BaseEnvironmentServer[EpisodeRequest, EpisodeResponse]):
    """Run one materialized task through the bound agent's ``/run``."""

    config: EpisodeEnvironmentServerConfig
    request_model = EpisodeRequest
    response_model = EpisodeResponse

    async def run(self, request: EpisodeRequest, cleanup: CleanupContext) -> EpisodeResponse:
        task = request.task.task_input
        if task.attempts_log:
            with open(task.attempts_log, "a") as log:
                log.write(json.dumps(request.episode_id.model_dump(mode="json")) + "\n")
        if task.fail is not None:
            raise HandledEpisodeError(
                EpisodeFailure(
                    failure_reason=f"the task asked for a {task.fail} failure",
                    terminal=task.fail == "terminal",
                    stage="agent",
                )
            )
        row = task.model_dump(mode="json", exclude=set(TEST_KEYS))
        response = await self.server_client.post(server_name=self.config.agent_server.name, url_path="/run", json=row)
        await raise_for_status(response)
        result = await get_response_json(response)
        return EpisodeResponse(
            episode_id=request.episode_id,
            task_id=request.task.task_id,
            result={key: value for key, value in result.items() if not key.startswith("_ng_")},
        )

    async def aggregate_metrics(self, body: AggregateMetricsRequest = Body()) -> AggregateMetrics:  # noqa: B008
        """Forward to the agent, which aggregates its own rollouts."""
        response = await self.server_client.post(
            server_name=self.config.agent_server.name, url_path="/aggregate_metrics", json=body
        )
        await raise_for_status(response)
        return AggregateMetrics.model_validate(await get_response_json(response))


if __name__ == "__main__":
    EpisodeEnvironmentServer.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):
    app = EpisodeEnvironmentServer.run_webserver()
