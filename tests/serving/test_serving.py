"""The OpenAI-compatible server over real HTTP: the tiny HF model and the scripted policy."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.openai_http import OpenAIHTTPGeneration, OpenAIHTTPGenerationConfig
from gym_bridge.generation.scripted import SCRIPTED_LOGPROB, ScriptedGeneration
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing.generation import WEATHER_TOOL

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir: Path):
    engine = HFGeneration(
        HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=12, temperature=TEMPERATURE, batch_wait_s=0.05)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_server(hf_engine):
    server = OpenAIServer(hf_engine, hf_engine.tokenizer, served_model_name="tiny")
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def scripted_server(tiny_tokenizer):
    server = OpenAIServer(ScriptedGeneration(tiny_tokenizer, think=True), tiny_tokenizer, reasoning_parser=True)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def _chat(client: httpx.Client, server: OpenAIServer, **body) -> dict:
    r = client.post(server.base_url + "/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


USER = [{"role": "user", "content": "What is 12 + 7?"}]


def test_health_models_detokenize(client, hf_server):
    assert hf_server.base_url.startswith("http://127.0.0.1:") and hf_server.base_url.endswith("/v1")
    assert client.get(hf_server.root_url + "/health").status_code == 200
    ids = [m["id"] for m in client.get(hf_server.base_url + "/models").json()["data"]]
    assert ids[0] == "tiny" and len(ids) == 2
    toks = client.post(hf_server.root_url + "/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0 and toks["max_model_len"] == 2048
    back = client.post(hf_server.root_url + "/detokenize", json={"tokens": toks["tokens"]}).json()
    assert back == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize("temperature", [None, 1.3])
def test_chat_logprobs_match_a_forward_pass(client, hf_server, hf_engine, temperature):
    # None samples with the engine's profile; 1.3 is honoured per request, as vLLM does.
    sampling = {} if temperature is None else {"temperature": temperature, "top_p": 0.9}
    body = _chat(
        client, hf_server, model="tiny", messages=USER, logprobs=True, top_logprobs=0, return_token_ids=True, **sampling
    )
    choice = body["choices"][0]
    msg = choice["message"]
    prompt, gen, lps = msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]
    assert gen and len(lps) == len(gen)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(gen),
        "total_tokens": len(prompt) + len(gen),
    }
    with torch.no_grad():
        logits = hf_engine.model(torch.tensor([prompt + gen])).logits[0].float()
    scale = temperature or TEMPERATURE
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1] / scale, -1).gather(-1, torch.tensor(gen)[:, None])
    assert torch.allclose(torch.tensor(lps), expected.squeeze(-1), atol=1e-4)
    # token_id labels and return_token_ids agree with /tokenize and the generated ids
    content = choice["logprobs"]["content"]
    assert [int(c["token"].removeprefix("token_id:")) for c in content] == gen == choice["token_ids"]
    assert [c["logprob"] for c in content] == lps
    toks = client.post(hf_server.root_url + "/tokenize", json={"messages": USER}).json()["tokens"]
    assert toks == prompt == body["prompt_token_ids"]


def test_max_tokens_stop_and_n(client, hf_server):
    body = _chat(client, hf_server, messages=USER, max_tokens=3, n=2, temperature=TEMPERATURE, top_p=1.0)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert len(c["message"]["generation_token_ids"]) <= 3
        if len(c["message"]["generation_token_ids"]) == 3:
            assert c["finish_reason"] in ("length", "stop")
    greedy = _chat(client, hf_server, messages=USER, temperature=0, max_tokens=4)
    assert greedy["choices"][0]["finish_reason"] == "length"


def test_two_turn_splice_keeps_generated_ids(client, hf_server):
    found_difference = False
    for attempt in range(6):
        first = _chat(client, hf_server, messages=[{"role": "user", "content": f"Say something {attempt}."}])
        msg1 = first["choices"][0]["message"]
        carried = msg1["prompt_token_ids"] + msg1["generation_token_ids"]
        history = [
            {"role": "user", "content": f"Say something {attempt}."},
            {
                "role": "assistant",
                "content": msg1["content"] or "",
                **{k: msg1[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
            },
            {"role": "user", "content": "And again?"},
        ]
        second = _chat(client, hf_server, messages=history, max_tokens=2)
        prompt2 = second["choices"][0]["message"]["prompt_token_ids"]
        assert prompt2[: len(carried)] == carried
        assert len(prompt2) > len(carried)
        # chat /tokenize goes through the same splice
        assert client.post(hf_server.root_url + "/tokenize", json={"messages": history}).json()["tokens"] == prompt2
        plain = [
            {k: v for k, v in m.items() if not k.endswith("token_ids") and k != "generation_log_probs"} for m in history
        ]
        rendered = client.post(hf_server.root_url + "/tokenize", json={"messages": plain}).json()["tokens"]
        if rendered[: len(carried)] != carried:
            found_difference = True
            break
    assert found_difference, "the random model's text always round-tripped; the splice was never needed"


def test_concurrent_requests_are_batched(client, hf_server, hf_engine):
    before = hf_engine.stats.async_batches_run

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as ac:
            return await asyncio.gather(
                *(
                    ac.post(
                        hf_server.base_url + "/chat/completions",
                        json={"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4},
                    )
                    for i in range(8)
                )
            )

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    assert hf_engine.stats.async_batches_run - before < 8


def test_completions(client, hf_server, tiny_tokenizer):
    url = hf_server.base_url + "/completions"
    r = client.post(
        url,
        json={
            "prompt": "The quick",
            "max_tokens": 4,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == tiny_tokenizer.encode("The quick")
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == choice["token_ids"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) <= 4
    r = client.post(url, json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    r = client.post(url, json={"prompt": ["Hello", "The"], "max_tokens": 2})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = client.post(url, json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"content": "no role"}]}, 400, "role"),
        ({"messages": USER, "model": "gpt-4"}, 404, "gpt-4"),
        ({"messages": USER, "n": 0}, 400, "n"),
        ({"messages": USER, "n": 17}, 400, "at most 16"),
        ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": USER, "stream": True}, 400, "stream"),
        ({"messages": USER, "temperature": -1.0}, 400, "temperature"),
        ({"messages": USER, "top_p": 0}, 400, "top_p"),
        ({"messages": USER, "top_logprobs": 3, "logprobs": True}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "one two three " * 800}]}, 400, "context length"),
        (
            {
                "messages": [
                    USER[0],
                    {"role": "assistant", "content": "x", "prompt_token_ids": "bad", "generation_token_ids": [1]},
                ]
            },
            400,
            "prompt_token_ids",
        ),
        ({"messages": USER, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ],
)
def test_bad_chat_requests(client, hf_server, body, status, needle):
    r = client.post(hf_server.base_url + "/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == status
    assert needle in err["message"]


def test_bad_raw_bodies(client, hf_server):
    url = hf_server.base_url + "/chat/completions"
    r = client.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post(url, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = client.post(url, content=b"x" * (8 * 1024 * 1024 + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post(hf_server.root_url + "/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400
    r = client.post(hf_server.root_url + "/tokenize", json={})
    assert r.status_code == 400
    r = client.post(hf_server.base_url + "/completions", json={"prompt": [], "max_tokens": 2})
    assert r.status_code == 400


def test_a_shut_down_engine_answers_503(client, tiny_tokenizer):
    """An engine that was shut down is a 503 a client may retry elsewhere, not a server bug's 500."""
    engine = OpenAIHTTPGeneration(OpenAIHTTPGenerationConfig(base_urls=["http://127.0.0.1:9/v1"], model="tiny"))
    engine.shutdown()
    server = OpenAIServer(engine, tiny_tokenizer)
    server.start_in_thread()
    try:
        r = client.post(server.base_url + "/completions", json={"prompt": "Hello", "max_tokens": 2})
    finally:
        server.stop_thread()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == "the generation engine is not available: OpenAIHTTPGeneration was shut down"


