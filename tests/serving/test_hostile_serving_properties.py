"""Issue 49 (items 5, 6) as properties: Hypothesis writes hostile inputs for both sides of the wire.

- Request bodies for every route of the real server over the real tiny model: sampling fields of any type and
  magnitude, strings with lone surrogates and control characters, deep nesting. Each answer is a 200 or a 4xx
  with the OpenAI error shape, never a 5xx.
- Endpoint answers for preflight (through its ``transport`` seam, ``httpx.MockTransport``): fields of any type,
  huge integers, NaN, bodies that are not JSON. Each check ends in a result (a failed one is one line naming the
  endpoint), never another exception.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.preflight import PreflightError, check_endpoint_async
from gym_bridge.serving import OpenAIServer

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "40"))
"""Examples per property: modest by default; set ``HYPOTHESIS_EXAMPLES`` to search harder."""
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- values ------------------------------------------------------------------------------------------------

#: Every character, lone surrogates and control characters included.
ANY_TEXT = st.text(
    st.characters()
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
    | st.characters(max_codepoint=0x1F, exclude_categories=()),
    max_size=12,
)
NASTY_TEXT = st.one_of(
    ANY_TEXT,
    st.sampled_from(["\ud800", "hi\udfff", "\x00", "\x1b[31m", "\u202e", "<tool_call>", "</think>", "\r\n"]),
)
HUGE_INTS = st.one_of(
    st.integers(-(2**80), 2**80),
    st.sampled_from([2**63, 2**63 - 1, -(2**63) - 1, 2**64, 2**70, 10**300, -1, 0, 1]),
)
ANY_FLOATS = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    [1e-300, 5e-324, -0.0, 1e-5, 1e308]
)
SCALARS = st.one_of(st.none(), st.booleans(), HUGE_INTS, ANY_FLOATS, NASTY_TEXT)
#: Each sampling field with values it may well hold, at the edges of its range: most such bodies are served.
PLAUSIBLE = {
    "temperature": st.floats(0, 3) | st.sampled_from([0.0, 1e-300, 5e-324, 1e-5, 100.0]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([1e-300, 5e-324, 1.0]),
    "top_k": st.integers(-1, 2**63 - 1) | st.sampled_from([-1, 0, 1, 255, 256, 257, 2**40]),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 4),
    "max_tokens": st.integers(1, 4),
    "stop": st.lists(NASTY_TEXT, max_size=4) | NASTY_TEXT,
}
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NASTY_TEXT, inner, max_size=4), max_leaves=12
)


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "n", "max_tokens", "max_completion_tokens", "stop")


@st.composite
def messages(draw: st.DrawFn) -> Any:
    role = draw(st.sampled_from(["user", "system", "assistant", "tool"]) | NASTY_TEXT)
    message: dict[str, Any] = {"role": role, "content": draw(NASTY_TEXT | JSON)}
    if draw(st.booleans()):
        message[draw(st.sampled_from(["tool_calls", "name", "prompt_token_ids", "generation_token_ids"]))] = draw(JSON)
    return [message] if draw(st.booleans()) else draw(st.lists(st.just(message) | JSON, max_size=3))


@st.composite
def request_body(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a body for it: mostly shaped like a real request, any field swapped for something hostile."""
    route = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]))
    body: dict[str, Any] = {}
    chat = route == "/v1/chat/completions" or (route == "/tokenize" and draw(st.booleans()))
    if chat:
        body["messages"] = draw(messages())
    elif route != "/detokenize":
        body["prompt"] = draw(NASTY_TEXT | st.lists(HUGE_INTS, max_size=4) | JSON)
    if route == "/detokenize":
        body["tokens"] = draw(st.lists(HUGE_INTS, max_size=4) | JSON)
    for field in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=4, unique=True)):
        body[field] = draw(SCALARS | JSON)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 4))  # keep generations short when a body is served
    if draw(st.booleans()):
        body[draw(NASTY_TEXT)] = draw(JSON | st.integers(0, 120).map(nested))
    return route, body


def encoded(body: Any) -> bytes:
    """``body`` as the bytes a client sends: NaN and Infinity as Python writes them, surrogates as escapes."""
    return json.dumps(body).encode()


