"""``gym-bridge check-endpoint`` (the run's preflight) against endpoints that answer garbage: a tiny local HTTP
server answers without end, with JSON nested 100,000 deep, with terminal escapes and newlines in its error, or
with 100,000 models. Each ends in one line on stderr and exit 2, bounded in what it reads.

Issue 49 (item 6): every field of an answer is type-checked, through preflight's ``transport`` seam
(``httpx.MockTransport``): negative or boolean token ids, NaN logprobs, ``logprobs.content: 5``, a 5,000-digit
integer. Each is a failed check, one line naming the endpoint and the field, never a traceback
(tests/serving/test_hostile_serving_properties.py writes such answers with Hypothesis)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gym_bridge.preflight import EndpointProblem, PreflightError, check_endpoint_async
from gym_bridge.testing.cli import run_cli

ENDLESS_CHUNK = b"[" * 65536


class _Garbage(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # a body that ends when the connection closes: it can go on without end

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        """The one-token chat of plan ``content5``: its logprobs' ``content`` is a number."""
        self.rfile.read(int(self.headers.get("content-length", 0)))
        choice = {"message": {"content": "OK"}, "logprobs": {"content": 5}, "token_ids": [5]}
        self._start(200)
        self.wfile.write(json.dumps({"choices": [choice]}).encode())

    def do_GET(self) -> None:
        plan = self.path.split("/")[1]
        if plan == "endless":
            self._start(200)
            try:
                for _ in range(1024):  # 64 MiB at most; the reader must stop long before
                    self.wfile.write(ENDLESS_CHUNK)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        if plan == "deep":
            body = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            status = 200
        elif plan == "escapes":
            message = "\x1b[31mred\x1b[0m\nTraceback (most recent call last):\r\n  second line\x07"
            body, status = json.dumps({"error": {"message": message}}).encode(), 500
        elif plan == "content5":
            body, status = json.dumps({"data": [{"id": "x"}]}).encode(), 200
        else:
            body = json.dumps({"data": [{"id": f"model-{i}"} for i in range(100_000)]}).encode()
            status = 200
        self._start(status)
        self.wfile.write(body)

    def _start(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()


@pytest.fixture(scope="module")
def garbage() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ("endless", "GET /v1/models answered more than 4 MiB (HTTP 200)"),
        ("deep", "GET /v1/models answered HTTP 200 with JSON nested too deeply"),
        ("escapes", r"GET /v1/models answered HTTP 500: \x1b[31mred\x1b[0m Traceback (most recent call last): second"),
        ("many", "does not serve model 'x'; it serves 'model-0', 'model-1',"),
        ("content5", "the one-token chat completion answered choices[0].logprobs.content = 5, not a list of token"),
    ],
)
def test_an_endpoint_that_answers_garbage_is_one_line(garbage, plan, expected):
    done = run_cli("check-endpoint", f"{garbage}/{plan}/v1", "--model", "x", "--timeout", "30", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert len(lines[0]) < 500
    if plan == "many":
        assert lines[0].endswith("and 99990 more (set model_name to the served name)")


# ---- every field of an answer type-checked ----------------------------------------------------------------------

URL = "http://endpoint.test/v1"
MODELS = {"object": "list", "data": [{"id": "tiny"}]}
TOKENIZE = {"tokens": [1, 2, 3], "count": 3}


def chat(
    token_ids: object = (5,), logprob: object = -0.25, token: object = "token_id:5", content: object = None
) -> dict:
    entries = content if content is not None else [{"token": token, "logprob": logprob}]
    ids = list(token_ids) if isinstance(token_ids, tuple) else token_ids
    return {"choices": [{"message": {"content": "OK"}, "logprobs": {"content": entries}, "token_ids": ids}]}


def checked(models: object = MODELS, answer: object = None, tokenize: object = TOKENIZE) -> str:
    """The preflight line of an endpoint that answers these bodies ('' when it passes)."""
    bodies = {"/v1/models": models, "/v1/chat/completions": answer or chat(), "/tokenize": tokenize}

    def respond(request: httpx.Request) -> httpx.Response:
        body = bodies[request.url.path]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(200, content=raw, headers={"content-type": "application/json"})

    check = asyncio.run(check_endpoint_async(URL, "tiny", timeout_s=10, transport=httpx.MockTransport(respond)))
    if check.ok:
        return ""
    lines = str(PreflightError([check])).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"endpoint {URL}: "), lines
    assert check.problem is EndpointProblem.BAD_ANSWER or "not JSON" in lines[0], (check.problem, lines)
    return lines[0].removeprefix(f"endpoint {URL}: ")


