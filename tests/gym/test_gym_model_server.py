"""gym-bridge's Gym model server against Gym's own ``vllm_model``, on real NeMo-Gym servers.

One NemoGym actor selects our model server (``NemoGymConfig.model_server="gym_bridge"``)
in front of the scripted policy (our OpenAI server); its Gym also runs Gym's own
``vllm_model`` with a copy of each agent that calls it. The same rows through both
give the same ``/run`` results: every field, every token, every reward. Then the
NeMo-Gym integration tests run again through that actor, with exact tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import ray
from omegaconf import OmegaConf

from gym_bridge import gym_model
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.testing import gym_checks
from gym_bridge.testing.gym_rows import (
    EQUIVALENCE_AGENT,
    GYM_CONFIGS,
    TOOL_AGENT,
    equivalence_row,
    gym_actor_config,
    tool_call_rows,
)

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]

_VLLM = {TOOL_AGENT: "vllm_tool_agent", EQUIVALENCE_AGENT: "vllm_equivalence_agent"}


def _vllm_model_overrides() -> dict[str, Any]:
    """Gym's own vllm_model beside ours, as ``vllm_model``, and a copy of each agent that calls it."""
    overrides: dict[str, Any] = {
        "vllm_model": OmegaConf.to_container(OmegaConf.load(wheel_config_path(GYM_CONFIGS[0])))["policy_model"]
    }
    for path in GYM_CONFIGS[1:]:
        config = OmegaConf.to_container(OmegaConf.load(wheel_config_path(path)))
        for agent, copy_name in _VLLM.items():
            if agent in config:
                entry = copy.deepcopy(config[agent])
                entry["responses_api_agents"]["simple_agent"]["model_server"]["name"] = "vllm_model"
                overrides[copy_name] = entry
    return overrides


@pytest.fixture(scope="module")
def bridge_gym_actor(ray_session, scripted_policy, tiny_tokenizer, tmp_path_factory):
    """A NemoGym actor whose Gym runs gym-bridge's model server in place of vllm_model (Gym's own
    ``vllm_model`` runs beside it, for the agent copies of the equivalence tests)."""
    config = gym_actor_config(
        [scripted_policy.base_url],
        tmp_path_factory.mktemp("bridge-actor-logs"),
        model_server="gym_bridge",
        overrides=_vllm_model_overrides(),
    )
    assert str(gym_model.CONFIG_PATH) in config.servers_config().config_paths
    assert not any("vllm_model" in p for p in config.servers_config().config_paths)
    handle = start_nemo_gym_actor(config, tiny_tokenizer)
    yield handle
    stop_nemo_gym_actors([handle])


@pytest.fixture(scope="module")
def server_urls(bridge_gym_actor) -> dict[str, str]:
    info = ray.get(bridge_gym_actor.server_info.remote(), timeout=60)
    assert info["server_types"]["policy_model"] == "responses_api_models"
    return info["urls"]


def _rows() -> list[dict[str, Any]]:
    return [
        *tool_call_rows()[:2],
        equivalence_row("What is 2+2? Reply with exactly: 4", "4"),
        equivalence_row("What colour is the sky? Reply with exactly: blue", "red"),
    ]


def _run(urls: dict[str, str], agent: str, row: dict[str, Any]) -> dict[str, Any]:
    row = {**copy.deepcopy(row), "agent_ref": {"type": "responses_api_agents", "name": agent}}
    response = httpx.post(f"{urls[agent]}/run", json=row, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def _normalized(result: dict[str, Any]) -> dict[str, Any]:
    """The result with what is random per call (ids, times) and the agent's name replaced by placeholders."""
    result = copy.deepcopy(result)
    result.pop("agent_ref", None)
    response = result["response"]
    response["id"], response["created_at"] = "resp", 0
    calls: dict[str, str] = {}
    for item in response["output"]:
        if item["type"] in ("message", "reasoning"):
            item["id"] = item["type"]
        if "call_id" in item:
            item["call_id"] = calls.setdefault(item["call_id"], f"call_{len(calls)}")
            if item.get("id") is not None:
                item["id"] = item["call_id"]
    return result


def test_same_rows_give_the_same_gym_results(server_urls, tiny_tokenizer):
    for row in _rows():
        agent = row.get("agent_ref", {}).get("name", TOOL_AGENT)
        theirs = _run(server_urls, _VLLM[agent], row)
        ours = _run(server_urls, agent, row)
        assert _normalized(ours) == _normalized(theirs)
        turns = [item for item in ours["response"]["output"] if "generation_token_ids" in item]
        assert turns and all(t["generation_token_ids"][-1] == tiny_tokenizer.eos_token_id for t in turns)
        for before, after in zip(turns, turns[1:]):  # each turn's prompt extends the last prompt + generation
            prefix = before["prompt_token_ids"] + before["generation_token_ids"][:-1]
            assert after["prompt_token_ids"][: len(prefix)] == prefix
    tool = _run(server_urls, TOOL_AGENT, tool_call_rows()[0])
    assert [i["type"] for i in tool["response"]["output"]] == ["function_call", "function_call_output", "message"]
    assert tool["reward"] == 1.0 and tool["response"]["usage"]["input_tokens"] > 0


def test_context_overflow_is_an_empty_cut_turn_like_vllm_model(server_urls):
    row = equivalence_row("Reply with exactly: " + "word " * 5000, "x")
    theirs = _run(server_urls, _VLLM[EQUIVALENCE_AGENT], row)
    ours = _run(server_urls, EQUIVALENCE_AGENT, row)
    assert _normalized(ours) == _normalized(theirs)
    assert ours["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "generation_token_ids" not in ours["response"]["output"][0]


def test_bad_request_is_a_400_naming_the_field(server_urls):
    url = server_urls["policy_model"]
    response = httpx.post(f"{url}/v1/responses", json={"input": [{"type": "telepathy"}]}, timeout=30)
    assert response.status_code == 400 and "input[0]" in response.json()["error"]["message"]
    assert httpx.get(f"{url}/", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "integration_test",
    [
        gym_checks.check_tool_call_group_is_exact_and_in_order,
        gym_checks.check_two_agents_and_several_groups_in_flight,
        gym_checks.check_truncation_flag,
    ],
    ids=lambda f: f.__name__,
)
async def test_integration_through_our_model_server(integration_test, bridge_gym_actor, tiny_tokenizer):
    await integration_test(bridge_gym_actor, tiny_tokenizer)
