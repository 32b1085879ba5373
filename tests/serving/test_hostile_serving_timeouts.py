"""Issue 49 (item 6): half-sent requests time out, floods of them never use up the file descriptors, and a client
that goes away is not an error.

Each test sends raw bytes on raw sockets to the real server (the scripted engine: nothing here is about the
model) with short limits, and bounds how long the server takes to drop what stalls. The bounds are generous (two
busy cores): the claims are that a drop happens and that nothing logs a traceback.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.serving import OpenAIServer, ServerLimits
from gym_bridge.serving.connections import AcceptErrorFilter
from gym_bridge.testing import wait_until

TIMEOUT_S = 1.0
"""The server's header and body timeouts here."""
SLACK_S = 10.0
"""How much later than the timeout a drop may come on two busy cores (a liveness bound, not a speed claim)."""
HALF_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    b'{"messages": [{"role": "us'
)
HALF_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"


@pytest.fixture(scope="module")
def server(tiny_tokenizer) -> Iterator[OpenAIServer]:
    limits = ServerLimits(body_timeout_s=TIMEOUT_S, header_timeout_s=TIMEOUT_S, max_connections=64)
    served = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, limits=limits)
    served.start_in_thread()
    yield served
    served.stop_thread()


def address(server: OpenAIServer) -> tuple[str, int]:
    host, _, port = server.root_url.removeprefix("http://").rpartition(":")
    return host, int(port)


