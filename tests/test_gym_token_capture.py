"""Token capture for agents whose responses carry no token ids (Gym 0.7's ``token_id_capture``).

The agent is Gym's ``simple_agent`` with the token fields removed from its result (``tests/data/tokenless_agent``),
as an external harness returns it; the policy is our server over the tiny model, sampling at temperature 1. With
``token_id_capture`` on, Gym's model server records every call under the row's capture key and the NemoGym actor
finalises each result with Gym's own finaliser: the completions hold the endpoint's token ids, and their logprobs
equal a forward pass of the tiny model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gym_bridge.failures import SettingError
from gym_bridge.gym.client import GymClient
from gym_bridge.gym.rows import build_rows
from gym_bridge.gym.server_config import wheel_config_path
from gym_bridge.gym.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym.token_capture import capture_block
from gym_bridge.gym.versions import installed_gym
from gym_bridge.testing.gym_rows import gym_actor_config, tool_call_rows
from gym_bridge.types import GenerationSamplingParams

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(400)]

AGENT_DIR = Path(__file__).parent / "data" / "tokenless_agent"
CAPTURE = {"token_id_capture": {"enabled": True, "all_agents": True}}
CAPTURES = installed_gym().token_id_capture


@pytest.fixture(scope="module")
def capturing_actor(ray_session, tiny_sampling_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    if not CAPTURES:
        pytest.skip(f"{installed_gym().label} has no token_id_capture (test_capture_is_refused_... covers it)")
    configs = [
        str(wheel_config_path("responses_api_models/vllm_model/configs/vllm_model_for_training.yaml")),
        str(wheel_config_path("resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml")),
        str(AGENT_DIR / "configs" / "tokenless_agent.yaml"),
    ]
    config = gym_actor_config([tiny_sampling_policy.base_url], tmp_path_factory.mktemp("capture-logs")).model_copy(
        update={
            "config_paths": configs,
            "server_dirs": {"responses_api_agents/tokenless_agent": AGENT_DIR},
            "overrides": CAPTURE,
        }
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    stop_nemo_gym_actors([actor])


def test_captured_tokens_and_logprobs_are_the_endpoints(capturing_actor, tiny_lm):
    _, model = tiny_lm
    rows = []
    for task, row in enumerate(tool_call_rows()[:2]):
        template = {**row, "agent_ref": {"name": "tokenless_agent"}}
        rows += build_rows(template, 2, GenerationSamplingParams(1.0, 1.0), 12, task_index=task)
    for i, row in enumerate(rows):
        row["_rowidx"] = i
    group = asyncio.run(GymClient([capturing_actor]).run_group(rows, prompt_idx=0, deadline_s=240))
    assert len(group.rows) == 4
    for result in group.rows:
        assert not result.mask_sample, result.full_result.get("_ng_token_capture")
        assistant = [m for m in result.message_log if m["role"] == "assistant"]
        assert assistant and all(m["token_ids"].numel() > 0 for m in assistant), "the capture gave token ids"
        history = torch.cat([m["token_ids"] for m in result.message_log])
        with torch.no_grad():
            logits = model(history[None, :-1]).logits[0].float()
        forward = torch.log_softmax(logits, dim=-1).gather(1, history[1:, None])[:, 0]
        end = 0
        for message in result.message_log:
            start, end = end, end + int(message["token_ids"].numel())
            if message["role"] == "assistant":
                expected = forward[start - 1 : end - 1]
                assert torch.allclose(message["generation_logprobs"], expected, atol=1e-5), (start, end)


def test_capture_is_refused_where_gym_has_none_and_for_a_sink():
    if CAPTURES:
        assert capture_block(CAPTURE) == CAPTURE["token_id_capture"]
        with pytest.raises(SettingError, match="token_id_capture.sink is not supported"):
            capture_block({"token_id_capture": {"enabled": True, "sink": "pkg:Sink"}})
        return
    with pytest.raises(SettingError, match=rf"token_id_capture needs nemo-gym >= 0.7 \({installed_gym().label}"):
        capture_block(CAPTURE)
