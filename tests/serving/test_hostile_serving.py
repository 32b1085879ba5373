"""Hostile request bodies against the real OpenAI-compatible server (issue 42): each is refused with an
OpenAI-shaped 4xx, or served, while ``/health`` keeps answering on another connection; nothing logs a
traceback or a key sent in a query string.

Every time bound here is a generous liveness bound (seconds, on two busy cores), never a speed claim: the
claims are orderings (``/health`` answered many times while the large request ran) and outcomes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.serving import OpenAIServer, ServerLimits
from gym_bridge.serving.bodies import json_depth, parse_body
from gym_bridge.serving.protocol import ChatCompletionRequest
from gym_bridge.serving.server import redact_query
from gym_bridge.testing import wait_until

USER = [{"role": "user", "content": "What is 12 + 7?"}]
LIVENESS_S = 10.0
"""How long one ``/health`` may take while a hostile request runs: a bound for liveness, not for speed."""
SECRET = "sk-hostile-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tiny_tokenizer) -> Iterator[OpenAIServer]:
    served = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, served_model_name="tiny")
    served.start_in_thread()
    yield served
    served.stop_thread()


@pytest.fixture(scope="module")
def keyed_server(tiny_tokenizer) -> Iterator[OpenAIServer]:
    served = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, api_key=SECRET)
    served.start_in_thread()
    yield served
    served.stop_thread()


@dataclass
class Overlap:
    """A request sent on its own connection, and the ``/health`` answers another connection got meanwhile."""

    response: httpx.Response
    finished: float
    health_answers: list[float] = field(default_factory=list)

    def answered_before_it_finished(self) -> int:
        return sum(t < self.finished for t in self.health_answers)


def while_health_polls(send: Callable[[httpx.Client], httpx.Response], root_url: str) -> Overlap:
    """Run ``send`` on a thread and poll ``/health`` every 20 ms on another connection until it is done."""
    outcome: dict[str, object] = {}

    def run() -> None:
        with httpx.Client(timeout=300) as client:
            outcome["response"] = send(client)
        outcome["finished"] = time.monotonic()

    worker = threading.Thread(target=run, name="hostile-request")
    worker.start()
    answers: list[float] = []
    with httpx.Client(timeout=LIVENESS_S) as health:
        while worker.is_alive():
            assert health.get(root_url + "/health").status_code == 200
            answers.append(time.monotonic())
            time.sleep(0.02)
    worker.join()
    response, finished = outcome["response"], outcome["finished"]
    assert isinstance(response, httpx.Response) and isinstance(finished, float)
    return Overlap(response, finished, answers)


def refusal(response: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error object of a refusal with ``status``."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == status
    return error


def post_json(client: httpx.Client, url: str, body: bytes) -> httpx.Response:
    return client.post(url, content=body, headers={"content-type": "application/json"})


# ---- stop strings ----------------------------------------------------------------------------


def test_100000_stop_strings_are_a_400_naming_stop_while_health_answers(server: OpenAIServer) -> None:
    body = json.dumps({"messages": USER, "stop": [f"stop{i}" for i in range(100_000)]}).encode()
    assert len(body) > 1_000_000
    url = server.base_url + "/chat/completions"
    run = while_health_polls(lambda client: post_json(client, url, body), server.root_url)
    error = refusal(run.response)
    limit = ServerLimits().max_stop_strings
    assert error["param"] == "stop" and f"at most {limit}" in error["message"] and "100000" in error["message"]
    with httpx.Client(timeout=LIVENESS_S) as client:
        assert client.get(server.root_url + "/health").status_code == 200


def test_stop_strings_within_the_cap_are_served_once_each(server: OpenAIServer) -> None:
    with httpx.Client(timeout=60) as client:
        same = client.post(server.base_url + "/chat/completions", json={"messages": USER, "stop": ["zz"] * 4})
        assert same.status_code == 200, same.text
        over = client.post(server.base_url + "/completions", json={"prompt": "hi", "stop": list("abcde")})
    assert refusal(over)["param"] == "stop"
    request = ChatCompletionRequest.model_validate({"messages": USER, "stop": ["b", "a", "", "b", "a", "c"]})
    assert request.stop_strings() == ["b", "a", "c"], "each once, in the order sent"


def test_deduplicating_stop_strings_is_linear() -> None:
    """700,000 distinct stop strings (what fits in 8 MB) de-duplicate in well under a second's work per 100,000."""
    request = ChatCompletionRequest.model_construct(stop=[f"s{i}" for i in range(700_000)])
    started = time.process_time()
    assert len(request.stop_strings()) == 700_000
    assert time.process_time() - started < LIVENESS_S, "a quadratic de-duplication takes hours here"