def test_scripted_tool_call_then_answer_with_reasoning(client, scripted_server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = _chat(client, scripted_server, messages=messages, tools=[WEATHER_TOOL], logprobs=True, top_logprobs=0)
    choice = body["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "I follow my script."
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]+", call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["logprob"] == pytest.approx(SCRIPTED_LOGPROB) for c in choice["logprobs"]["content"])

    # Gym's second turn: the assistant message carries the ids, content null, then the tool result.
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": msg["tool_calls"],
            **{k: msg[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
    ]
    second = _chat(client, scripted_server, messages=history, tools=[WEATHER_TOOL])
    choice2 = second["choices"][0]
    assert choice2["finish_reason"] == "stop"
    assert choice2["message"]["content"] == "I am a scripted assistant."
    assert choice2["message"]["tool_calls"] == []
    carried = msg["prompt_token_ids"] + msg["generation_token_ids"]
    assert choice2["message"]["prompt_token_ids"][: len(carried)] == carried


def test_scripted_exact_reply_and_sampling_free(client, scripted_server):
    body = _chat(
        client,
        scripted_server,
        messages=[{"role": "user", "content": "Reply with exactly: blue sky"}],
        temperature=1.3,
        top_p=0.9,
    )
    assert body["choices"][0]["message"]["content"] == "blue sky"


def test_accepted_connections_have_tcp_nodelay(scripted_server):
    """Nagle on an accepted socket stalled every keep-alive response ~40 ms (headers and body are two writes)."""
    host, port = scripted_server.root_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        connections = list(scripted_server._server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_async_start_stop(tiny_tokenizer):
    async def run() -> None:
        async with OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, served_model_name="s") as server:
            async with httpx.AsyncClient() as ac:
                r = await ac.post(server.base_url + "/chat/completions", json={"model": "s", "messages": USER})
                assert r.json()["choices"][0]["message"]["content"] == "I am a scripted assistant."
        assert server.base_url is not None

    asyncio.run(run())


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_serve_stops_on_sigterm(tiny_model_dir):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_bridge.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--policy",
            "scripted",
            "--port",
            "0",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            match = re.search(r"serving .* at (http://\S+/v1)", line)
            url = match.group(1) if match else None
        assert url, "serve never logged its URL"
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
        listening = [
            c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_responses_say_which_weight_version_generated_them(client, tiny_model_dir: Path):
    engine = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=6, temperature=TEMPERATURE))
    server = OpenAIServer(engine, engine.tokenizer, served_model_name="tiny")
    server.start_in_thread()
    try:
        first = client.post(server.base_url + "/chat/completions", json={"messages": USER})
        assert first.json()["weight_version"] == 0 and first.headers["x-gym-bridge-weight-version"] == "0"
        torch.manual_seed(3)
        new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
        engine.update_weights(new_weights, 3)
        chat = client.post(server.base_url + "/chat/completions", json={"messages": USER, "return_token_ids": True})
        completion = client.post(server.base_url + "/completions", json={"prompt": "Hello", "n": 2})
        with torch.no_grad():
            msg = chat.json()["choices"][0]["message"]
            prompt, gen = msg["prompt_token_ids"], msg["generation_token_ids"]
            logits = engine.model(torch.tensor([prompt + gen])).logits[0].float()
    finally:
        server.stop_thread()
        engine.shutdown()
    for response in (chat, completion):
        body = response.json()
        assert body["weight_version"] == 3 and response.headers["x-gym-bridge-weight-version"] == "3"
        assert [c["weight_version"] for c in body["choices"]] == [3] * len(body["choices"])
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1] / TEMPERATURE, -1).gather(-1, torch.tensor(gen)[:, None])
    assert torch.allclose(torch.tensor(msg["generation_log_probs"]), expected.squeeze(-1), atol=1e-4)


