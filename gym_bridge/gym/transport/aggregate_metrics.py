"""Asking Gym's servers for their aggregate metrics: each scoring server's ``/aggregate_metrics`` over the rollouts it
ran, side by side, each bounded, each answer decoded through the trust boundary and checked to be Gym's metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymMetricsError
from gym_bridge.json_types import JsonObject

MAX_ANSWER_BYTES = 256 * 1024 * 1024
"""The largest ``/aggregate_metrics`` answer read (one entry per task, a few statistics each)."""
_JSON_HEADERS = {"Content-Type": "application/json"}


class _Answer(BaseModel):
    """Gym's ``AggregateMetrics``: the fields the eval-run file holds, checked for shape."""

    model_config = ConfigDict(extra="allow")

    agent_metrics: dict[str, object] = {}
    key_metrics: dict[str, object] = {}
    group_level_metrics: list[dict[str, object]] = []
    repeat_level_metrics: list[dict[str, object]] = []
    perf_summary: dict[str, object] | None = None


async def aggregate_metrics(
    client: aiohttp.ClientSession,
    urls: Mapping[str, str],
    groups: Mapping[str, list[JsonObject]],
    timeout_s: float,
) -> dict[str, JsonObject]:
    """Each server's answer to ``POST /aggregate_metrics`` with ``{"verify_responses": rows}`` for its group.

    Raises:
        GymMetricsError: a server is not running, did not answer within ``timeout_s``, answered an error status or
            something other than Gym's metrics (the first such server, named).
    """
    missing = sorted(set(groups) - set(urls))
    if missing:
        raise GymMetricsError(f"no running Gym server named {missing[0]!r} to score its rollouts")
    names = list(groups)
    answers = await asyncio.gather(*(_ask(client, name, urls[name], groups[name], timeout_s) for name in names))
    return dict(zip(names, answers, strict=True))


async def _ask(
    client: aiohttp.ClientSession, name: str, url: str, rows: list[JsonObject], timeout_s: float
) -> JsonObject:
    where = f"Gym server {name!r} /aggregate_metrics at {url}"
    body = orjson.dumps({"verify_responses": rows})
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(f"{url}/aggregate_metrics", data=body, headers=_JSON_HEADERS) as response:
                status, raw = response.status, await response.content.read(MAX_ANSWER_BYTES + 1)
    except TimeoutError:
        raise GymMetricsError(f"{where}: no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise GymMetricsError(f"{where}: {type(exc).__name__}: {shown(exc)}") from None
    if status >= 400:
        raise GymMetricsError(f"{where}: status {status}: {shown(raw[:500].decode(errors='replace'))}")
    if len(raw) > MAX_ANSWER_BYTES:
        raise GymMetricsError(f"{where}: the answer is larger than {MAX_ANSWER_BYTES} bytes")
    try:
        answer = _Answer.model_validate(json_io.loads_object(raw, where))
    except UntrustedInputError as exc:
        raise GymMetricsError(str(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise GymMetricsError(f"{where}: field {field!r}: {first['msg']}") from None
    return answer.model_dump(mode="json")
