"""The real proxy (``build_proxy``) in front of a hostile upstream on 127.0.0.1: a 1 GB answer, plain and gzip, is a
502 naming the cap while the proxy's memory grows by less than 256 MB; a bad field is a 502 naming it."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from gym_bridge.serving import build_proxy
from gym_bridge.testing.process import wait_until

GIB = 1 << 30
CHUNK = 1 << 20


def _plain_gigabyte() -> Iterator[bytes]:
    yield b'{"choices": [{"text": "'
    for _ in range(GIB // CHUNK):
        yield b"a" * CHUNK
    yield b'"}]}'


def _gzip_gigabyte() -> Iterator[bytes]:
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(CHUNK)
    for _ in range(GIB // CHUNK):
        yield packer.compress(zeros)
    yield packer.flush()


class HostileUpstream:
    """A uvicorn app on a thread whose ``/v1/completions`` answers as ``mode`` says."""

    def __init__(self) -> None:
        self.mode = "plain"
        self.sent = 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions() -> object:
            if self.mode == "plain":
                return StreamingResponse(self._counted(_plain_gigabyte()), media_type="application/json")
            if self.mode == "gzip":
                headers = {"content-encoding": "gzip"}
                return StreamingResponse(self._counted(_gzip_gigabyte()), media_type="application/json", headers=headers)
            choice = {"text": "x", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "stop"}
            if self.mode == "vocab":
                choice["token_ids"] = [10**9]
            elif self.mode == "logprob":
                choice["logprobs"] = {"token_logprobs": [0.5]}
            elif self.mode == "finish":
                choice["finish_reason"] = 42
            return JSONResponse({"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the hostile upstream starting")

    def _counted(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.sent += len(chunk)
            yield chunk

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def hostile_proxy(tiny_tokenizer):
    upstream = HostileUpstream()
    fast = {"max_retries": 1, "backoff_base_s": 0.01, "unhealthy_cooldown_s": 0.0}
    server = build_proxy(
        [upstream.url], tiny_tokenizer, upstream_model="up", served_model_name="tiny", max_model_len=2048,
        http_options=fast,
    )  # fmt: skip
    server.start_in_thread()
    yield upstream, server
    server.stop_thread()
    server.state.generation.shutdown()
    upstream.stop()


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _post(server) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("mode", ["plain", "gzip"])
def test_a_gigabyte_answer_is_a_502_and_the_proxy_stays_small(hostile_proxy, mode):
    upstream, server = hostile_proxy
    upstream.mode, upstream.sent = mode, 0
    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        response = _post(server)
    finally:
        done.set()
        sampler.join(5)
    assert response.status_code == 502, response.text
    assert "larger than" in response.json()["error"]["message"]
    growth = peak[0] - start
    print(f"{mode}: upstream sent {upstream.sent / 2**20:.1f} MiB, proxy RSS grew {growth / 2**20:.1f} MiB")
    assert growth < 256 << 20
    assert _post_health(server) == 200


def _post_health(server) -> int:
    return httpx.get(server.root_url + "/health", timeout=30).status_code


@pytest.mark.parametrize(
    ("mode", "field"), [("vocab", "token_ids[0]"), ("logprob", "token_logprobs[0]"), ("finish", "finish_reason")]
)
def test_a_bad_field_from_upstream_is_a_502_naming_it(hostile_proxy, mode, field):
    upstream, server = hostile_proxy
    upstream.mode = mode
    response = _post(server)
    assert response.status_code == 502, response.text
    assert field in response.json()["error"]["message"]
