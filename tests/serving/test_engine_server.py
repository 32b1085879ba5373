"""One builder serves an engine behind our OpenAI server (``gym-bridge serve``, eval's embedded policy, training):
the port is claimed before a model loads, a failure releases the port, and leaving the block stops server and engine."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from gym_bridge.generation.factory import EngineSpec
from gym_bridge.generation.instant import InstantGeneration
from gym_bridge.models.registry import ModelNotFoundError
from gym_bridge.recipes.engine_server import ServeOptions, build_engine_server, serve_engine
from gym_bridge.serving.listen import ServerBindError, listening_socket


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_engine_is_served_for_the_block_and_stopped_after(tiny_model_dir: Path) -> None:
    spec = EngineSpec(policy="instant", model=str(tiny_model_dir), answer_tokens=3)
    stopped: list[str] = []
    with serve_engine(spec, ServeOptions(served_model_name="m"), step=lambda name: _noting(stopped, name)) as served:
        assert isinstance(served.generation, InstantGeneration) and served.model_path == tiny_model_dir
        assert served.tokenizer.eos_token == "<|im_end|>"
        models = httpx.get(f"{served.base_url}/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == ["m", str(tiny_model_dir)]  # the path too, as vLLM
        port = int(served.base_url.rsplit(":", 1)[1].split("/")[0])
    assert stopped == ["server", "engine"]
    assert _free(port)


def test_a_busy_port_fails_before_the_model_is_looked_at() -> None:
    held = listening_socket("127.0.0.1", 0)
    try:
        port = held.getsockname()[1]
        with pytest.raises(ServerBindError):
            build_engine_server(EngineSpec(model="no-such-model"), ServeOptions(served_model_name="m", port=port))
    finally:
        held.close()


def test_a_refused_model_releases_the_claimed_socket() -> None:
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        build_engine_server(EngineSpec(model="no-such-model"), ServeOptions(served_model_name="m", sock=sock))
    assert sock.fileno() == -1 and _free(port)


class _noting:
    """A stop step that notes its name."""

    def __init__(self, seen: list[str], name: str) -> None:
        self.seen, self.name = seen, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.seen.append(self.name)