def stalled(server: OpenAIServer, sent: bytes) -> socket.socket:
    """A connection that sends ``sent`` and then nothing more."""
    sock = socket.create_connection(address(server), timeout=TIMEOUT_S + SLACK_S)
    if sent:
        sock.sendall(sent)
    return sock


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout here fails the test)."""
    received = b""
    with sock:
        while chunk := sock.recv(65536):
            received += chunk
    return received


def health(server: OpenAIServer) -> int:
    with httpx.Client(timeout=SLACK_S) as client:
        return client.get(server.root_url + "/health").status_code


def answers_health(root_url: str) -> bool:
    """Whether ``/health`` answers 200 now (a refused or dropped connection is a no)."""
    try:
        return httpx.get(root_url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_half_a_body_is_a_408_and_the_connection_closes(server: OpenAIServer) -> None:
    started = time.monotonic()
    answer = until_closed(stalled(server, HALF_BODY))
    took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b'"the request body did not arrive within 1 s"' in answer
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("sent", [HALF_HEADERS, b""], ids=["half-headers", "nothing"])
def test_a_connection_without_complete_headers_is_closed(server: OpenAIServer, sent: bytes) -> None:
    started = time.monotonic()
    assert until_closed(stalled(server, sent)) == b"", "no request: nothing to answer"
    assert TIMEOUT_S * 0.9 <= time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_half_headers_after_a_served_request_time_out_too(server: OpenAIServer) -> None:
    """The next request on a kept-alive connection gets the same deadline for its headers."""
    sock = stalled(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while not first.endswith(b'{"status":"ok"}') and (chunk := sock.recv(65536)):  # the whole first answer
        first += chunk
    assert first.startswith(b"HTTP/1.1 200 "), first
    started = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    assert until_closed(sock) == b""
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_many_half_sent_requests_are_dropped_and_health_answers(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    """48 stalled clients (under the cap of 64): each dropped within the bound, ``/health`` answered meanwhile."""
    caplog.set_level(logging.INFO)
    socks = [stalled(server, (HALF_BODY, HALF_HEADERS, b"")[i % 3]) for i in range(48)]
    assert health(server) == 200, "answered while 48 clients stall"
    started = time.monotonic()
    answers = [until_closed(sock) for sock in socks]
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert sum(a.startswith(b"HTTP/1.1 408 ") for a in answers) == 16 and answers.count(b"") == 32
    assert health(server) == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_connections_beyond_the_cap_are_closed_on_arrival(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    socks = [stalled(server, b"") for _ in range(64)]
    wait_until(lambda: len(server._server.server_state.connections) >= 64, SLACK_S, "64 connections open")  # type: ignore[union-attr]
    started = time.monotonic()
    assert until_closed(stalled(server, b"")) == b""
    assert time.monotonic() - started < TIMEOUT_S * 0.9, "closed on arrival, not by the header deadline"
    for sock in socks:
        until_closed(sock)
    wait_until(lambda: answers_health(server.root_url), SLACK_S, "served again once the stalled ones are gone")
    warnings = [r.getMessage() for r in caplog.records if r.name == "gym_bridge.serving.connections"]
    assert any("closed on arrival" in w and "the limit is 64" in w for w in warnings), warnings


def test_a_client_that_disconnects_mid_body_is_not_an_error(tiny_tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    """The client closes once its request has reached the app, which is waiting for the rest of the body: one INFO line.

    A server of its own with a body timeout far above the test's length, so the close (not the 408) ends the request
    however loaded the machine is; the close waits on the app's task, not on a pause.
    """
    caplog.set_level(logging.INFO)
    for name in ("gym_bridge", "gym_bridge.serving"):  # `gym-bridge train` run in this process sets them to WARNING
        caplog.set_level(logging.INFO, logger=name)
    limits = ServerLimits(body_timeout_s=300.0, header_timeout_s=300.0)
    served = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, limits=limits)
    served.start_in_thread()
    try:
        state = served._server.server_state  # type: ignore[union-attr]
        sock = stalled(served, HALF_BODY)
        wait_until(lambda: state.tasks, SLACK_S, "the request reaches the app")
        sock.close()
        wait_until(lambda: [r for r in caplog.records if "disconnected" in r.getMessage()], SLACK_S, "disconnect")
        assert health(served) == 200
    finally:
        served.stop_thread()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def test_accept_errors_are_one_line_per_window() -> None:
    error = OSError(24, "Too many open files")
    accept_filter = AcceptErrorFilter()

    def record(message: str = "socket.accept() out of system resource\nsocket: <socket fd=7>") -> logging.LogRecord:
        made = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), None)
        made.exc_info = (OSError, error, None)
        return made

    first = record()
    assert accept_filter.filter(first) and first.exc_info is None
    assert first.getMessage() == "socket.accept() out of system resource: [Errno 24] Too many open files"
    assert not any(accept_filter.filter(record()) for _ in range(2000)), "the same failure again: held back"
    other = record("Task exception was never retrieved")
    assert accept_filter.filter(other) and other.exc_info is not None, "other asyncio records are left alone"
    accept_filter._last -= 60  # the window has passed
    later = record()
    assert accept_filter.filter(later)
    assert later.getMessage().endswith("Too many open files (2000 more in the last 10 s)")


SERVE = textwrap.dedent(
    """
    import logging, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from transformers import AutoTokenizer
    from gym_bridge.generation.scripted import ScriptedGeneration
    from gym_bridge.serving import OpenAIServer, ServerLimits
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    servers = []
    for cap in (None, 100_000):  # the default cap, then none
        limits = ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=cap)
        servers.append(OpenAIServer(ScriptedGeneration(tok), tok, limits=limits))
        print(servers[-1].start_in_thread(), flush=True)
    sys.stdin.read()
    for server in servers:
        server.stop_thread()
    """
)


def drained(sock: socket.socket) -> None:
    """Read until the server closes ``sock`` (or resets it: closed on arrival with bytes unread)."""
    with sock:
        sock.settimeout(30)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass


def flood(root_url: str, clients: int) -> None:
    """``clients`` connections that send half of their headers and stall, each read until the server drops it;
    then the server must answer ``/health`` again."""
    host, _, port = root_url.removeprefix("http://").rpartition(":")
    socks = []
    for _ in range(clients):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(HALF_HEADERS)
        socks.append(sock)
    for sock in socks:
        drained(sock)
    wait_until(lambda: answers_health(root_url), 30, "served again")


@pytest.mark.e2e
def test_a_flood_of_stalled_clients_never_logs_a_traceback(tiny_model_dir: Path) -> None:
    """A server process allowed 256 open files, and 400 clients that connect and stall, twice. With the default
    cap (three quarters of the limit) the excess is closed on arrival; with no cap the descriptors run out, and
    asyncio's failed accepts (thousands in one loop turn) are one line per ten seconds. Either way the stalled ones
    time out, the server answers again, and no traceback is written."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(tiny_model_dir), "256"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None and process.stderr is not None
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(process.stderr or ()), daemon=True)
    reader.start()
    try:
        capped, uncapped = (process.stdout.readline().strip().removesuffix("/v1") for _ in range(2))
        assert capped.startswith("http://") and uncapped.startswith("http://"), "".join(stderr)[-3000:]
        flood(capped, 400)
        said = "".join(stderr)
        assert "closed on arrival" in said and "the limit is 192" in said, said[-3000:]
        flood(uncapped, 400)
        process.stdin.close()
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    log = "".join(stderr)
    assert "Traceback" not in log, log[-3000:]
    assert "socket.accept() out of system resource: [Errno 24] Too many open files" in log, log[-3000:]
    assert log.count("out of system resource") <= 3, log[-3000:]
