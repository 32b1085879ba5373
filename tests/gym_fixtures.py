"""Session-scoped NeMo-Gym fixtures: the scripted policy behind our OpenAI server, and one NemoGym actor.

Import the fixtures you use into a test module (``from tests.gym_fixtures import gym_actor``);
pytest then shares them across the session, so Gym starts once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

GYM_CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "resources_servers/equivalence_rule/configs/lc.yaml",
]
TOOL_AGENT = "example_single_tool_call_simple_agent"
EQUIVALENCE_AGENT = "lc_equivalence_rule_simple_agent"
SERVED_MODEL_NAME = "tiny"


def tool_call_rows() -> list[dict[str, Any]]:
    """The wheel's example rows for example_single_tool_call (weather questions), routed to its agent."""
    from gym_bridge.gym.servers import wheel_config_path

    path = wheel_config_path("resources_servers/example_single_tool_call/data/example.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["agent_ref"] = {"type": "responses_api_agents", "name": TOOL_AGENT}
    return rows


def equivalence_row(question: str, expected_answer: str) -> dict[str, Any]:
    """A single-turn equivalence_rule row (the wheel's examples are 8k-token contexts)."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": question}],
            "tools": [],
            "max_output_tokens": 64,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        "expected_answer": expected_answer,
        "agent_ref": {"type": "responses_api_agents", "name": EQUIVALENCE_AGENT},
    }


def stamp(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deep copies of ``rows`` with ``_rowidx`` = position."""
    stamped = copy.deepcopy(rows)
    for i, row in enumerate(stamped):
        row["_rowidx"] = i
    return stamped


@pytest.fixture(scope="session")
def scripted_policy(tiny_tokenizer) -> Iterator[Any]:
    """Our OpenAI-compatible server over ``ScriptedGeneration`` on the tiny tokenizer (``.base_url``)."""
    from gym_bridge.generation.scripted import ScriptedGeneration
    from gym_bridge.serving import OpenAIServer

    server = OpenAIServer(ScriptedGeneration(tiny_tokenizer), tiny_tokenizer, served_model_name=SERVED_MODEL_NAME)
    server.start_in_thread()
    yield server
    server.stop_thread()


def gym_actor_config(base_urls: list[str], log_dir: Any, **kwargs: Any):
    from gym_bridge.gym.actor import NemoGymConfig
    from gym_bridge.gym.servers import wheel_config_path

    return NemoGymConfig(
        model_name=SERVED_MODEL_NAME,
        base_urls=base_urls,
        config_paths=[str(wheel_config_path(p)) for p in GYM_CONFIGS],
        log_dir=log_dir,
        startup_timeout_s=150,
        shutdown_timeout_s=15,
        request_timeout_s=60,
        actor_options={"num_cpus": 0},
        **kwargs,
    )


@pytest.fixture(scope="session")
def gym_actor(ray_session, scripted_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    """A spun-up NemoGym actor (tool-call and equivalence agents) on the scripted policy."""
    import ray

    from gym_bridge.gym.actor import spinup_nemo_gym_actor

    config = gym_actor_config([scripted_policy.base_url], tmp_path_factory.mktemp("gym-actor-logs"))
    handle = spinup_nemo_gym_actor(config, tiny_tokenizer)
    yield handle
    try:
        ray.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray.kill(handle)
