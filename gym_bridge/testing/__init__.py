"""A pytest plugin for integration suites of NeMo-Gym environments: real Ray, real Gym, a real endpoint.

pytest loads it through the ``pytest11`` entry point (name ``gym_bridge.testing``) wherever
gym-bridge is installed, but it is inert: it defines fixtures and no hooks, imports nothing
heavy, and nothing starts until a test requests a fixture. With plugin autoloading off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``) ask for it with ``-p gym_bridge.testing`` or
``pytest_plugins = ["gym_bridge.testing"]`` in a root conftest. docs/testing.md shows a user test.

Fixtures (session-scoped unless noted; override the first three in your conftest):

- ``gym_configs``: the Gym config files to start (wheel-relative or absolute paths);
- ``gym_policy_name``: the policy behind the endpoint: ``"scripted"`` (default), ``"tiny"``,
  ``"smollm2"`` or a local model folder;
- ``gym_rollout_options``: keyword arguments for :class:`RolloutManager` (N, max_seq_len, ...);
- ``ray_session``: the caller's Ray if initialized, else a local one (stopped at the end);
- ``tiny_model_dir`` / ``tiny_tokenizer``: the embedded tiny model, built into a temp folder;
- ``scripted_policy``: our OpenAI-compatible server over the scripted policy (``.base_url``);
- ``gym_policy``: the server for ``gym_policy_name`` (the scripted one is shared, not started twice);
- ``nemo_gym_config``: the :class:`NemoGymConfig` for ``gym_configs`` on ``gym_policy``;
- ``gym_actor``: one spun-up NemoGym actor for that config, shut down at the end;
- ``gym_rollout_manager`` (per test): a ready ``RolloutManager(use_nemo_gym=True)`` on ``gym_actor``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from gym_bridge.json_types import JsonObject

if TYPE_CHECKING:  # the plugin imports nothing heavy until a fixture runs (gym_bridge.types imports torch)
    from gym_bridge.gym.transport.actor_config import NemoGymConfig
    from gym_bridge.rollout.manager import RolloutManager
    from gym_bridge.serving import OpenAIServer
    from gym_bridge.types import ActorHandle, Tokenizer

DEFAULT_GYM_CONFIGS = (
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "resources_servers/equivalence_rule/configs/lc.yaml",
)
"""The policy model server plus two resources servers shipped in the nemo-gym wheel."""
SERVED_MODEL_NAME = "tiny"
"""The model name our endpoint serves and Gym's model server asks for."""


def wait_until[T](condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy (returned) or ``timeout_s`` passes (TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not true within {timeout_s}s")
        time.sleep(poll_s)


async def async_wait_until[T](
    condition: Callable[[], T | Coroutine[object, object, T]], timeout_s: float, what: str, poll_s: float = 0.01
) -> T:
    """:func:`wait_until` for a running event loop; ``condition`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await _result_of(condition)
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not true within {timeout_s}s")
        await asyncio.sleep(poll_s)


async def _result_of[T](condition: Callable[[], T | Coroutine[object, object, T]]) -> T:
    """What ``condition()`` returns, awaited when it is a coroutine."""
    value = condition()
    if isinstance(value, Coroutine):
        return await value
    return value


@pytest.fixture(scope="session")
def gym_configs() -> list[str]:
    """Override to name your own Gym configs (the model server config plus your resources servers)."""
    return list(DEFAULT_GYM_CONFIGS)


@pytest.fixture(scope="session")
def gym_policy_name() -> str:
    """Override to pick the policy: ``"scripted"``, ``"tiny"``, ``"smollm2"`` or a local model folder."""
    return "scripted"


@pytest.fixture
def gym_rollout_options() -> JsonObject:
    """Override to change the :class:`RolloutManager` settings ``gym_rollout_manager`` uses."""
    return {
        "num_generations_per_prompt": 2,
        "max_seq_len": 4096,
        "generation_config": {
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 64,
            "top_k": None,
            "stop_strings": None,
        },
    }


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """The caller's Ray when it is initialized (left running), else a local one stopped at the end."""
    import ray

    from gym_bridge.ray_utils import init_ray

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, built once per session into a private cache folder."""
    from gym_bridge.models.tiny import build_tiny_model

    return build_tiny_model(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    """The tiny model's tokenizer (the scripted policy speaks it too)."""
    from gym_bridge.models.folder_check import load_tokenizer

    # transformers types decode() for batches too (str | list[str]); a flat id list decodes to str, as Tokenizer says
    return cast("Tokenizer", load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="session")
def scripted_policy(tiny_tokenizer: Tokenizer) -> Iterator[OpenAIServer]:
    """Our OpenAI-compatible server over ``ScriptedGeneration`` on the tiny tokenizer (``.base_url``)."""
    from gym_bridge.generation.scripted import ScriptedGeneration
    from gym_bridge.serving import OpenAIServer

    server = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, served_model_name=SERVED_MODEL_NAME)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="session")
