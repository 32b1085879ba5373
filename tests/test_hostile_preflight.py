"""``gym-bridge check-endpoint`` (the run's preflight) against endpoints that answer garbage: a tiny local HTTP
server answers without end, with JSON nested 100,000 deep, with terminal escapes and newlines in its error, or
with 100,000 models. Each ends in one line on stderr and exit 2, bounded in what it reads."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gym_bridge.testing.cli import run_cli

ENDLESS_CHUNK = b"[" * 65536


class _Garbage(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # a body that ends when the connection closes: it can go on without end

    def log_message(self, *args: object) -> None:
        pass

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
