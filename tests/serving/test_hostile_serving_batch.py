"""Issue 49 (items 5, 6) on the real HTTP server over the real tiny model: a hostile request beside innocent ones
that share its decode step. Each hostile one is served as vLLM serves it (200) or refused with a 400 naming the
field; every innocent one is a 200; nothing logs a traceback. A row that still fails inside the batch (a fault
planted after validation) costs only its own request a 500 and one log line.

Admission is held while the requests queue (as a weight refit holds it), so they all join one batch at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from gym_bridge.generation import hf_decode
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.hf_worker import WAKE
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing import wait_until

INNOCENTS = 4
USER = '[{"role": "user", "content": "What is 12 + 7?"}]'


@pytest.fixture(scope="module")
def engine(tiny_lm) -> Iterator[HFGeneration]:
    tok, model = tiny_lm
    gen = HFGeneration(HFGenerationConfig(max_new_tokens=16, temperature=1.0, seed=0), model=model, tokenizer=tok)
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def server(engine, tiny_lm) -> Iterator[OpenAIServer]:
    served = OpenAIServer(engine, tiny_lm[0], served_model_name="tiny")
    served.start_in_thread()
    yield served
    served.stop_thread()


@contextmanager
def one_batch(engine: HFGeneration, rows: int) -> Iterator[None]:
    """Hold the engine's admission until ``rows`` rows wait, then let them join one batch together."""
    engine._pause.set()
    try:
        yield
        wait_until(lambda: engine.request_counts().waiting >= rows, 60, f"{rows} rows waiting")
    finally:
        engine._pause.clear()
        engine._queue.put(WAKE)


def innocent(i: int) -> bytes:
    return f'{{"messages": {USER}, "max_tokens": 12, "seed": {i}}}'.encode()


def post_all(url: str, bodies: list[bytes]) -> list[httpx.Response]:
    """Every body on its own connection, all at once."""

    def post(body: bytes) -> httpx.Response:
        with httpx.Client(timeout=120) as client:
            return client.post(url, content=body, headers={"content-type": "application/json"})

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ERROR lines logged; fails if any record carries a traceback."""
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


HOSTILE = [
    pytest.param(f'{{"messages": {USER}, "temperature": 1e-300}}', 200, None, id="temperature-1e-300"),
    pytest.param(f'{{"messages": {USER}, "temperature": 5e-324, "seed": 3}}', 200, None, id="temperature-subnormal"),
    pytest.param(f'{{"messages": {USER}, "top_p": 1e-300}}', 200, None, id="top_p-1e-300"),
    pytest.param(f'{{"messages": {USER}, "top_k": 1099511627776}}', 200, None, id="top_k-beyond-vocab"),
    pytest.param(f'{{"messages": {USER}, "top_k": {2**70}}}', 400, "top_k", id="top_k-2**70"),
    pytest.param(f'{{"messages": {USER}, "top_k": true}}', 400, "top_k", id="top_k-true"),
    pytest.param(f'{{"messages": {USER}, "temperature": NaN}}', 400, "temperature", id="temperature-NaN"),
    pytest.param(f'{{"messages": {USER}, "top_p": 1e400}}', 400, "top_p", id="top_p-1e400"),
    pytest.param(f'{{"messages": {USER}, "seed": {2**64}}}', 400, "seed", id="seed-2**64"),
    pytest.param(
        '{"messages": [{"role": "user", "content": "hi\\ud800"}]}', 400, "messages[0].content", id="lone-surrogate"
    ),
    pytest.param(
        '{"messages": [{"role": "user", "content": "hi", "name": {"\\udfff": 1}}]}',
        400,
        "messages[0].name.\udfff",
        id="surrogate-key",
    ),
]


@pytest.mark.parametrize(("hostile", "status", "param"), HOSTILE)
def test_a_hostile_request_beside_innocent_ones(
    server: OpenAIServer,
    engine: HFGeneration,
    caplog: pytest.LogCaptureFixture,
    hostile: str,
    status: int,
    param: str | None,
) -> None:
    caplog.set_level(logging.INFO)
    bodies = [innocent(i) for i in range(INNOCENTS)] + [hostile.encode()]
    engine.clear_logger_metrics()
    reaching = INNOCENTS + (status == 200)
    result: list[httpx.Response] = []
    with one_batch(engine, reaching):
        sender = threading.Thread(target=lambda: result.extend(post_all(server.base_url + "/chat/completions", bodies)))
        sender.start()
    sender.join(120)
    *innocents, answer = result
    assert [r.status_code for r in innocents] == [200] * INNOCENTS, [r.text[:300] for r in innocents]
    assert all(r.json()["choices"][0]["message"]["content"] is not None for r in innocents)
    assert answer.status_code == status, answer.text[:500]
    if status == 200:
        assert engine.stats.max_rows_in_batch == reaching, "the hostile row decoded beside the innocent ones"
    else:
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["param"] == param
    assert no_tracebacks(caplog) == []


def test_a_row_that_fails_inside_the_batch_fails_only_its_request(
    server: OpenAIServer, engine: HFGeneration, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault planted past validation: choosing the token of any row with top_p 0.5 raises. Only that request
    fails (a 500, one log line); the four decoding beside it get their 200s."""
    real = hf_decode.pick_tokens

    def pick_tokens(logits, rows, generator):  # type: ignore[no-untyped-def]
        if any(r.sampling.top_p == 0.5 for r in rows):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, rows, generator)

    monkeypatch.setattr(hf_decode, "pick_tokens", pick_tokens)
    caplog.set_level(logging.INFO)
    poisoned = f'{{"messages": {USER}, "top_p": 0.5}}'.encode()
    engine.clear_logger_metrics()
    result: list[httpx.Response] = []
    with one_batch(engine, INNOCENTS + 1):
        bodies = [innocent(i) for i in range(INNOCENTS)] + [poisoned]
        sender = threading.Thread(target=lambda: result.extend(post_all(server.base_url + "/chat/completions", bodies)))
        sender.start()
    sender.join(120)
    *innocents, answer = result
    assert [r.status_code for r in innocents] == [200] * INNOCENTS, [r.text[:300] for r in innocents]
    assert engine.stats.max_rows_in_batch == INNOCENTS + 1
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "internal_server_error" and "RowFailure" in error["message"]
    assert "choosing its next token failed" in error["message"]
    errors = no_tracebacks(caplog)
    assert len(errors) == 1 and errors[0].startswith("POST /v1/chat/completions failed: RowFailure"), errors
    with httpx.Client(timeout=60) as client:  # the engine lives on
        assert client.post(server.base_url + "/chat/completions", content=innocent(9)).status_code == 200


def test_an_unexpected_error_is_one_log_line_and_an_openai_500(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gym_bridge.serving import app

    def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("a bug\nwith two lines")

    monkeypatch.setattr(app, "usage_of", broken)
    caplog.set_level(logging.INFO)
    with httpx.Client(timeout=60) as client:
        response = client.post(server.base_url + "/chat/completions", content=innocent(0))
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal error: KeyError: 'a bug\\nwith two lines'",
        "type": "internal_server_error",
        "param": None,
        "code": 500,
    }
    assert no_tracebacks(caplog) == ["POST /v1/chat/completions failed: KeyError: 'a bug\\nwith two lines'"]
