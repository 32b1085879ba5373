"""The NeMo-Gym path end to end: RolloutManager(use_nemo_gym=True) -> NemoGym actor -> real Gym
servers -> our real OpenAI-compatible server (the scripted policy, and the random tiny model)."""

from __future__ import annotations

import psutil
import pytest
import ray
import torch

from gym_bridge.data import datum_from_gym_row
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing.gym_checks import (
    GEN_CFG,
    check_tool_call_group_is_exact_and_in_order,
    check_truncation_flag,
    check_two_agents_and_several_groups_in_flight,
    manager,
)
from gym_bridge.testing.gym_rows import equivalence_row, gym_actor_config

pytestmark = pytest.mark.gym


async def test_tool_call_group_is_exact_and_in_order(gym_actor, tiny_tokenizer):
    await check_tool_call_group_is_exact_and_in_order(gym_actor, tiny_tokenizer)


async def test_two_agents_and_several_groups_in_flight(gym_actor, tiny_tokenizer):
    await check_two_agents_and_several_groups_in_flight(gym_actor, tiny_tokenizer)


async def test_truncation_flag(gym_actor, tiny_tokenizer):
    await check_truncation_flag(gym_actor, tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_gym(ray_session, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """The random tiny model behind our server, and a Gym actor (equivalence agent only) in front of it."""
    generation = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=16, seed=0))
    server = OpenAIServer(generation, tiny_tokenizer, served_model_name="tiny")
    base_url = server.start_in_thread()
    config = gym_actor_config([base_url], tmp_path_factory.mktemp("hf-gym-logs"))
    config = config.model_copy(update={"config_paths": [p for p in config.config_paths if "single_tool_call" not in p]})
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    pids = set(ray.get(actor.server_info.remote())["pids"])
    yield actor, generation, pids
    ray.get(actor.shutdown.remote(), timeout=60)
    ray.kill(actor)
    server.stop_thread()
    generation.shutdown()


@pytest.mark.slow
async def test_random_model_logprobs_equal_a_forward_pass(hf_gym, tiny_tokenizer):
    actor, generation, _ = hf_gym
    row = equivalence_row("What is 12 + 7?", "19")
    record = await manager(actor, tiny_tokenizer, n=2).run_rollout(datum_from_gym_row(row, idx=0))
    for completion in record.completions:
        user, assistant = completion.message_log
        prompt, gen = user["token_ids"].tolist(), assistant["token_ids"].tolist()
        assert 0 < len(gen) <= GEN_CFG["max_new_tokens"]  # max_output_tokens reaches the engine per request
        with torch.no_grad():
            logits = generation.model(torch.tensor([prompt + gen])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(gen)[:, None])
        assert torch.allclose(assistant["generation_logprobs"], expected.squeeze(-1), atol=1e-4)
        assert completion.reward == float(completion.env_extras["reward"]) == 0.0


def test_shutdown_leaves_no_gym_process(hf_gym):
    actor, _, pids = hf_gym
    assert pids and all(psutil.pid_exists(p) for p in pids)
    ray.get(actor.shutdown.remote(), timeout=60)
    ray.get(actor.shutdown.remote(), timeout=60)  # idempotent
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