# ---- work that grows with the body runs off the event loop --------------------------------------


def test_a_7mb_tokenize_does_not_hold_health(server: OpenAIServer) -> None:
    body = json.dumps({"prompt": "hello world, " * 540_000}).encode()
    assert 7_000_000 < len(body) < ServerLimits().max_body_bytes
    url = server.root_url + "/tokenize"
    run = while_health_polls(lambda client: post_json(client, url, body), server.root_url)
    assert run.response.status_code == 200, run.response.text[:500]
    assert run.response.json()["count"] > 1_000_000
    assert run.answered_before_it_finished() >= 10, "health answered again and again while the tokenize ran"
    gaps = [b - a for a, b in zip(run.health_answers, run.health_answers[1:], strict=False)]
    assert max(gaps, default=0.0) < LIVENESS_S


def test_a_large_chat_render_does_not_hold_health(server: OpenAIServer) -> None:
    messages = [{"role": "user", "content": "hello world, " * 100_000} for _ in range(5)]
    body = json.dumps({"messages": messages, "add_generation_prompt": True}).encode()
    url = server.root_url + "/tokenize"
    run = while_health_polls(lambda client: post_json(client, url, body), server.root_url)
    assert run.response.status_code == 200, run.response.text[:500]
    assert run.answered_before_it_finished() >= 3


# ---- JSON nested too deep --------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [65, 5_000, 100_000])
def test_json_nested_too_deep_is_a_400_without_a_traceback(
    server: OpenAIServer, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = f'{{"messages": {json.dumps(USER)}, "metadata": {nested(depth)}}}'.encode()
    with httpx.Client(timeout=60) as client:
        error = refusal(post_json(client, server.base_url + "/chat/completions", body))
        assert client.get(server.root_url + "/health").status_code == 200
    assert "deeper than 64 levels" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], "no traceback is logged"


def test_json_within_the_depth_limit_is_served(server: OpenAIServer) -> None:
    body = f'{{"messages": {json.dumps(USER)}, "metadata": {nested(60)}}}'.encode()
    with httpx.Client(timeout=60) as client:
        response = post_json(client, server.base_url + "/chat/completions", body)
    assert response.status_code == 200, response.text


def test_depth_is_measured_without_recursion() -> None:
    deep: list[object] = []
    for _ in range(200_000):
        deep = [deep]
    assert json_depth(deep, 64) == 65, "the walk stops just past the limit"
    assert json_depth({"a": [1, {"b": []}], "c": 2}, 64) == 4 and json_depth(7, 64) == 0
    with pytest.raises(Exception, match="deeper than 2 levels"):
        parse_body(b'{"a": {"b": {}}}', ChatCompletionRequest, ServerLimits(max_json_depth=2))


# ---- keys in query strings -------------------------------------------------------------------


def test_a_key_in_the_query_string_is_never_logged(
    keyed_server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with httpx.Client(timeout=60) as client:
        for path in (f"/v1/models?api_key={SECRET}", f"/v1/models?{SECRET}", f"/nowhere?key={SECRET}&x=1"):
            assert client.get(keyed_server.root_url + path).status_code in (401, 404)
    # the access log is written after the response: wait (bounded) until its three lines are there
    wait_until(lambda: len([r for r in caplog.records if r.name == "uvicorn.access"]) >= 3, 30, "three access lines")
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert len(access) == 3 and all("?<redacted>" in line for line in access), access
    server_side = [r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert server_side and not [line for line in server_side if SECRET in line], "the client logs its own URLs"
    assert redact_query("/v1/models") == "/v1/models" and redact_query("/a?b=c&d") == "/a?<redacted>"
