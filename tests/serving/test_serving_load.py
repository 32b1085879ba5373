"""vLLM's request gauges on our server's ``/metrics``, counted by the engine, and a request whose client goes away
cancelled with its rows in the engine: a real OpenAIServer over HFGeneration (the tiny model, no stop token, one
row per decode batch, so a request runs for seconds and a second one waits)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing import async_wait_until

LONG = 1900
"""Tokens a row generates with no stop token (the tiny model's context is 2048): seconds of decoding."""
_GAUGE = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}\n]*\} (\S+)$", re.MULTILINE)


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[HFGeneration]:
    engine = HFGeneration(
        HFGenerationConfig(
            model=str(tiny_model_dir), max_new_tokens=LONG, stop_token_ids=[], max_batch_size=1, batch_wait_s=0.0
        )
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def server(engine: HFGeneration) -> Iterator[OpenAIServer]:
    server = OpenAIServer(engine, engine.tokenizer, served_model_name="tiny")
    server.start_in_thread()
    yield server
    server.stop_thread()


async def gauges(client: httpx.AsyncClient, server: OpenAIServer) -> dict[str, float]:
    response = await client.get(f"{server.root_url}/metrics")
    assert response.status_code == 200
    assert "# TYPE vllm:num_requests_running gauge" in response.text
    return {name: float(value) for name, value in _GAUGE.findall(response.text)}


def idle(numbers: dict[str, float]) -> bool:
    return numbers == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}


async def test_the_engine_counts_rows_running_and_waiting_and_a_gone_client_cancels_its_rows(server, engine):
    body = {"model": "tiny", "prompt": "count with me:", "max_tokens": LONG, "temperature": 1.0}
    async with httpx.AsyncClient(timeout=60) as metrics, httpx.AsyncClient(timeout=120) as callers:
        assert idle(await gauges(metrics, server))
        requests = [asyncio.ensure_future(callers.post(f"{server.base_url}/completions", json=body)) for _ in range(2)]
        last: dict[str, float] = {}

        async def one_running_one_waiting() -> bool:
            last.update(await gauges(metrics, server))
            return last == {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 1.0}

        await async_wait_until(one_running_one_waiting, 30, f"one row decoding and one queued (last: {last})")
        assert not any(r.done() for r in requests), "the rows are still generating"
        for request in requests:  # the client goes away: its connections close
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        cancelled_at = time.monotonic()

        async def drained() -> bool:
            last.update(await gauges(metrics, server))
            return idle(last)

        await async_wait_until(drained, 10, f"both rows withdrawn from the engine (last: {last})")
        withdrawn_s = time.monotonic() - cancelled_at
        assert engine.stats.rows_generated == 0, "neither row ran to its end"
        assert engine.stats.tokens_generated < LONG
        print(f"rows withdrawn {withdrawn_s:.2f} s after the client left")
        # The engine goes on serving: a short request now finishes, and the gauges are back at zero.
        short = await callers.post(f"{server.base_url}/completions", json={**body, "max_tokens": 4})
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
        assert idle(await gauges(metrics, server))
        assert engine.stats.rows_generated == 1
