"""OpenAIHTTPGeneration: output contract over HTTP, routing, failover, typed failures, secrets."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from test_hf_generation import MAX_NEW, engine, stop_string_case

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import (
    EngineShutDownError,
    FailureClass,
    GenerationUnavailable,
    NoHealthyShards,
    RolloutDataFailure,
    classify_rollout_failure,
)
from gym_bridge.generation.completions_wire import completion_request
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.openai_http import (
    BlockingCallInEventLoop,
    OpenAIHTTPGeneration,
    OpenAIHTTPGenerationConfig,
)
from gym_bridge.generation.routing import SessionRouter
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing.generation import (
    MIXED_PROMPTS,
    assert_output_contract,
    generated,
    prompt_batch,
    reference_logprobs,
    unpadded,
)

SECRET = "sk-test-very-secret-0123456789"


# ---------------------------------------------------------------------- servers


class ServerThread:
    """A real ``OpenAIServer`` on its own thread and event loop, so blocking clients can call it."""

    def __init__(self, generation: Any, tokenizer: Any) -> None:
        self.server = OpenAIServer(generation, tokenizer, served_model_name="tiny", host="127.0.0.1", port=0)
        self.base_url: str = self.server.start_in_thread()

    def stop(self) -> None:
        self.server.stop_thread()  # idempotent


@pytest.fixture
def make_servers(tiny_lm) -> Iterator[Any]:
    started: list[tuple[ServerThread, HFGeneration]] = []

    def make(n: int, **cfg: Any) -> list[ServerThread]:
        out = []
        for _ in range(n):
            gen = engine(tiny_lm, **cfg)
            srv = ServerThread(gen, tiny_lm[0])
            started.append((srv, gen))
            out.append(srv)
        return out

    yield make
    for srv, gen in started:
        srv.stop()
        gen.shutdown()


@pytest.fixture(scope="module")
def pair(tiny_lm) -> Iterator[list[ServerThread]]:
    """Two real servers over the tiny model, temperature 1 profile, kept for the module."""
    gens = [engine(tiny_lm) for _ in range(2)]
    servers = [ServerThread(g, tiny_lm[0]) for g in gens]
    yield servers
    for s, g in zip(servers, gens):
        s.stop()
        g.shutdown()


def client(urls: list[str], tok: Any, **cfg: Any) -> OpenAIHTTPGeneration:
    cfg.setdefault("max_new_tokens", MAX_NEW)
    cfg.setdefault("request_timeout_s", 60.0)
    cfg.setdefault("backoff_base_s", 0.01)
    return OpenAIHTTPGeneration(
        OpenAIHTTPGenerationConfig(base_urls=urls, model="tiny", pad_token_id=tok.pad_token_id, **cfg)
    )


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# ---------------------------------------------------------------------- contract over HTTP


def test_output_contract_and_greedy_matches_local(pair, tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = client([s.base_url for s in pair], tok)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)
        out = gen.generate(data, greedy=True)
        keys = {"output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated"}
        assert_output_contract(out, data, tok, keys={*keys, "gen_leader_worker_idx"}, max_new_tokens=MAX_NEW)
        assert sorted(set(out["gen_leader_worker_idx"])) == [0, 1]  # 4 sessionless rows spread over 2

        # Greedy over HTTP equals the local backend, and is deterministic.
        local = engine(tiny_lm).generate(data, greedy=True)
        assert torch.equal(out["output_ids"], local["output_ids"])
        torch.testing.assert_close(out["logprobs"], local["logprobs"], atol=1e-4, rtol=0)
        again = gen.generate(data, greedy=True)
        assert torch.equal(again["output_ids"], out["output_ids"])
    finally:
        assert gen.shutdown() and gen.shutdown()


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_match_full_forward(pair, tiny_lm, greedy: bool) -> None:
    tok, model = tiny_lm
    gen = client([pair[0].base_url], tok)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)
        out = gen.generate(data, greedy=greedy)
        for i in range(len(MIXED_PROMPTS)):
            seq, lps = unpadded(out, i)
            n_in = int(data["input_lengths"][i])
            ref, pred = reference_logprobs(model, seq, n_in, 1.0)
            torch.testing.assert_close(lps[n_in:], ref, atol=1e-4, rtol=0)
            if greedy:
                assert torch.equal(pred.argmax(-1), seq[n_in:])
    finally:
        gen.shutdown()


def test_stop_strings_and_truncation(pair, tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = client([pair[0].base_url], tok)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)
        base = gen.generate(data, greedy=True)
        row, stop, tokens, n_expected = stop_string_case(tok, base, data)
        stops = [None] * len(MIXED_PROMPTS)
        stops[row] = [stop]
        out = gen.generate(prompt_batch(tok, MIXED_PROMPTS, stop_strings=stops), greedy=True)
        assert generated(out, data, row) == tokens[:n_expected]
        assert not bool(out["truncated"][row])
        for i in range(len(MIXED_PROMPTS)):
            if i != row:
                assert generated(out, data, i) == generated(base, data, i) and bool(out["truncated"][i])
        # Config stop strings merge with row ones.
        cfg_gen = client([pair[0].base_url], tok, stop_strings=[stop])
        try:
            out2 = cfg_gen.generate(prompt_batch(tok, MIXED_PROMPTS, stop_strings=[["zzzz-never"]] * 4), greedy=True)
            assert generated(out2, data, row) == tokens[:n_expected] and not bool(out2["truncated"][row])
        finally:
            cfg_gen.shutdown()
        # A smaller max_tokens truncates at that length.
        short = client([pair[0].base_url], tok, max_new_tokens=3)
        try:
            out3 = short.generate(data, greedy=True)
            assert out3["generation_lengths"].tolist() == [3] * 4 and out3["truncated"].all()
            assert generated(out3, data, 1) == generated(base, data, 1)[:3]
        finally:
            short.shutdown()
    finally:
        gen.shutdown()


async def test_generate_async_yields_every_row(pair, tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = client([s.base_url for s in pair], tok)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)
        ref = engine(tiny_lm).generate(data, greedy=True)
        seen = []
        async for i, out in gen.generate_async(data, greedy=True):
            seen.append(i)
            assert out["output_ids"].shape == (1, data["input_ids"].shape[1] + int(out["generation_lengths"][0]))
            assert torch.equal(unpadded(out, 0)[0], unpadded(ref, i)[0])
            assert out["gen_leader_worker_idx"] in ([0], [1])
        assert sorted(seen) == [0, 1, 2, 3]
        with pytest.raises(BlockingCallInEventLoop, match="generate_async"):
            gen.generate(data, greedy=True)  # blocking call from inside a running loop
    finally:
        await gen.aclose()


# ---------------------------------------------------------------------- routing and failover


def test_sessions_stick_and_both_servers_serve(pair, tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = client([s.base_url for s in pair], tok, max_new_tokens=2)
    try:
        data = prompt_batch(tok, ["a b", "c d"], session_ids=["s-a", "s-b"])
        first = gen.generate(data, greedy=True)["gen_leader_worker_idx"]
        assert sorted(first) == [0, 1]  # two new sessions on an idle fleet land on different servers
        for _ in range(3):
            assert gen.generate(data, greedy=True)["gen_leader_worker_idx"] == first
        assert all(v > 0 for v in gen.stats.requests_per_url.values())
        assert gen.stats.retries == 0 and gen.stats.failovers == 0
    finally:
        gen.shutdown()


def test_server_stopped_mid_run_fails_over(make_servers, tiny_lm) -> None:
    tok, _ = tiny_lm
    a, b = make_servers(2)
    gen = client([a.base_url, b.base_url], tok, max_new_tokens=2, max_retries=3, unhealthy_cooldown_s=60)
    try:
        sessions = [f"s{i}" for i in range(4)]
        data = prompt_batch(tok, ["one", "two", "three", "four"], session_ids=sessions)
        before = gen.generate(data, greedy=True)
        assert sorted(set(before["gen_leader_worker_idx"])) == [0, 1]
        a.stop()
        after = gen.generate(data, greedy=True)
        assert after["gen_leader_worker_idx"] == [1, 1, 1, 1]
        assert torch.equal(after["output_ids"], before["output_ids"])  # greedy: same answer elsewhere
        moved = before["gen_leader_worker_idx"].count(0)
        assert gen.stats.failovers >= moved >= 1
        assert gen.stats.retries >= 1
        assert not gen.router.is_healthy(0)
        assert all(gen.router.session_url(s) == 1 for s in sessions)
    finally:
        gen.shutdown()


def test_dead_fleet_raises_no_healthy_shards(tiny_lm) -> None:
    tok, _ = tiny_lm
    urls = [dead_url(), dead_url()]
    gen = client(urls, tok, max_retries=3, backoff_base_s=0.05, max_backoff_s=0.1, connect_timeout_s=2)
    try:
        with pytest.raises(NoHealthyShards) as info:
            gen.generate(prompt_batch(tok, ["Hello"]), greedy=True)
        assert classify_rollout_failure(info.value) is FailureClass.INFRA
        assert "all 2 endpoint(s)" in str(info.value) and "4 attempts" in str(info.value)
        assert "127.0.0.1" in str(info.value)
        assert gen.stats.retries == 3 and sum(gen.stats.requests_per_url.values()) == 4
    finally:
        gen.shutdown()


def test_4xx_from_real_server_is_data_failure_without_retry(pair, tiny_lm) -> None:
    tok, _ = tiny_lm
    # A token id outside the vocabulary is a request error the server answers with a 400.
    gen = client([pair[0].base_url], tok)
    bad = BatchedDataDict({"input_ids": torch.tensor([[len(tok) + 5]]), "input_lengths": torch.tensor([1])})
    try:
        with pytest.raises(RolloutDataFailure, match="HTTP 4"):
            gen.generate(bad, greedy=False)
        assert gen.stats.retries == 0 and sum(gen.stats.requests_per_url.values()) == 1
    finally:
        gen.shutdown()


# ---------------------------------------------------------------------- failures without servers


def _completion(token_ids: list[int], *, finish: str = "length", with_ids: bool = True) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": "",
        "finish_reason": finish,
        "logprobs": {"tokens": [f"token_id:{t}" for t in token_ids], "token_logprobs": [-0.5] * len(token_ids)},
    }
    if with_ids:
        choice["token_ids"] = token_ids
    return {"id": "x", "object": "text_completion", "choices": [choice]}


def mock_client(handler, **cfg: Any) -> OpenAIHTTPGeneration:
    cfg.setdefault("base_urls", ["http://mock-a/v1", "http://mock-b/v1"])
    cfg.setdefault("backoff_base_s", 0.001)
    cfg.setdefault("max_new_tokens", 3)
    return OpenAIHTTPGeneration(
        OpenAIHTTPGenerationConfig(model="m", pad_token_id=0, **cfg), transport=httpx.MockTransport(handler)
    )


def ids_batch(rows: list[list[int]], **extra: Any) -> BatchedDataDict:
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows]), **extra})


def test_request_body_and_parsing_fallback_to_token_strings() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=_completion([7, 8], finish="stop", with_ids=False))

    gen = mock_client(handler, base_urls=["http://mock/v1"], top_k=5, stop_strings=["</a>"], stop_token_ids=[2])
    out = gen.generate(ids_batch([[1, 2, 3]], stop_strings=[["END", "</a>"]]), greedy=True)
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["temperature"] == 0.0
    assert body["top_k"] == 5 and body["stop"] == ["</a>", "END"] and body["stop_token_ids"] == [2]
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 1
    assert out["output_ids"].tolist() == [[1, 2, 3, 7, 8]] and out["truncated"].tolist() == [False]
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.5]]
    assert "top_k" not in completion_request(mock_client(handler).cfg, [1], None, 0, False)
    gen.shutdown()


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_infra_status_is_retried(status: int) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        if len(calls) < 3:
            return httpx.Response(status, text="busy")
        return httpx.Response(200, json=_completion([4, 5, 6]))

    gen = mock_client(handler, max_retries=3)
    out = gen.generate(ids_batch([[1]]), greedy=True)
    assert out["output_ids"].tolist() == [[1, 4, 5, 6]] and out["truncated"].tolist() == [True]
    assert len(calls) == 3 and gen.stats.retries == 2
    gen.shutdown()


def test_infra_status_exhausted_names_url_and_status() -> None:
    gen = mock_client(lambda r: httpx.Response(503, text="overloaded " * 100), max_retries=2)
    with pytest.raises(GenerationUnavailable, match=r"mock-.*HTTP 503: overloaded") as info:
        gen.generate(ids_batch([[1]]))
    assert len(str(info.value)) < 400
    assert gen.stats.retries == 2 and gen.stats.infra_errors == 1
    gen.shutdown()


def test_4xx_is_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    gen = mock_client(handler, max_retries=5)
    with pytest.raises(RolloutDataFailure, match="HTTP 400.*prompt too long"):
        gen.generate(ids_batch([[1]]))
    assert len(calls) == 1 and gen.stats.retries == 0
    gen.shutdown()


@pytest.mark.parametrize(
    ("payload", "missing"),
    [
        ({"choices": []}, "choices"),
        ({"choices": [{"finish_reason": "stop", "logprobs": None}]}, "token_ids"),
        ({"choices": [{"finish_reason": "stop", "token_ids": [1], "logprobs": None}]}, "token_logprobs"),
        ({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}]}, "finish_reason"),
        (
            {"choices": [{"finish_reason": "stop", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]},
            "1 token_logprobs for 2",
        ),
    ],
)
def test_malformed_response_is_data_failure(payload: dict[str, Any], missing: str) -> None:
    gen = mock_client(lambda r: httpx.Response(200, json=payload), max_retries=3)
    with pytest.raises(RolloutDataFailure, match=missing):
        gen.generate(ids_batch([[1]]))
    assert gen.stats.retries == 0
    gen.shutdown()


def test_timeout_is_retried_and_bounded() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, json=_completion([1]))

    gen = mock_client(slow, request_timeout_s=0.1, max_retries=2)
    start = time.monotonic()
    with pytest.raises(GenerationUnavailable, match="no response within 0.1s"):
        gen.generate(ids_batch([[1]]))
    assert time.monotonic() - start < 3 and gen.stats.retries == 2
    gen.shutdown()


def test_api_key_is_sent_but_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    auth = []

    def handler(request: httpx.Request) -> httpx.Response:
        auth.append(request.headers.get("authorization"))
        return httpx.Response(503, text="nope")

    caplog.set_level(logging.DEBUG)
    gen = mock_client(handler, api_key=SECRET, max_retries=1)
    assert SECRET not in repr(gen.cfg) and SECRET not in str(gen.cfg) and SECRET not in repr(gen.cfg.model_dump())
    with pytest.raises(GenerationUnavailable) as info:
        gen.generate(ids_batch([[1]]))
    assert auth == [f"Bearer {SECRET}"] * 2
    assert SECRET not in str(info.value)
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)
    assert SECRET not in caplog.text
    gen.shutdown()


def test_max_new_tokens_zero_sends_nothing() -> None:
    gen = mock_client(lambda r: pytest.fail("no request expected"), max_new_tokens=0)
    out = gen.generate(ids_batch([[1, 2]]))
    assert out["generation_lengths"].tolist() == [0] and out["truncated"].tolist() == [True]
    assert out["output_ids"].tolist() == [[1, 2]]
    gen.shutdown()


async def test_generate_async_first_failure_cancels_siblings() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == [9]:
            return httpx.Response(404, text="no such model")
        await asyncio.sleep(10)
        return httpx.Response(200, json=_completion([1]))

    gen = mock_client(handler)
    start = time.monotonic()
    with pytest.raises(RolloutDataFailure, match="404"):
        async for _ in gen.generate_async(ids_batch([[1], [9], [2]])):
            pass
    assert time.monotonic() - start < 5
    await gen.aclose()
    with pytest.raises(EngineShutDownError, match="shut down"):
        async for _ in gen.generate_async(ids_batch([[1]])):
            pass


# ---------------------------------------------------------------------- router


def test_router_sticky_least_loaded() -> None:
    r = SessionRouter(3)
    assert [r.acquire() for _ in range(3)] == [0, 1, 2]  # ties go round robin
    r.release(1)
    assert r.acquire("s") == 1  # the least-loaded URL takes the new session
    assert r.acquire("s") == 1 and r.acquire("s") == 1  # and keeps it, whatever its load
    assert r.in_flight() == [1, 3, 1]
    assert r.acquire() in (0, 2)


def test_router_failover_and_lru_bound() -> None:
    now = [0.0]
    r = SessionRouter(2, max_sessions=2, cooldown_s=5.0, clock=lambda: now[0])
    assert r.acquire("a") == 0 and r.acquire("b") == 1
    r.mark_unhealthy(0)
    assert r.acquire("a") == 1 and r.stats.failovers == 1
    assert r.acquire() == 1  # only healthy URL
    now[0] = 6.0
    assert r.is_healthy(0) and r.acquire("a") == 1  # the session stays where it moved
    r.acquire("c")
    assert len(r) == 2 and r.session_url("b") is None  # least recently used session evicted
    r.mark_unhealthy(0)
    r.mark_unhealthy(1)
    assert r.acquire() in (0, 1)  # nothing healthy: still a choice, so the error surfaces


async def test_blocking_generate_from_worker_thread_and_shutdown_inside_loop() -> None:
    gen = mock_client(lambda r: httpx.Response(200, json=_completion([5])), max_new_tokens=1)
    out = await asyncio.to_thread(gen.generate, ids_batch([[1], [2]]))  # a thread with no event loop
    assert out["output_ids"].tolist() == [[1, 5], [2, 5]]
    assert [i async for i, _ in gen.generate_async(ids_batch([[3]]))] == [0]  # clients on this loop too
    assert gen.shutdown() and gen.shutdown()  # sync shutdown from inside the loop: no hang, idempotent
    await asyncio.sleep(0)
    with pytest.raises(EngineShutDownError, match="shut down"):
        await asyncio.to_thread(gen.generate, ids_batch([[1]]))
