"""A row for an agent that Gym's config puts behind a working environment server goes through that server.

Gym 0.7's ``example_single_tool_call_single_agent_turn.yaml`` fronts a session agent with
``single_agent_turn_legacy``, which seeds the resources and agent sessions, grants the tools, runs one agent
turn and verifies. Gym's own ``run_examples`` posts each row to that server; so do we (the routes Gym's code
computed at start name it), and rewards, token ids and logprobs are equal on the same servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from gym_bridge.gym.protocol.rows import build_rows
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym_versions import installed_gym
from gym_bridge.testing.gym_rows import gym_actor_config, gym_token_turns, gyms_own_collection, tool_call_rows
from gym_bridge.types import GenerationSamplingParams

pytestmark = [
    pytest.mark.gym,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        not installed_gym().relays_per_agent, reason=f"{installed_gym().label} has no environment servers"
    ),
]

CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call_single_agent_turn.yaml",
]
AGENT = "example_single_tool_call_session_agent"
ENVIRONMENT_SERVER = "example_single_tool_call_single_agent_turn"


@pytest.fixture(scope="module")
def fronted_actor(ray_session, scripted_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    config = gym_actor_config([scripted_policy.base_url], tmp_path_factory.mktemp("env-server-logs")).model_copy(
        update={"config_paths": [str(wheel_config_path(p)) for p in CONFIGS]}
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    stop_nemo_gym_actors([actor])


def test_rows_go_through_the_working_environment_server_as_gym_sends_them(fronted_actor):
    routes = ray.get(fronted_actor.routes.remote())
    assert routes.dispatch[AGENT] == ENVIRONMENT_SERVER, routes
    rows = []
    for i, row in enumerate(tool_call_rows()[:3]):
        built = build_rows({**row, "agent_ref": {"name": AGENT}}, 1, GenerationSamplingParams(1.0, 1.0), 64,
                           task_index=i)[0]  # fmt: skip
        built["_rowidx"] = i
        rows.append(built)
    gym_results = gyms_own_collection(fronted_actor, rows)
    ours = asyncio.run(GymClient([fronted_actor]).run_group(rows, prompt_idx=0, deadline_s=180)).rows
    assert [row.reward for row in ours] == [gym["reward"] for gym in gym_results]
    assert any(row.reward > 0 for row in ours), "the environment server verifies the scripted tool calls"
    for row, gym in zip(ours, gym_results, strict=True):
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert [m["token_ids"].tolist() for m in assistant] == [t["generation_token_ids"] for t in gym_token_turns(gym)]
        for message, turn in zip(assistant, gym_token_turns(gym), strict=True):
            assert torch.equal(message["generation_logprobs"], torch.tensor(turn["generation_log_probs"]))