# ---- the server --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_lm) -> Iterator[OpenAIServer]:
    tok, model = tiny_lm
    engine = HFGeneration(HFGenerationConfig(max_new_tokens=4, temperature=1.0, seed=0), model=model, tokenizer=tok)
    served = OpenAIServer(engine, tok, served_model_name="tiny")
    served.start_in_thread()
    yield served
    served.stop_thread()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.root_url, timeout=120) as shared:
        yield shared


def assert_answered(response: httpx.Response) -> None:
    """A 200, or a 4xx with the OpenAI error body; never a 5xx (each status is a Hypothesis event: the statistics
    show how many bodies were served)."""
    hypothesis.event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text[:1000]
    if response.status_code != 200:
        assert 400 <= response.status_code < 500
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == response.status_code


@PROPERTY
@given(request_body())
def test_no_request_body_is_a_5xx(client: httpx.Client, case: tuple[str, Any]) -> None:
    route, body = case
    assert_answered(client.post(route, content=encoded(body), headers={"content-type": "application/json"}))


@PROPERTY
@given(st.fixed_dictionaries({}, optional={field: values | st.none() for field, values in PLAUSIBLE.items()}))
def test_sampling_at_the_edges_of_its_range_is_never_a_5xx(client: httpx.Client, fields: dict[str, Any]) -> None:
    """Every sampling field within its documented range, at its edges (a temperature of 1e-300, a top_k far beyond
    the vocabulary): served, or refused (a stop string that is not UTF-8 text), and every logprob finite."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, **fields}
    response = client.post("/v1/chat/completions", content=encoded(body), headers={"content-type": "application/json"})
    assert_answered(response)
    for choice in response.json().get("choices", []):
        assert all(math.isfinite(lp["logprob"]) for lp in choice["logprobs"]["content"])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64) | st.text(max_size=32).map(str.encode) | st.just(b'{"a": ' + b"1" * 5000 + b"}"))
def test_no_raw_body_is_a_5xx(client: httpx.Client, raw: bytes) -> None:
    assert_answered(client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}))


# ---- endpoint answers for preflight ----------------------------------------------------------------------------

GOOD = {
    "/v1/models": {"object": "list", "data": [{"id": "tiny", "object": "model"}]},
    "/v1/chat/completions": {
        "choices": [
            {
                "message": {"role": "assistant", "content": "OK"},
                "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.25}]},
                "token_ids": [5],
            }
        ]
    },
    "/tokenize": {"tokens": [1, 2, 3], "count": 3},
}


def swapped(value: Any, draw: st.DrawFn) -> Any:
    """``value`` with one leaf or branch (chosen by ``draw``) replaced by hostile JSON."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: swapped(value[key], draw)}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], swapped(value[i], draw), *value[i + 1 :]]
    return draw(JSON)


@st.composite
def endpoint_answers(draw: st.DrawFn) -> dict[str, tuple[int, bytes]]:
    """For each path: a status and the body bytes; a good answer with one part swapped, or raw bytes."""
    answers = {}
    for path, good in GOOD.items():
        kind = draw(st.sampled_from(["good", "swapped", "swapped", "raw"]))
        if kind == "raw":
            body = draw(st.binary(max_size=40) | st.just(b'{"data": [{"id": ' + b"9" * 5000 + b"}]}"))
        else:
            body = encoded(good if kind == "good" else swapped(good, draw))
        answers[path] = (draw(st.sampled_from([200, 200, 200, 400, 401, 500])), body)
    return answers


@PROPERTY
@given(endpoint_answers())
def test_no_endpoint_answer_escapes_preflight(answers: dict[str, tuple[int, bytes]]) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        status, body = answers[request.url.path]
        return httpx.Response(status, content=body, headers={"content-type": "application/json"})

    url = "http://endpoint.test/v1"
    check = asyncio.run(check_endpoint_async(url, "tiny", timeout_s=10, transport=httpx.MockTransport(answer)))
    if check.ok:
        return
    lines = str(PreflightError([check])).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"endpoint {url}"), lines
    assert all(ch.isprintable() for ch in lines[0]) and len(lines[0]) < 600, lines[0]
