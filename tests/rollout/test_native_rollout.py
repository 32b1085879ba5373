"""AsyncRolloutImpl end to end: the real tiny model, real Ray environment actors."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from gym_bridge.data import datum_from_chat
from gym_bridge.environments.arithmetic import arithmetic_env_actor, score_answer
from gym_bridge.failures import EnvironmentUnavailable, RolloutDataFailure, RolloutTimeout
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.rollout.env_step import UnknownTaskError
from gym_bridge.rollout.manager import RolloutManager

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def generation(tiny_model_dir):
    gen = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=16, seed=0))
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def arithmetic_env(ray_session):
    env = arithmetic_env_actor()
    yield env
    ray.kill(env)


# The random tiny model rarely ends a turn by itself; stop strings that almost every token
# contains end each turn after a few tokens, so episodes can run for several turns.
SHORT_TURNS = [" ", "e", "a", "o", "t", "\n"]


def make_datum(tokenizer, idx=0, attempts_left=0, ground_truth="19", stop_strings=None):
    return datum_from_chat(
        tokenizer,
        [{"role": "user", "content": "What is 12 + 7?"}],
        idx=idx,
        task_name="arithmetic",
        extra_env_info={"ground_truth": ground_truth, "attempts_left": attempts_left},
        stop_strings=stop_strings,
    )


def make_manager(generation, env, **kwargs):
    defaults = dict(num_generations_per_prompt=4, max_seq_len=256, max_rollout_turns=1)
    defaults.update(kwargs)
    return RolloutManager(
        tokenizer=generation.tokenizer,
        task_to_env={"arithmetic": env},
        policy_generation=generation,
        **defaults,
    )


def concat_ids(log):
    return torch.cat([m["token_ids"] for m in log])


async def test_single_turn_group(generation, arithmetic_env):
    tokenizer = generation.tokenizer
    datum = make_datum(tokenizer, idx=11)
    record = await make_manager(generation, arithmetic_env).run_rollout(datum)
    assert record.prompt_idx == 11
    assert record.metadata == {"task_name": "arithmetic"}
    assert record.prompt is datum["message_log"]
    assert len(record.completions) == 4
    for completion in record.completions:
        user, assistant, env_msg = completion.message_log
        assert torch.equal(user["token_ids"], datum["message_log"][0]["token_ids"])
        assert assistant["role"] == "assistant"
        assert assistant["token_ids"].dtype == torch.int64 and assistant["token_ids"].numel() > 0
        assert assistant["generation_logprobs"].dtype == torch.float32
        assert assistant["generation_logprobs"].shape == assistant["token_ids"].shape
        assert bool((assistant["generation_logprobs"] <= 0).all())
        assert assistant["content"] == tokenizer.decode(assistant["token_ids"].tolist(), skip_special_tokens=True)
        assert completion.reward == score_answer(assistant["content"], "19")
        assert env_msg["token_ids"].dtype == torch.int64  # empty observation stays int64
    # Every trajectory owns its log: the prompt entry was copied, not shared.
    assert record.completions[0].message_log[0] is not record.completions[1].message_log[0]
    assert len(datum["message_log"]) == 1
    m = record.rollout_metrics
    assert m["total_turns"] == 4 and m["turns_per_sample/mean"] == 1.0
    assert m["max_turns_reached_rate"] == 1.0  # single turn: the loop always runs out
    assert m["total_reward/mean"] == pytest.approx(sum(c.reward for c in record.completions) / 4)
    gen_lengths = [c.message_log[1]["token_ids"].numel() for c in record.completions]
    assert m["gen_tokens_per_sample/mean"] == pytest.approx(sum(gen_lengths) / 4)
    assert m["mean_gen_tokens_per_sample"] == m["gen_tokens_per_sample/mean"]
    assert sorted(m["histogram/gen_tokens_length"]) == sorted(gen_lengths)
    assert 0 < m["timing/rollout/aggregate_metrics"] < m["timing/rollout/total"]
    assert 0 < m["timing/rollout/run_rollouts"] <= m["timing/rollout/total"]


async def test_multi_turn_retries_until_attempts_run_out(generation, arithmetic_env):
    # A ground truth the random model cannot produce makes every answer wrong: 1 + 2 retries = 3 turns.
    datum = make_datum(generation.tokenizer, attempts_left=2, ground_truth="-987654321", stop_strings=SHORT_TURNS)
    record = await make_manager(generation, arithmetic_env, num_generations_per_prompt=2, max_rollout_turns=5,
                                max_seq_len=1024).run_rollout(datum)
    for completion in record.completions:
        roles = [m["role"] for m in completion.message_log]
        assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "environment"]
        assert completion.reward == 0.0 and not completion.truncated
        for reply in completion.message_log[1::2]:
            if reply["role"] == "assistant":
                assert any(stop in reply["content"] for stop in SHORT_TURNS)
        retry = completion.message_log[2]
        assert "is wrong. Try again." in retry["content"]
        assert retry["token_ids"].tolist() == generation.tokenizer(retry["content"], add_special_tokens=False)["input_ids"]
        assert completion.env_extras["attempts_left"] == 0
    m = record.rollout_metrics
    assert m["turns_per_sample/mean"] == 3 and m["total_turns"] == 6
    assert m["natural_termination_rate"] == 1.0 and m["max_turns_reached_rate"] == 0.0
    assert len(m["histogram/input_tokens_length"]) == 6


async def test_max_turns_cuts_the_episode(generation, arithmetic_env):
    datum = make_datum(generation.tokenizer, attempts_left=5, ground_truth="-987654321", stop_strings=SHORT_TURNS)
    record = await make_manager(generation, arithmetic_env, num_generations_per_prompt=2, max_rollout_turns=2,
                                max_seq_len=1024).run_rollout(datum)
    m = record.rollout_metrics
    assert m["turns_per_sample/mean"] == 2
    assert m["max_turns_reached_rate"] == 1.0 and m["natural_termination_rate"] == 0.0


async def test_max_seq_len_truncates_the_observation(generation, arithmetic_env):
    datum = make_datum(generation.tokenizer, attempts_left=5, ground_truth="-987654321")
    prompt_len = datum["length"]
    max_seq_len = prompt_len + 16 + 5  # room for one generation and part of the retry prompt
    record = await make_manager(generation, arithmetic_env, num_generations_per_prompt=2, max_rollout_turns=5,
                                max_seq_len=max_seq_len).run_rollout(datum)
    for completion in record.completions:
        assert completion.truncated
        assert concat_ids(completion.message_log).numel() <= max_seq_len
    assert record.rollout_metrics["truncation_rate"] == 1.0


async def test_unknown_task_name_is_named(generation, arithmetic_env):
    datum = make_datum(generation.tokenizer)
    datum["task_name"] = "chess"
    with pytest.raises(UnknownTaskError, match="task_name='chess'.*known tasks: arithmetic"):
        await make_manager(generation, arithmetic_env).run_rollout(datum)


@ray.remote(max_concurrency=8)
class HangingEnvironment:
    """Every step hangs; with ``fail_first`` the first one raises instead."""

    def __init__(self, fail_first: bool):
        self.fail_first = fail_first
        self.calls = 0

    def step(self, logs, metadata):
        self.calls += 1
        if self.fail_first and self.calls == 1:
            raise RuntimeError("verifier crashed")
        import time

        time.sleep(60)

    def count(self):
        return self.calls


async def test_a_failing_environment_fails_the_group_and_cancels_siblings(generation):
    env = HangingEnvironment.remote(fail_first=True)
    manager = make_manager(generation, env)
    # Only cancellation of the three hanging siblings lets the group fail before they return.
    with pytest.raises(RolloutDataFailure, match="environment step failed for prompt_idx=0 traj_idx=.*verifier crashed"):
        await asyncio.wait_for(manager.run_rollout(make_datum(generation.tokenizer)), timeout=45)
    assert await env.count.remote() >= 1
    ray.kill(env)


async def test_environment_deadline_raises_a_typed_timeout(generation):
    from gym_bridge.failures import RolloutTimeouts

    env = HangingEnvironment.remote(fail_first=False)
    manager = make_manager(generation, env, num_generations_per_prompt=2, timeouts=RolloutTimeouts(env_s=1.0))
    with pytest.raises(RolloutTimeout, match="environment step exceeded 1.0s"):
        await manager.run_rollout(make_datum(generation.tokenizer))
    ray.kill(env)


async def test_a_dead_environment_actor_is_an_infrastructure_failure(generation):
    env = HangingEnvironment.remote(fail_first=False)
    ray.kill(env)
    manager = make_manager(generation, env, num_generations_per_prompt=2)
    with pytest.raises(EnvironmentUnavailable, match="environment unavailable for prompt_idx=0"):
        await asyncio.wait_for(manager.run_rollout(make_datum(generation.tokenizer)), timeout=60)