CHAT = "the one-token chat completion answered"


@pytest.mark.parametrize(
    ("answer", "line"),
    [
        (chat(token_ids=(-1,)), f"{CHAT} choices[0].token_ids[0] = -1, not a token id (an int in [0, 2147483648))"),
        (chat(token_ids=(True,)), f"{CHAT} choices[0].token_ids[0] = true, not a token id"),
        (chat(token_ids=(2**70,)), f"{CHAT} choices[0].token_ids[0] = an integer of 71 bits, not a token id"),
        (chat(token_ids="5"), f"{CHAT} choices[0].token_ids = '5', not a list of token ids"),
        (chat(logprob=float("nan")), f"{CHAT} choices[0].logprobs.content[0].logprob = nan, not a finite number"),
        (chat(logprob=float("-inf")), f"{CHAT} choices[0].logprobs.content[0].logprob = -inf, not a finite number"),
        (chat(logprob=False), f"{CHAT} choices[0].logprobs.content[0].logprob = false, not a finite number"),
        (chat(content=5), f"{CHAT} choices[0].logprobs.content = 5, not a list of token entries"),
        (chat(content=[7]), f"{CHAT} choices[0].logprobs.content[0] = 7, not a token entry (an object)"),
        (chat(token=5), f"{CHAT} choices[0].logprobs.content[0].token = 5, not a string"),
        (chat(token="token_id:-3"), f"{CHAT} choices[0].logprobs.content[0].token = 'token_id:-3', not 'token_id:<a"),
        (chat(token="token_id:" + "9" * 30), f"{CHAT} choices[0].logprobs.content[0].token = 'token_id:9999"),
    ],
    ids=[
        "negative-id",
        "bool-id",
        "huge-id",
        "ids-a-string",
        "nan-logprob",
        "inf-logprob",
        "bool-logprob",
        "content-5",
        "content-entry-7",
        "token-5",
        "negative-label",
        "huge-label",
    ],
)
def test_a_wrong_field_in_the_chat_answer_is_one_line_naming_it(answer: dict, line: str) -> None:
    assert checked(answer=answer).startswith(line)


def test_wrong_fields_in_the_other_answers_are_named() -> None:
    assert (
        checked(models={"data": [{"id": 5}]}) == "GET /v1/models answered data[0].id = 5, not a model name (a string)"
    )
    assert checked(models={"data": ["tiny"]}).startswith("GET /v1/models answered data[0] = 'tiny', not a model card")
    assert checked(tokenize={"tokens": [1, -2]}).startswith("POST /tokenize answered tokens[1] = -2, not a token id")
    assert checked(tokenize={"tokens": [False]}).startswith("POST /tokenize answered tokens[0] = false, not a token")


def test_a_5000_digit_integer_is_a_failed_check() -> None:
    digits = b"7" * 5000
    line = checked(models=b'{"data": [{"id": ' + digits + b"}]}")
    assert line.startswith("GET /v1/models answered HTTP 200 with a body that is not JSON (ValueError: Exceeds"), line
    line = checked(answer=b'{"choices": [{"logprobs": {"content": [{"logprob": ' + digits + b"}]}}]}")
    assert line.startswith("a one-token chat completion answered HTTP 200 with a body that is not JSON"), line
    assert checked() == "", "the good answers pass"
