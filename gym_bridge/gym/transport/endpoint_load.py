"""How loaded the model endpoints are: vLLM's request gauges read from each endpoint's ``/metrics``.

vLLM (and any server in its dialect) reports ``vllm:num_requests_waiting`` (queued, not yet scheduled) and
``vllm:num_requests_running`` in Prometheus text; :func:`read_endpoint_load` sums them over the endpoints
that answer, with a bound, and :class:`~gym_bridge.gym.transport.admission.AdmissionControl` reads a waiting queue as
a saturated engine.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import aiohttp

from gym_bridge.gym.transport.admission import EndpointLoad

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
_BODY_LIMIT = 1 << 20
_GAUGE = re.compile(
    rf"^(?P<name>{re.escape(WAITING)}|{re.escape(RUNNING)})(?:\{{[^}}\n]*\}})?[ \t]+(?P<value>\S+)", re.MULTILINE
)


def metrics_url(base_url: str) -> str:
    """``/metrics`` of the server behind an OpenAI ``base_url`` (``http://host:port/v1`` -> ``http://host:port``)."""
    root = base_url.rstrip("/")
    return f"{root.removesuffix('/v1')}/metrics"


def parse_request_gauges(text: str) -> tuple[float | None, float | None]:
    """``(waiting, running)`` summed over their label sets in Prometheus text; None for a gauge not there."""
    sums: dict[str, float] = {}
    for match in _GAUGE.finditer(text):
        try:
            value = float(match["value"])
        except ValueError:
            continue
        sums[match["name"]] = sums.get(match["name"], 0.0) + value
    return sums.get(WAITING), sums.get(RUNNING)


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[float | None, float | None] | None:
    """One endpoint's gauges; None when it does not answer."""
    try:
        async with session.get(url) as response:
            body = await response.content.read(_BODY_LIMIT)
            if response.status != 200:
                return (None, None)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return parse_request_gauges(body.decode("utf-8", "replace"))


async def read_endpoint_load(base_urls: Sequence[str], timeout_s: float) -> EndpointLoad:
    """The endpoints' summed request gauges, each read within ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        answers = await asyncio.gather(*(_one(session, metrics_url(url)) for url in base_urls))
    reached = [a for a in answers if a is not None]
    waiting = [w for w, _ in reached if w is not None]
    running = [r for _, r in reached if r is not None]
    return EndpointLoad(
        reachable=bool(reached),
        waiting=sum(waiting) if waiting else None,
        running=sum(running) if running else None,
    )
