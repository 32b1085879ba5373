"""A fault-injecting reverse proxy in front of an OpenAI-compatible endpoint, run as its own process.

``FaultGate(upstream).start()`` spawns ``python -m gym_bridge.testing.fault_gate`` on 127.0.0.1 (a
fixed port, so it can be SIGKILLed and started again where Gym expects it). It
forwards every request to the upstream; ``set(mode, ...)`` makes chat completions
misbehave:

- ``status``: answer ``status`` with an OpenAI error ``message`` instead of forwarding;
- ``no_logprobs`` / ``nan_logprobs``: forward, then drop the logprobs and token-id fields / make
  every logprob NaN;
- ``delay``: wait ``delay_s`` before forwarding;
- ``rename_model``: forward with the request's ``model`` replaced by ``model`` (the upstream's real 404).

``times`` limits a fault to the next N chat requests (then it passes through);
``stats()`` counts chat requests seen and faults applied, and shows the last
``Authorization`` header (so a test knows a planted key really travelled) and the ``X-Session-ID`` of every
completions request, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gym_bridge.boundary.json_io import loads_object
from gym_bridge.json_types import JsonObject
from gym_bridge.testing.process import ServiceProcess

CHAT_PATH = "v1/chat/completions"
COMPLETIONS_PATH = "v1/completions"
SESSION_HEADER = "x-session-id"
"""Recorded for each completions request (``stats()["sessions"]``): the session key a model server sent."""


class FaultGate(ServiceProcess):
    """The test-side handle: start, SIGKILL, restart and steer the gate process."""

    def __init__(self, upstream_root: str, port: int, log_path: Path) -> None:
        super().__init__("fault gate", port, log_path, ready_path="/admin/stats")
        self.upstream_root = upstream_root.rstrip("/")

    def start(self, timeout_s: float = 30.0) -> None:
        command = [sys.executable, "-m", "gym_bridge.testing.fault_gate", "--upstream", self.upstream_root]
        self.spawn([*command, "--port", str(self.port)], timeout_s)

    def set(self, mode: str = "pass", **params: object) -> None:
        httpx.post(
            f"{self.root_url}/admin/mode", json={"mode": mode, "times": None, **params}, timeout=5
        ).raise_for_status()

    def stats(self) -> JsonObject:
        stats: JsonObject = httpx.get(f"{self.root_url}/admin/stats", timeout=5).json()
        return stats


def build_app(upstream_root: str) -> FastAPI:
    app = FastAPI()
    state: JsonObject = {"mode": "pass", "times": None, "chat": 0, "faulted": 0, "auth": None, "sessions": []}
    client = httpx.AsyncClient(base_url=upstream_root, timeout=120.0, trust_env=False)

    @app.post("/admin/mode")
    async def set_mode(request: Request) -> JsonObject:
        state.update(await request.json())
        return state

    @app.get("/admin/stats")
    async def stats() -> JsonObject:
        return {
            "chat": state["chat"],
            "faulted": state["faulted"],
            "auth": state["auth"],
            "sessions": state["sessions"],
        }

    def take_fault() -> str:
        if state["mode"] == "pass" or state["times"] == 0:
            return "pass"
        if state["times"] is not None:
            state["times"] -= 1
        state["faulted"] += 1
        return str(state["mode"])

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        mode = take_fault() if path == CHAT_PATH else "pass"
        if path == CHAT_PATH:
            state["chat"] += 1
            state["auth"] = request.headers.get("authorization")
        if path == COMPLETIONS_PATH:
            state["sessions"].append(request.headers.get(SESSION_HEADER))
        if mode == "status":
            error = {
                "message": state.get("message", "injected fault"),
                "type": "BadRequestError",
                "code": state["status"],
            }
            return JSONResponse({"error": error, "object": "error"}, status_code=state["status"])
        if mode == "delay":
            await asyncio.sleep(state["delay_s"])
        content = await request.body()
        if mode == "rename_model":  # the upstream (our server) answers its own 404 for a model it does not serve
            content = json.dumps({**loads_object(content, "the request body"), "model": state["model"]}).encode()
        upstream = await client.request(
            request.method, f"/{path}", content=content, headers={"content-type": "application/json"}
        )
        if mode in ("no_logprobs", "nan_logprobs") and upstream.status_code == 200:
            body = upstream.json()
            for choice in body.get("choices", []):
                message = choice.get("message") or {}
                if mode == "no_logprobs":  # what a vLLM without logprobs (and without NeMo-RL's patch) sends
                    choice["logprobs"] = None
                    for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
                        message.pop(key, None)
                else:
                    for item in (choice.get("logprobs") or {}).get("content") or []:
                        item["logprob"] = float("nan")
                    if "generation_log_probs" in message:
                        message["generation_log_probs"] = [float("nan")] * len(message["generation_log_probs"])
            return Response(json.dumps(body), media_type="application/json")
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="fault-injecting reverse proxy (tests only)")
    parser.add_argument("--upstream", required=True, help="the upstream root URL, without /v1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build_app(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
