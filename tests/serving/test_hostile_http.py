"""Issue 57 (item 7, HTTP): request heads are bounded in size (a 431 past ``max_header_bytes``) and in time for
every request of a connection, pipelined ones included, while the server keeps answering others.

Raw bytes on raw sockets to the real server (the scripted engine: nothing here is about the model) with a short
header deadline and a small head bound. Time bounds are generous liveness bounds (two busy cores), not speed
claims.
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_hostile_serving_timeouts import SLACK_S, address, answers_health, stalled, until_closed

from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.serving import OpenAIServer, ServerLimits
from gym_bridge.testing import wait_until

TIMEOUT_S = 1.0
"""The server's header (and body) deadline here."""
CAP = 32 * 1024
"""The server's bound on a request's head here (half the default, so the setting is what is tested)."""
READ = 256 * 1024
"""The most asyncio's transport reads from a socket at once: the server may hold up to this past the bound."""
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


@pytest.fixture(scope="module")
def server(tiny_tokenizer) -> Iterator[OpenAIServer]:
    limits = ServerLimits(
        header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_header_bytes=CAP, max_connections=64
    )
    served = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, limits=limits)
    served.start_in_thread()
    yield served
    served.stop_thread()


def received(sock: socket.socket) -> bytes:
    """What the server sent until it closed ``sock``, kept when the close is a reset (it closed with our bytes
    unread); a socket timeout fails the test (the server neither answered nor closed)."""
    got = b""
    with sock:
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return got


def responses(sock: socket.socket, count: int) -> bytes:
    """The first ``count`` answers to ``GET /health`` on ``sock`` (each ends with its JSON body)."""
    got = b""
    while got.count(b'{"status":"ok"}') < count and (chunk := sock.recv(65536)):
        got += chunk
    return got


def statuses(answer: bytes) -> list[int]:
    return [int(code) for code in STATUS.findall(answer)]


class PeakRss:
    """This process's resident memory sampled every 5 ms on a thread (the server runs in this process)."""

    def __init__(self) -> None:
        self.baseline = self.now()
        self.peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def kernel_receive_buffer_max() -> int:
    """The most the kernel may hold unread for the server's socket (``tcp_rmem``'s maximum)."""
    return int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])


