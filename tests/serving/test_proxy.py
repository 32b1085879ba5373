"""The token-faithful proxy over real HTTP, in front of our own server run as a plain upstream.

The upstreams are :class:`OpenAIServer` with ``token_id_correction=False``: they ignore
carried token ids and re-tokenise the history, as stock vLLM does. A tiny FastAPI stub
stands in for an upstream only to force error statuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.serving import OpenAIServer, build_proxy
from gym_bridge.serving.drift import HEADER_CORRECTION, HEADER_DRIFT
from gym_bridge.testing import wait_until
from gym_bridge.testing.generation import WEATHER_TOOL

logger = logging.getLogger(__name__)

TRIALS = 100
MAX_TOKENS = 8
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class RecordingTransport(httpx.AsyncHTTPTransport):
    """A real transport that keeps every (request body, response body) the proxy exchanged upstream."""

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        body = await response.aread()
        if response.status_code == 200 and request.url.path.endswith("/completions"):
            self.exchanges.append((json.loads(request.content), json.loads(body)))
        return httpx.Response(response.status_code, headers=response.headers, content=body, request=request)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    engine = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=16, batch_wait_s=0.02))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain_upstreams(hf_engine):
    """Two stock-vLLM-like servers (no correction) over one engine."""
    servers = [OpenAIServer(hf_engine, hf_engine.tokenizer, token_id_correction=False) for _ in range(2)]
    for server in servers:
        server.start_in_thread()
    yield servers
    for server in servers:
        server.stop_thread()


@pytest.fixture(scope="module")
def proxy(plain_upstreams, tiny_model_dir):
    """The proxy over both upstreams, tokenizer and context length discovered from the first."""
    transport = RecordingTransport()
    # root URLs: /v1 is added; the tokenizer is loaded from the path
    server = build_proxy([u.root_url for u in plain_upstreams], str(tiny_model_dir), transport=transport)
    server.start_in_thread()
    server.transport = transport  # type: ignore[attr-defined]
    yield server
    server.stop_thread()
    server.state.generation.shutdown()


async def _chat(ac: httpx.AsyncClient, url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0}
    body.update(logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True, **extra)
    r = await ac.post(url + "/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


async def two_turns(ac: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    """Gym's pattern: turn 2 sends turn 1 back with its token ids. Drift: turn 2's prompt does not extend them.

    Both turns are seeded (by ``i``), so how many of the trials would drift is a fixed count, not a coin toss
    around the thresholds below.
    """
    user = {"role": "user", "content": f"Tell me story number {i}."}
    first = (await _chat(ac, url, [user], seed=i)).json()["choices"][0]["message"]
    assistant = {"role": "assistant", "content": first["content"] or "", **{k: first[k] for k in TOKEN_FIELDS}}
    r2 = await _chat(ac, url, [user, assistant, {"role": "user", "content": "Go on."}], seed=TRIALS + i)
    second = r2.json()["choices"][0]
    carried = first["prompt_token_ids"] + first["generation_token_ids"]
    prompt2 = second["message"]["prompt_token_ids"]
    return {
        "drifted": prompt2[: len(carried)] != carried,
        "first": first,
        "second": second,
        "headers": r2.headers,
    }


async def run_trials(url: str, n: int = TRIALS) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as ac:
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> dict[str, Any]:
            async with sem:
                return await two_turns(ac, url, i)

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_without_proxy_most_two_turn_conversations_drift(plain_upstreams):
    upstream = plain_upstreams[0]
    before = httpx.get(upstream.root_url + "/metrics").text
    results = asyncio.run(run_trials(upstream.base_url))
    drifted = sum(r["drifted"] for r in results)
    logger.warning("without the proxy: %d of %d two-turn conversations drifted", drifted, len(results))
    print(f"\nDRIFT without proxy: {drifted}/{len(results)}")
    assert drifted > len(results) // 2
    for r in results:
        assert r["headers"][HEADER_CORRECTION] == "disabled"
        assert (r["headers"][HEADER_DRIFT] != "none") == r["drifted"]
    after = httpx.get(upstream.root_url + "/metrics").text
    served = metric(after, "gym_bridge_token_drift_served_total") - metric(before, "gym_bridge_token_drift_served_total")
    assert served == drifted
    assert metric(after, "gym_bridge_token_corrections_total") == 0


def test_through_proxy_no_drift_and_upstream_logprobs(proxy, plain_upstreams):
    transport: RecordingTransport = proxy.transport
    transport.exchanges.clear()
    before = httpx.get(proxy.root_url + "/metrics").text
    results = asyncio.run(run_trials(proxy.base_url))
    drifted = sum(r["drifted"] for r in results)
    after = httpx.get(proxy.root_url + "/metrics").text
    prevented = metric(after, "gym_bridge_token_drift_prevented_total") - metric(
        before, "gym_bridge_token_drift_prevented_total"
    )
    print(f"\nDRIFT through proxy: {drifted}/{len(results)} (the correction prevented {int(prevented)})")
    assert drifted == 0
    assert prevented > len(results) // 2  # the plain render would have drifted in most of them
    assert metric(after, "gym_bridge_token_corrections_total") - metric(
        before, "gym_bridge_token_corrections_total"
    ) == len(results)
    # every message equals exactly what the upstream generated for exactly that prompt
    upstream = {tuple(req["prompt"]): resp["choices"][0] for req, resp in transport.exchanges}
    assert len(transport.exchanges) == 2 * len(results)
    for r in results:
        assert r["headers"][HEADER_CORRECTION] == "applied"
        for message, choice in ((r["first"], None), (r["second"]["message"], r["second"])):
            seen = upstream[tuple(message["prompt_token_ids"])]
            assert message["generation_token_ids"] == seen["token_ids"]
            assert message["generation_log_probs"] == seen["logprobs"]["token_logprobs"]
            if choice is not None:
                content = choice["logprobs"]["content"]
                assert [c["token"] for c in content] == [f"token_id:{t}" for t in seen["token_ids"]]
                assert [c["logprob"] for c in content] == seen["logprobs"]["token_logprobs"]
                assert choice["finish_reason"] == seen["finish_reason"]
        assert all(req["temperature"] == 1.0 and req["max_tokens"] == MAX_TOKENS for req, _ in transport.exchanges)
    # balanced over the two upstreams
    counts = [
        metric(httpx.get(u.root_url + "/metrics").text, 'gym_bridge_requests_total{endpoint="completions"}')
        for u in plain_upstreams
    ]
    print(f"upstream completions requests: {counts}")
    assert min(counts) >= 0.25 * sum(counts)
    assert proxy.state.generation.stats.requests_per_url == dict(
        zip(proxy.state.generation.cfg.base_urls, [int(c) for c in counts])
    )


def test_proxy_discovery_and_metadata(proxy, plain_upstreams):
    assert proxy.state.served_model_name == "tiny"
    assert proxy.state.profile.max_model_len == plain_upstreams[0].state.profile.max_model_len
    assert proxy.state.profile.per_request_sampling
    cards = httpx.get(proxy.base_url + "/models").json()["data"]
    assert cards[0]["id"] == "tiny"
    tok = httpx.post(proxy.root_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    direct = httpx.post(
        plain_upstreams[0].root_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert tok["tokens"] == direct["tokens"]


# ---------------------------------------------------------------------- tool calls (scripted upstream)


@pytest.fixture(scope="module")
def scripted_proxy(tiny_tokenizer):
    upstream = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, token_id_correction=False)
    upstream.start_in_thread()
    server = build_proxy([upstream.base_url], tiny_tokenizer)
    server.start_in_thread()
    server.upstream = upstream  # type: ignore[attr-defined]
    yield server
    server.stop_thread()
    server.state.generation.shutdown()
    upstream.stop_thread()


def test_tool_call_parsed_through_proxy(scripted_proxy):
    url = scripted_proxy.base_url
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with httpx.Client(timeout=60) as client:
        first = client.post(
            url + "/chat/completions",
            json={"messages": messages, "tools": [WEATHER_TOOL], "logprobs": True, "top_logprobs": 0},
        ).json()
        choice = first["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert msg["content"] is None
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": msg["tool_calls"], **{k: msg[k] for k in TOKEN_FIELDS}},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
        ]
        second = client.post(url + "/chat/completions", json={"messages": history, "tools": [WEATHER_TOOL]})
    choice2 = second.json()["choices"][0]
    assert choice2["finish_reason"] == "stop" and choice2["message"]["content"] == "I am a scripted assistant."
    carried = msg["prompt_token_ids"] + msg["generation_token_ids"]
    assert choice2["message"]["prompt_token_ids"][: len(carried)] == carried
    assert second.headers[HEADER_CORRECTION] == "applied"


# ---------------------------------------------------------------------- upstream errors (a stub)


class StubUpstream:
    """A FastAPI upstream whose /v1/completions answers with ``self.mode``'s status."""

    CONTEXT_400 = (
        "This model's maximum context length is 2048 tokens. However, you requested 4096 tokens "
        "(4000 in the messages, 96 in the completion). Please reduce the length of the messages or completion."
    )

    def __init__(self) -> None:
        self.mode = "429"
        self.calls = 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions() -> JSONResponse:
            self.calls += 1
            if self.mode == "429":
                return JSONResponse({"error": {"message": "Too many requests", "code": 429}}, status_code=429)
            if self.mode == "context":
                body = {"object": "error", "message": self.CONTEXT_400, "type": "BadRequestError", "code": 400}
                return JSONResponse(body, status_code=400)
            return JSONResponse({"choices": []})  # malformed

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the stub upstream starting")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def stub_proxy(tiny_tokenizer):
    stub = StubUpstream()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    fast = {"max_retries": 1, "backoff_base_s": 0.01, "unhealthy_cooldown_s": 0.0}
    common = {"upstream_model": "stub", "served_model_name": "tiny", "max_model_len": 2048, "http_options": fast}
    server = build_proxy([stub.url], tiny_tokenizer, **common)
    server.start_in_thread()
    dead_server = build_proxy([dead], tiny_tokenizer, **common)
    dead_server.start_in_thread()
    yield stub, server, dead_server
    for s in (server, dead_server):
        s.stop_thread()
        s.state.generation.shutdown()
    stub.stop()


