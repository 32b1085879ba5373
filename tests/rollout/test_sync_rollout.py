"""run_multi_turn_rollout end to end: the real tiny model, real Ray environment actors."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import ray
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.data import datum_from_chat
from gym_bridge.environments.arithmetic import arithmetic_env_actor
from gym_bridge.environments.guessing import GuessingGameEnvironment, guessing_env_actor
from gym_bridge.failures import RolloutTimeout, RolloutTimeouts
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.rollout.env_step import UnknownTaskError
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.rollout.sync import run_multi_turn_rollout

pytestmark = pytest.mark.usefixtures("ray_session")

# The random tiny model rarely ends a turn by itself; these end a turn after a few tokens.
SHORT_TURNS = [" ", "e", "a", "o", "t", "\n"]
ENV_STOPS = [" ", "e", "a", "o", "t", "\n", "i"]  # differs from SHORT_TURNS so we can tell who set them
MAX_NEW = 8
UNREACHABLE = -987654321  # a target the random model never guesses


@pytest.fixture(scope="module")
def generation(tiny_model_dir):
    gen = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=MAX_NEW, seed=0))
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def envs(ray_session):
    arithmetic, guessing = arithmetic_env_actor(), guessing_env_actor(stop_strings_per_turn=[ENV_STOPS])
    yield {"arithmetic": arithmetic, "guessing": guessing}
    ray.kill(arithmetic)
    ray.kill(guessing)


def datum(tokenizer, idx, task, stop_strings=None):
    if task == "arithmetic":
        info = {"ground_truth": "19", "attempts_left": 0}
        question = "What is 12 + 7?"
    else:
        info = {"target": UNREACHABLE, "low": 1, "high": 100, "guesses_left": 2}
        question = "Guess my number."
    return datum_from_chat(
        tokenizer, [{"role": "user", "content": question}], idx=idx, task_name=task, extra_env_info=info,
        stop_strings=stop_strings,
    )


def to_batch(data, with_stop_strings=True):
    keys = ["message_log", "extra_env_info", "task_name", "idx"] + (["stop_strings"] if with_stop_strings else [])
    return BatchedDataDict({k: [d.get(k) for d in data] for k in keys})


def assistant_msgs(log):
    return [m for m in log if m["role"] == "assistant"]


def test_mixed_batch_order_stops_and_metrics(generation, envs):
    tok = generation.tokenizer
    tasks = ["arithmetic", "guessing", "arithmetic", "guessing"]
    batch = to_batch([datum(tok, i, t) for i, t in enumerate(tasks)], with_stop_strings=False)
    before = copy.deepcopy(batch.get_dict())

    final, metrics = run_multi_turn_rollout(generation, batch, tok, envs, max_seq_len=512, max_rollout_turns=10)

    # The caller's batch is untouched.
    assert [len(log) for log in batch["message_log"]] == [1, 1, 1, 1]
    assert batch["extra_env_info"] == before["extra_env_info"] and "stop_strings" not in batch
    expected_turns = {"arithmetic": 1, "guessing": 3}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for i, task in enumerate(tasks):
        log = final["message_log"][i]
        replies = assistant_msgs(log)
        assert len(replies) == expected_turns[task]
        for m in log:
            assert m["token_ids"].dtype == torch.int64
        obs = [m for m in log[1:] if m["role"] != "assistant"]
        if task == "arithmetic":  # order restored: each sample got its own environment's answer
            assert [o["role"] for o in obs] == ["environment"] and obs[0]["token_ids"].numel() == 0
            assert final["stop_strings"][i] is None
        else:
            assert [o["role"] for o in obs] == ["user", "user", "environment"]
            assert all("Guess between" in o["content"] for o in obs[:2]) and obs[2]["content"] == "Game over."
            assert final["extra_env_info"][i]["guesses_left"] == 0
            # No stop_strings key in the batch, yet the environment's stop strings end turns 2 and 3.
            assert final["stop_strings"][i] == ENV_STOPS
            for reply in replies[1:]:
                assert any(s in reply["content"] for s in ENV_STOPS) or reply["token_ids"].numel() == MAX_NEW
        for reply in replies:
            assert reply["generation_logprobs"].shape == reply["token_ids"].shape
    # Hand-computed expectations.
    assert final["total_reward"].dtype == torch.float32 and final["total_reward"].tolist() == [0.0] * 4
    first_turn_capped = [
        assistant_msgs(log)[0]["token_ids"].numel() == MAX_NEW and int(assistant_msgs(log)[0]["token_ids"][-1]) != eos
        for log in final["message_log"]
    ]
    assert final["truncated"].tolist() == first_turn_capped
    gen = [sum(m["token_ids"].numel() for m in assistant_msgs(log)) for log in final["message_log"]]
    env = [sum(m["token_ids"].numel() for m in log[1:] if m["role"] != "assistant") for log in final["message_log"]]
    total = [sum(m["token_ids"].numel() for m in log) for log in final["message_log"]]
    assert metrics == pytest.approx({
        "total_turns": 8,
        "avg_turns_per_sample": 2.0,
        "max_turns_per_sample": 3,
        "natural_termination_rate": 1.0,
        "truncation_rate": sum(first_turn_capped) / 4,
        "max_turns_reached_rate": 0.0,
        "mean_total_tokens_per_sample": sum(total) / 4,
        "mean_gen_tokens_per_sample": sum(gen) / 4,
        "max_gen_tokens_per_sample": float(max(gen)),
        "mean_env_tokens_per_sample": sum(env) / 4,
    })


def test_truncation_at_max_seq_len_and_max_turns(tiny_model_dir, envs):
    tok_probe = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir)))
    tok = tok_probe.tokenizer
    data = [datum(tok, i, "guessing", stop_strings=SHORT_TURNS) for i in range(2)]
    prompt_len = data[0]["message_log"][0]["token_ids"].numel()
    max_seq_len = prompt_len + 5
    gen = HFGeneration(
        HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=MAX_NEW, max_model_len=max_seq_len),
        model=tok_probe.model, tokenizer=tok,
    )
    final, metrics = run_multi_turn_rollout(gen, to_batch(data), tok, envs, max_seq_len=max_seq_len)
    for log in final["message_log"]:
        assert sum(m["token_ids"].numel() for m in log) == max_seq_len  # the hint was cut to fit exactly
        assert [m["role"] for m in log] == ["user", "assistant", "user"]
    assert final["truncated"].tolist() == [True, True]
    assert metrics["truncation_rate"] == 1.0 and metrics["natural_termination_rate"] == 0.0
    assert metrics["total_turns"] == 2 and metrics["mean_total_tokens_per_sample"] == max_seq_len

    # A turn budget of 1 leaves every guessing sample active: max_turns_reached.
    final, metrics = run_multi_turn_rollout(gen, to_batch(data), tok, envs, max_seq_len=512, max_rollout_turns=1)
    assert metrics["max_turns_reached_rate"] == 1.0 and metrics["total_turns"] == 2
    assert final["extra_env_info"][0]["guesses_left"] == 1  # metadata carried to the next turn
    gen.shutdown()
    tok_probe.shutdown()


def test_unknown_task_names_it(generation, envs):
    batch = to_batch([datum(generation.tokenizer, 0, "arithmetic")])
    batch["task_name"] = ["chess"]
    with pytest.raises(UnknownTaskError, match="chess"):
        run_multi_turn_rollout(generation, batch, generation.tokenizer, envs, max_seq_len=512)


class _SlowEnv(GuessingGameEnvironment):
    def step(self, message_log_batch, metadata):
        time.sleep(5)
        return super().step(message_log_batch, metadata)


def test_env_step_deadline(generation):
    slow = ray.remote(num_cpus=0)(_SlowEnv).remote()
    try:
        batch = to_batch([datum(generation.tokenizer, 0, "guessing", stop_strings=SHORT_TURNS)])
        with pytest.raises(RolloutTimeout, match="environment step"):
            run_multi_turn_rollout(generation, batch, generation.tokenizer, {"guessing": slow}, max_seq_len=512,
                                   timeouts=RolloutTimeouts(env_s=0.5))
    finally:
        ray.kill(slow)


async def test_sync_and_async_paths_give_the_same_greedy_trajectories(generation, envs):
    tok = generation.tokenizer
    guessing = guessing_env_actor(stop_strings_per_turn=[SHORT_TURNS])
    task_to_env = {"guessing": guessing}
    questions = ["Guess my number.", "Pick a number from 1 to 100.", "Your guess?"]
    data = [
        datum_from_chat(tok, [{"role": "user", "content": q}], idx=i, task_name="guessing",
                        extra_env_info={"target": UNREACHABLE, "guesses_left": 2}, stop_strings=SHORT_TURNS)
        for i, q in enumerate(questions)
    ]
    manager = RolloutManager(tokenizer=tok, task_to_env=task_to_env, policy_generation=generation,
                             num_generations_per_prompt=2, max_seq_len=512, max_rollout_turns=5, greedy=True)
    records = [await manager.run_rollout(d) for d in data]
    final, metrics = await asyncio.to_thread(
        run_multi_turn_rollout, generation, to_batch(data), tok, task_to_env, 512, 5, True
    )
    ray.kill(guessing)
    assert not final["truncated"].any()  # precondition: the paths differ only on truncation
    for i, record in enumerate(records):
        sync_log = final["message_log"][i]
        for completion in record.completions:
            assert [m["role"] for m in completion.message_log] == [m["role"] for m in sync_log]
            for a, b in zip(completion.message_log, sync_log, strict=True):
                assert torch.equal(a["token_ids"], b["token_ids"]) and a["content"] == b["content"]
                if "generation_logprobs" in a:
                    torch.testing.assert_close(a["generation_logprobs"], b["generation_logprobs"], atol=1e-4, rtol=0)
        assert record.rollout_metrics["turns_per_sample/mean"] == 3
    assert metrics["avg_turns_per_sample"] == 3
