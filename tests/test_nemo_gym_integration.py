"""The NeMo-Gym path end to end: RolloutManager(use_nemo_gym=True) -> NemoGym actor -> real Gym
servers -> our real OpenAI-compatible server (the scripted policy, and the random tiny model)."""

from __future__ import annotations

import asyncio
import math

import psutil
import pytest
import ray
import torch

from gym_bridge.data import datum_from_gym_row
from gym_bridge.generation.hf import HFGeneration, HFGenerationConfig
from gym_bridge.gym.spinup import start_nemo_gym_actor
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.serving import OpenAIServer
from tests.gym_fixtures import (
    EQUIVALENCE_AGENT,
    TOOL_AGENT,
    equivalence_row,
    gym_actor_config,
    tool_call_rows,
)

pytestmark = pytest.mark.gym

GEN_CFG = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64, "top_k": None, "stop_strings": None}
SCRIPTED_LOGPROB = math.log(0.5)


def manager(actor, tokenizer, n=3, max_seq_len=4096, generation_config=GEN_CFG):
    return RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"nemo_gym": actor},
        num_generations_per_prompt=n,
        max_seq_len=max_seq_len,
        generation_config=generation_config,
        use_nemo_gym=True,
    )


def flat(log) -> list[int]:
    return torch.cat([m["token_ids"] for m in log]).tolist()


async def test_tool_call_group_is_exact_and_in_order(gym_actor, tiny_tokenizer):
    from gym_bridge.generation.scripted import ScriptedGeneration

    scripted = ScriptedGeneration(tiny_tokenizer)
    record = await manager(gym_actor, tiny_tokenizer).run_rollout(datum_from_gym_row(tool_call_rows()[0], idx=9))
    assert record.prompt_idx == 9 and record.metadata == {"task_name": "nemo_gym"}
    assert len(record.completions) == 3
    assert record.prompt[0]["role"] == "user" and record.prompt[0]["token_ids"].numel() > 0
    for completion in record.completions:
        log = completion.message_log
        assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]  # tool call, then answer
        assert torch.equal(log[0]["token_ids"], record.prompt[0]["token_ids"])
        for i in (1, 3):
            history = flat(log[:i])
            expected = tiny_tokenizer.encode(
                scripted.reply_text(tiny_tokenizer.decode(history)), add_special_tokens=False
            ) + [tiny_tokenizer.eos_token_id]
            assert log[i]["token_ids"].tolist() == expected  # exactly the server's generation
            assert log[i]["token_ids"].dtype == torch.int64
            assert log[i]["generation_logprobs"].dtype == torch.float32
            assert torch.allclose(log[i]["generation_logprobs"], torch.tensor(SCRIPTED_LOGPROB))
        assert completion.reward == float(completion.env_extras["reward"])
        assert not completion.truncated and completion.env_extras.get("token_drift") is None
        items = completion.env_extras["response"]["output"]
        assert [item["type"] for item in items][:2] == ["function_call", "function_call_output"]
        assert all("generation_token_ids" not in item for item in items)  # popped from the logged result
    m = record.rollout_metrics
    assert m["turns_per_sample/mean"] == 2 and m["token_drift_rate"] == 0.0
    assert f"{TOOL_AGENT}/reward/mean" in m
    for key in ("timing/rollout/total", "timing/rollout/run_rollouts", "timing/rollout/await_results"):
        assert key in m


async def test_two_agents_and_several_groups_in_flight(gym_actor, tiny_tokenizer):
    rows = [
        equivalence_row("Reply with exactly: 42", "42"),
        equivalence_row("What is the capital of France?", "Paris"),
        *tool_call_rows()[:2],
    ]
    mgr = manager(gym_actor, tiny_tokenizer, n=2)
    records = await asyncio.gather(*(mgr.run_rollout(datum_from_gym_row(r, idx=i)) for i, r in enumerate(rows)))
    assert [r.prompt_idx for r in records] == [0, 1, 2, 3]
    assert [c.reward for c in records[0].completions] == [1.0, 1.0]  # the scripted policy replies "42"
    assert [c.reward for c in records[1].completions] == [0.0, 0.0]  # a fixed sentence is not "Paris"
    m = records[0].rollout_metrics
    assert m[f"{EQUIVALENCE_AGENT}/reward/mean"] == 1.0 and m["total_reward/mean"] == 1.0
    assert m["turns_per_sample/mean"] == 1
    assert f"{TOOL_AGENT}/reward/mean" in records[2].rollout_metrics
    assert not any(k.startswith(TOOL_AGENT) for k in m)


async def test_truncation_flag(gym_actor, tiny_tokenizer):
    row = equivalence_row("Reply with exactly: 42", "42")
    full = await manager(gym_actor, tiny_tokenizer, n=1).run_rollout(datum_from_gym_row(row, idx=0))
    total = len(flat(full.completions[0].message_log))
    short = await manager(gym_actor, tiny_tokenizer, n=2, max_seq_len=total).run_rollout(datum_from_gym_row(row, idx=0))
    assert all(c.truncated for c in short.completions)
    assert short.rollout_metrics["truncation_rate"] == 1.0 and short.rollout_metrics["natural_termination_rate"] == 0.0


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