def stream_header(server: OpenAIServer, total: int) -> tuple[int, bytes]:
    """Stream one header value of ``total`` bytes, 64 KiB a send, stopping once the server answers or closes;
    return how many bytes were sent and the answer."""
    sock = socket.create_connection(address(server), timeout=TIMEOUT_S + SLACK_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    chunk, sent = b"a" * 65536, 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        while sent < total and not select.select([sock], [], [], 0)[0]:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent, received(sock)


def test_a_256_mb_header_is_a_431_after_the_bound(server: OpenAIServer) -> None:
    """Sent as a stream, the header is refused once the server holds more than the bound: what was sent by then
    is the bound, one read and the kernel's socket buffers, and the server's memory does not grow by the header."""
    with PeakRss() as rss:
        sent, answer = stream_header(server, 256 * 2**20)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert f"the request's headers exceed {CAP} bytes".encode() in answer
    kernel = kernel_receive_buffer_max() + 2 * 64 * 1024  # the server's receive buffer, our (doubled) send buffer
    assert sent <= CAP + READ + kernel, f"{sent} bytes sent before the server answered"
    assert rss.peak - rss.baseline < 64 * 2**20, f"memory grew by {(rss.peak - rss.baseline) / 2**20:.0f} MiB"
    assert answers_health(server.root_url)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"X-A: " + b"a" * (CAP - 100) + b"\r\n", 200),
        (b"X-A: " + b"a" * CAP + b"\r\n", 431),
        (b"".join(b"X-%05d: %s\r\n" % (i, b"v" * 8) for i in range(CAP // 16)), 431),
        (b"".join(b"X-%05d: %s\r\n" % (i, b"v" * 8) for i in range(CAP // 32)), 200),
    ],
    ids=["one-header-under", "one-header-over", "many-headers-over", "many-headers-under"],
)
def test_the_bound_is_on_the_whole_head(server: OpenAIServer, head: bytes, status: int) -> None:
    sock = stalled(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head + b"\r\n")
    assert statuses(received(sock)) == [status]


def test_a_head_over_the_bound_behind_a_served_request_is_a_431(server: OpenAIServer) -> None:
    sock = stalled(server, HEALTH + b"GET /health HTTP/1.1\r\nX-A: " + b"a" * (2 * CAP))
    assert statuses(received(sock)) == [200, 431]


@pytest.mark.parametrize("served_first", [1, 3])
def test_a_half_sent_pipelined_request_is_closed_by_the_header_deadline(
    server: OpenAIServer, served_first: int
) -> None:
    """``served_first`` whole requests and half of the next in one send: each whole one is answered, then the
    connection is closed within the header deadline (not uvicorn's 120 s keep-alive); others are served meanwhile."""
    started = time.monotonic()
    sock = stalled(server, HEALTH * served_first + b"GET /health HTTP/1.1\r\nHo")
    answers = responses(sock, served_first)
    assert answers_health(server.root_url), "answered while the pipelined connection stalls"
    answers += received(sock)
    took = time.monotonic() - started
    assert statuses(answers) == [200] * served_first, answers[:300]
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + SLACK_S


def test_half_a_head_sent_with_a_body_has_the_header_deadline(server: OpenAIServer) -> None:
    """A chat's head, then (while the app waits for it) its body with half of the next request's head behind it:
    the chat is answered, then the connection is closed within the header deadline."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    )
    sock = stalled(server, head % len(body))
    wait_until(lambda: server._server.server_state.tasks, SLACK_S, "the chat reaches the app")  # type: ignore[union-attr]
    started = time.monotonic()
    sock.sendall(body + b"GET /health HTTP/1.1\r\nHo")
    answers = received(sock)
    assert statuses(answers) == [200], answers[:300]
    assert b'"chat.completion"' in answers
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_an_idle_kept_alive_connection_outlives_the_header_deadline(server: OpenAIServer) -> None:
    """Nothing of a next request sent: the keep-alive timeout (120 s) governs, not the header deadline."""
    sock = stalled(server, HEALTH)
    assert statuses(responses(sock, 1)) == [200]
    time.sleep(TIMEOUT_S * 2.5)
    sock.sendall(HEALTH)
    assert statuses(responses(sock, 1)) == [200], "still open and served after the header deadline"
    sock.close()


# ---- generated heads ---------------------------------------------------------------------------------------

TOKEN = st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,20}\Z").filter(
    lambda name: name.lower() not in {b"content-length", b"transfer-encoding", b"connection", b"expect", b"upgrade"}
)
"""Header names that do not change the framing (the property is about heads, not about bodies)."""
ODD_BYTES = st.binary(min_size=1, max_size=6)
"""Anything in a name or value: colons, CR, LF, NUL, bytes past ASCII."""


@st.composite
def header_lines(draw: st.DrawFn) -> bytes:
    """One header: a plain or odd name; a value of 0 to twice the bound (repeated), maybe folded across lines."""
    name = draw(TOKEN | ODD_BYTES)
    size = draw(st.integers(0, 64) | st.integers(0, 2 * CAP))
    value = draw(st.sampled_from([b"v", b" ", b"\t", b"\xff", b"x,"])) * size
    if draw(st.booleans()):
        value += draw(st.sampled_from([b"\r\n folded", b"\r\n\tfolded", b"\n cont", b"\r\n"])) + draw(ODD_BYTES)
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    return name + b": " + value + eol


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """A request line and a few headers, or a great many of one shape, ended by a blank line."""
    line = draw(
        st.sampled_from([b"GET /health HTTP/1.1", b"GET /v1/models HTTP/1.1", b"GET / HTTP/1.1", b"GET /health"])
        | st.builds(lambda target: b"GET /" + target + b" HTTP/1.1", ODD_BYTES)
    )
    headers = draw(st.lists(header_lines(), max_size=6))
    if draw(st.booleans()):
        headers.append(b"X-R: r\r\n" * draw(st.integers(0, 2 * CAP // 8)))
    return line + b"\r\nHost: x\r\n" + b"".join(headers) + b"\r\n"


@st.composite
def connection_streams(draw: st.DrawFn) -> list[bytes]:
    """Generated heads one after another (pipelined), then either a last request that closes the connection or
    half of another head; cut into fragments, each its own send."""
    stream = b"".join(draw(st.lists(heads(), min_size=1, max_size=3)))
    if draw(st.booleans()):
        stream += b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    else:
        last = draw(heads())
        stream += last[: draw(st.integers(1, len(last) - 1))]
    cuts = sorted(draw(st.lists(st.integers(1, len(stream) - 1), max_size=4, unique=True)))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


def send_all(sock: socket.socket, fragments: list[bytes]) -> None:
    """Send each fragment; stop quietly once the server has closed the connection."""
    try:
        for fragment in fragments:
            sock.sendall(fragment)
    except (BrokenPipeError, ConnectionResetError):
        pass


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(fragments=connection_streams())
def test_any_head_is_answered_or_closed_and_health_answers(server: OpenAIServer, fragments: list[bytes]) -> None:
    """Whatever the heads' shape, the server answers with statuses (never a 5xx) or closes, within the header
    deadline plus a margin, and keeps answering ``/health``."""
    sock = socket.create_connection(address(server), timeout=2 * TIMEOUT_S + SLACK_S)
    send_all(sock, fragments)
    answer = received(sock)
    assert not answer or answer.startswith(b"HTTP/1.1 "), answer[:200]
    assert all(100 <= status < 500 for status in statuses(answer)), answer[:300]
    wait_until(lambda: answers_health(server.root_url), SLACK_S, "/health answered")


def test_every_connection_is_gone_after_the_properties(server: OpenAIServer) -> None:
    """No connection the hostile heads opened is still held (only the server's own bookkeeping is read)."""
    connections = server._server.server_state.connections  # type: ignore[union-attr]
    wait_until(lambda: len(connections) == 0, TIMEOUT_S + SLACK_S, "every connection closed")
    assert until_closed(stalled(server, b"GET /health HTTP/1.1\r\nHo")) == b""