def _post(server: OpenAIServer, content: str = "Hi") -> httpx.Response:
    return httpx.post(
        server.base_url + "/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=60,
    )


def test_upstream_429_stays_429(stub_proxy):
    stub, server, _ = stub_proxy
    stub.mode, stub.calls = "429", 0
    r = _post(server)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == 429 and "429" in r.json()["error"]["message"]
    assert stub.calls == 2  # one retry, then the status goes to the client, whose retry policy owns it
    assert metric(httpx.get(server.root_url + "/metrics").text, 'gym_bridge_upstream_errors_total{status="429"}') >= 1


def test_upstream_context_length_400_reads_as_gym_length_finish(stub_proxy):
    stub, server, _ = stub_proxy
    stub.mode, stub.calls = "context", 0
    r = _post(server)
    assert r.status_code == 400 and stub.calls == 1  # not retried
    message = r.json()["error"]["message"]
    # NeMo-Gym's vllm_model turns a 400 mentioning "context length" into an empty finish_reason="length" turn
    assert "context length" in message
    # a prompt over the context the proxy knows is refused the same way before reaching the upstream
    stub.calls = 0
    r = _post(server, "one two three " * 800)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"] and stub.calls == 0


def test_unreachable_and_malformed_upstreams(stub_proxy):
    stub, server, dead_server = stub_proxy
    r = _post(dead_server)
    assert r.status_code == 503, r.text
    stub.mode = "malformed"
    r = _post(server)
    assert r.status_code == 502 and "choices" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- units: the HTTP client's additions