def _prefix_cache_counters(client: httpx.Client, server: OpenAIServer) -> dict[str, int]:
    """vLLM's prefix-cache counters as ``/metrics`` exposes them (Prometheus text, ``_total`` samples)."""
    r = client.get(server.root_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    found = {}
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert f"# TYPE {name}_total counter" in r.text
        match = re.search(rf'^{name}_total\{{engine="0",model_name="tiny"\}} (\d+)$', r.text, re.MULTILINE)
        assert match, r.text
        found[name] = int(match.group(1))
    return found


def test_metrics_count_prefix_cache_queries_and_hits(client, hf_server):
    """Chats that share a long system prompt: the second request's prompt is found in the cache, the counters rise."""
    system = {"role": "system", "content": "You answer arithmetic questions. " * 12}
    before = _prefix_cache_counters(client, hf_server)
    first = _chat(client, hf_server, messages=[system, *USER], max_tokens=4, n=2, return_token_ids=True)
    mid = _prefix_cache_counters(client, hf_server)
    question = [{"role": "user", "content": "And what is 3 + 4?"}]
    second = _chat(client, hf_server, messages=[system, *question], max_tokens=4, return_token_ids=True)
    after = _prefix_cache_counters(client, hf_server)
    shared = first["prompt_token_ids"][: len(second["prompt_token_ids"])]
    common = next(i for i, (a, b) in enumerate(zip(shared, second["prompt_token_ids"], strict=True)) if a != b)
    assert common >= 100  # the system prompt the two chats share
    queries = "vllm:prefix_cache_queries"
    hits = "vllm:prefix_cache_hits"
    assert mid[queries] - before[queries] == 2 * len(first["prompt_token_ids"])
    assert after[queries] - mid[queries] == len(second["prompt_token_ids"])
    # The second of the n=2 samples reuses the first's prompt; the later chat reuses the shared system prompt.
    assert mid[hits] - before[hits] >= len(first["prompt_token_ids"]) - 16
    assert after[hits] - mid[hits] >= common - 16