def gym_policy(request: pytest.FixtureRequest, gym_policy_name: str) -> Iterator[OpenAIServer]:
    """The endpoint Gym's model server calls: our server over the policy ``gym_policy_name`` names."""
    if gym_policy_name == "scripted":
        yield request.getfixturevalue("scripted_policy")
        return
    from gym_bridge.generation.hf import HFGeneration
    from gym_bridge.generation.hf_config import HFGenerationConfig
    from gym_bridge.models.registry import resolve_model_path
    from gym_bridge.serving import OpenAIServer

    if gym_policy_name == "tiny":
        path = request.getfixturevalue("tiny_model_dir")
    else:  # "smollm2" (when gym_bridge.models knows it) or a local folder
        path = resolve_model_path(gym_policy_name)
    generation = HFGeneration(HFGenerationConfig(model=str(path), max_new_tokens=64, seed=0))
    server = OpenAIServer(generation, generation.tokenizer, served_model_name=SERVED_MODEL_NAME, model_path=str(path))
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop_thread()
        generation.shutdown()


@pytest.fixture(scope="session")
def gym_tokenizer(request: pytest.FixtureRequest, gym_policy_name: str, gym_policy: OpenAIServer) -> Tokenizer:
    """The tokenizer of ``gym_policy`` (the tiny one for the scripted and tiny policies)."""
    if gym_policy_name in ("scripted", "tiny"):
        tokenizer: Tokenizer = request.getfixturevalue("tiny_tokenizer")
        return tokenizer
    return cast("Tokenizer", gym_policy.state.tokenizer)


@pytest.fixture(scope="session")
def nemo_gym_config(
    gym_configs: list[str], gym_policy: OpenAIServer, tmp_path_factory: pytest.TempPathFactory
) -> NemoGymConfig:
    """The :class:`NemoGymConfig` for ``gym_configs`` on ``gym_policy``; override to add fields."""
    from gym_bridge.gym.servers.config_files import wheel_config_path
    from gym_bridge.gym.transport.actor_config import NemoGymConfig

    paths = [p if Path(p).is_absolute() else str(wheel_config_path(p)) for p in gym_configs]
    assert gym_policy.base_url is not None, "the gym_policy fixture starts its server"
    return NemoGymConfig(
        model_name=SERVED_MODEL_NAME,
        base_urls=[gym_policy.base_url],
        config_paths=paths,
        log_dir=tmp_path_factory.mktemp("gym-actor-logs"),
        startup_timeout_s=150,
        shutdown_timeout_s=15,
        request_timeout_s=60,
        actor_options={"num_cpus": 0},
    )


@pytest.fixture(scope="session")
def gym_actor(ray_session: None, nemo_gym_config: NemoGymConfig, gym_tokenizer: Tokenizer) -> Iterator[ActorHandle]:
    """One spun-up NemoGym actor for ``nemo_gym_config``, shut down (Gym processes included) at the end."""
    from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors

    handle = start_nemo_gym_actor(nemo_gym_config, gym_tokenizer)
    yield handle
    stop_nemo_gym_actors([handle])


@pytest.fixture
def gym_rollout_manager(
    gym_actor: ActorHandle, gym_tokenizer: Tokenizer, gym_rollout_options: JsonObject
) -> RolloutManager:
    """A ready ``RolloutManager(use_nemo_gym=True)`` on ``gym_actor`` (task name ``"nemo_gym"``)."""
    from gym_bridge.rollout.manager import RolloutManager

    return RolloutManager(
        tokenizer=gym_tokenizer, task_to_env={"nemo_gym": gym_actor}, use_nemo_gym=True, **gym_rollout_options
    )