def test_http_generation_sends_per_row_sampling_and_keeps_statuses():
    import pickle

    import torch

    from gym_bridge.batched import BatchedDataDict
    from gym_bridge.failures import GenerationUnavailable, RolloutDataFailure
    from gym_bridge.generation.openai_http import OpenAIHTTPGeneration

    sent: list[dict[str, Any]] = []
    status = {"code": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        if status["code"] != 200:
            return httpx.Response(status["code"], json={"error": {"message": "nope"}})
        n = body["max_tokens"]
        return httpx.Response(
            200,
            json={"choices": [{"token_ids": [7] * n, "logprobs": {"token_logprobs": [-1.0] * n}, "finish_reason": "length"}]},
        )

    gen = OpenAIHTTPGeneration(
        {"base_urls": ["http://u/v1"], "model": "m", "max_new_tokens": 5, "max_retries": 0},
        transport=httpx.MockTransport(handler),
    )
    data = BatchedDataDict(
        {
            "input_ids": torch.tensor([[1, 2], [3, 4]]),
            "input_lengths": torch.tensor([2, 2]),
            "temperature": [0.5, None],
            "top_p": [0.9, None],
            "top_k": [-1, None],
            "max_new_tokens": [2, None],
        }
    )
    try:
        out = gen.generate(data)
        assert out["generation_lengths"].tolist() == [2, 5]
        by_prompt = {tuple(b["prompt"]): b for b in sent}
        assert by_prompt[(1, 2)]["temperature"] == 0.5 and by_prompt[(1, 2)]["top_p"] == 0.9
        assert by_prompt[(1, 2)]["top_k"] == -1 and by_prompt[(1, 2)]["max_tokens"] == 2
        assert by_prompt[(3, 4)]["temperature"] == 1.0 and "top_k" not in by_prompt[(3, 4)]
        for code, kind in ((429, GenerationUnavailable), (422, RolloutDataFailure)):
            status["code"] = code
            with pytest.raises(kind) as info:
                gen.generate(data)
            assert info.value.http_status == code
            assert pickle.loads(pickle.dumps(info.value)).http_status == code  # survives Ray
    finally:
        gen.shutdown()


def test_added_latency_per_request(scripted_proxy):
    """Sequential chats, directly against the upstream and through the proxy, interleaved.

    The scripted upstream does no model compute, so the difference is the proxy's own
    cost: a local render plus one loopback HTTP hop.
    """
    body = {"messages": [{"role": "user", "content": "Reply with exactly: ok"}], "max_tokens": 4}
    urls = (scripted_proxy.upstream.base_url, scripted_proxy.base_url)
    timings: dict[str, list[float]] = {url: [] for url in urls}
    with httpx.Client(timeout=60) as client:
        for url in urls:  # warm-up
            client.post(url + "/chat/completions", json=body)
        for _ in range(50):
            for url in urls:
                start = time.perf_counter()
                r = client.post(url + "/chat/completions", json=body)
                timings[url].append(time.perf_counter() - start)
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    direct, proxied = (statistics.median(timings[u]) for u in urls)
    print(f"\nLATENCY median direct {direct * 1e3:.1f} ms, proxy {proxied * 1e3:.1f} ms, added {(proxied - direct) * 1e3:.1f} ms")
    assert proxied - direct < 0.5
