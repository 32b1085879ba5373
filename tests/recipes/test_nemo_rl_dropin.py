"""NeMo-RL HEAD's Gym call sites, written as NeMo-RL writes them, against gym_bridge's imports and real Gym servers.

Each test copies the shape of one call in NeMo-RL 7ea279a: ``algorithms/grpo.py`` (training
rollouts and validation through ``run_nemo_gym_rollout_sync``), ``async_utils/trajectory_collector.py``
(``run_async_nemo_gym_rollout`` with ``_ng_task_index``) and the single controller's
``RolloutManager.generate_and_push`` into a replay buffer. Only the imports differ.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest
import torch

from gym_bridge import (
    BatchedDataDict,
    GenerationSamplingParams,
    InMemoryReplayBuffer,
    InvalidGymRow,
    NemoGymRolloutResult,
    RolloutManager,
    RolloutOutcome,
    RolloutRetryPolicy,
    get_nemo_gym_thinking_tags,
    run_async_nemo_gym_rollout,
    run_nemo_gym_rollout_sync,
    should_log_nemo_gym_full_result_tables,
    should_mask_flagged_samples,
)
from gym_bridge.data import datum_from_gym_row
from gym_bridge.testing import async_wait_until
from gym_bridge.testing.gym_rows import EQUIVALENCE_AGENT, TOOL_AGENT, equivalence_row, tool_call_rows

pytestmark = pytest.mark.gym

SCRIPTED_LOGPROB = math.log(0.5)
MAX_SEQ_LEN = 4096
# policy.generation as NeMo-RL's Gym examples set it (stop criteria cleared by setup_nemo_gym_config).
GENERATION = {
    "backend": "vllm",
    "max_new_tokens": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "val_temperature": 0.0,
    "val_top_p": 0.5,
    "val_top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
}
ENV = {"should_use_nemo_gym": True, "should_mask_flagged_samples": True, "nemo_gym": {"thinking_tags": None}}
LOGGER = {"wandb_enabled": True, "wandb": {"log_nemo_gym_full_result_tables": True}}


def repeated_batch(rows: list[dict], num_generations: int) -> BatchedDataDict:
    """NeMo-RL's ``repeated_batch``: each prompt's datum repeated ``num_generations`` times, in prompt order."""
    repeated = [copy.deepcopy(row) for row in rows for _ in range(num_generations)]
    return BatchedDataDict(
        {
            "extra_env_info": repeated,
            "loss_multiplier": torch.ones(len(repeated)),
            "idx": [i // num_generations for i in range(len(repeated))],
            "task_name": ["nemo_gym"] * len(repeated),
        }
    )


def grpo_sync_rollout(policy, batch, tokenizer, actor, **overrides) -> NemoGymRolloutResult:
    """``grpo.py``'s training call, keyword for keyword."""
    generation_config = {**GENERATION, "stop_token_ids": None, "stop_strings": None}
    kwargs = dict(
        policy_generation=policy,
        input_batch=batch,
        tokenizer=tokenizer,
        task_to_env={"nemo_gym": actor},
        max_seq_len=MAX_SEQ_LEN,
        generation_config=generation_config,
        log_full_result_tables=should_log_nemo_gym_full_result_tables(
            wandb_enabled=LOGGER["wandb_enabled"], wandb_config=LOGGER["wandb"]
        ),
        max_rollout_turns=None,
        greedy=False,
        effort_config=None,
        reward_penalty_config=None,
        thinking_tags=get_nemo_gym_thinking_tags(ENV),
        mask_env_flagged_samples=should_mask_flagged_samples(ENV),
        deduplicate_multimodal_data=False,
        debug_payload_metrics=False,
    )
    return run_nemo_gym_rollout_sync(**{**kwargs, **overrides})


def full_results(metrics: dict, agent: str) -> list[dict]:
    return [json.loads(row[0]) for row in metrics[f"{agent}/full_result"].data]


def test_grpo_training_call_returns_the_batch_in_input_order(scripted_policy, gym_actor, tiny_tokenizer):
    rows = [equivalence_row("Reply with exactly: 42", "42"), tool_call_rows()[0]]
    batch = repeated_batch(rows, 2)
    before = copy.deepcopy(batch["extra_env_info"])
    result = grpo_sync_rollout(scripted_policy, batch, tiny_tokenizer, gym_actor)

    assert isinstance(result, NemoGymRolloutResult) and result.task_index is None
    final = result.final_batch
    assert set(final) == {"agent_ref", "message_log", "length", "loss_multiplier", "total_reward", "truncated"} | {
        "mask_sample"
    }
    assert [ref["name"] for ref in final["agent_ref"]] == [EQUIVALENCE_AGENT] * 2 + [TOOL_AGENT] * 2
    assert [[m["role"] for m in log] for log in final["message_log"]] == [["user", "assistant"]] * 2 + [
        ["user", "assistant", "user", "assistant"]
    ] * 2
    for log in final["message_log"]:
        for message in log[1::2]:
            assert torch.allclose(message["generation_logprobs"], torch.tensor(SCRIPTED_LOGPROB))
    assert final["total_reward"].tolist()[:2] == [1.0, 1.0]  # the scripted policy answers "42"
    assert final["truncated"].tolist() == [False] * 4 and final["mask_sample"].tolist() == [False] * 4
    assert torch.equal(final["loss_multiplier"], torch.ones(4))
    for i, log in enumerate(final["message_log"]):
        prompt = log[0]["token_ids"]
        assert int(final["length"][i]) == prompt.numel()
        assert torch.equal(result.input_ids[i, : prompt.numel()], prompt)
    assert result.input_ids.shape == (4, int(final["length"].max()))

    metrics = result.rollout_metrics
    assert metrics["total_reward/mean"] == pytest.approx(float(final["total_reward"].mean()))
    assert metrics["turns_per_sample/mean"] == 1.5
    assert metrics[f"{EQUIVALENCE_AGENT}/reward/mean"] == 1.0
    tool_rewards = [r["reward"] for r in full_results(metrics, TOOL_AGENT)]
    assert metrics[f"{TOOL_AGENT}/reward/mean"] == pytest.approx(sum(tool_rewards) / 2)
    assert final["total_reward"].tolist()[2:] == pytest.approx(tool_rewards)
    assert metrics["mean_gen_tokens_per_sample"] == metrics["gen_tokens_per_sample/mean"]
    assert {"timing/rollout/total", "timing/rollout/run_rollouts", "timing/rollout/await_results"} <= set(metrics)
    assert batch["extra_env_info"] == before  # the caller's rows are not stamped


def test_validation_call_sends_the_validation_profile(scripted_policy, gym_actor, tiny_tokenizer):
    batch = repeated_batch([equivalence_row("Reply with exactly: 7", "7")], 2)
    val_sampling_params = GenerationSamplingParams(
        temperature=GENERATION["val_temperature"], top_p=GENERATION["val_top_p"], top_k=GENERATION["val_top_k"]
    )
    result = grpo_sync_rollout(scripted_policy, batch, tiny_tokenizer, gym_actor, sampling_params=val_sampling_params)
    sent = [r["responses_create_params"] for r in full_results(result.rollout_metrics, EQUIVALENCE_AGENT)]
    assert [(p["temperature"], p["top_p"]) for p in sent] == [(0.0, 0.5)] * 2
    assert all(p["max_output_tokens"] == 64 for p in sent)  # min(row's 64, max_new_tokens 64)
    assert result.final_batch["total_reward"].tolist() == [1.0, 1.0]


async def test_trajectory_collector_streams_groups_by_task_index(scripted_policy, gym_actor, tiny_tokenizer):
    rows = [equivalence_row("Reply with exactly: 5", "5"), equivalence_row("What is 2 + 2?", "4"), tool_call_rows()[1]]
    for task_index, row in enumerate(rows):
        row["_ng_task_index"] = 10 + task_index
    batch = repeated_batch(rows, 3)
    results = []
    async for rollout_result in run_async_nemo_gym_rollout(
        policy_generation=scripted_policy,
        input_batch=batch,
        tokenizer=tiny_tokenizer,
        task_to_env={"nemo_gym": gym_actor},
        max_seq_len=MAX_SEQ_LEN,
        generation_config={**GENERATION, "stop_token_ids": None, "stop_strings": None},
        num_generations=3,
        log_full_result_tables=False,
        max_rollout_turns=None,
        greedy=False,
        reward_penalty_config=None,
        thinking_tags=get_nemo_gym_thinking_tags(ENV),
        mask_env_flagged_samples=should_mask_flagged_samples(ENV),
        deduplicate_multimodal_data=False,
        debug_payload_metrics=False,
    ):
        results.append(rollout_result)
    assert sorted(r.task_index for r in results) == [10, 11, 12]
    for r in results:
        assert r.final_batch.size == 3 and r.input_ids.shape[0] == 3
        expected_agent = TOOL_AGENT if r.task_index == 12 else EQUIVALENCE_AGENT
        assert {ref["name"] for ref in r.final_batch["agent_ref"]} == {expected_agent}
        assert not any(key.endswith("/full_result") for key in r.rollout_metrics)
    by_task = {r.task_index: r for r in results}
    assert by_task[10].final_batch["total_reward"].tolist() == [1.0] * 3
    assert by_task[11].final_batch["total_reward"].tolist() == [0.0] * 3
    assert "timing/rollout/total" in results[-1].rollout_metrics
    assert not any("timing/rollout/total" in r.rollout_metrics for r in results[:-1])


async def test_batch_path_and_manager_path_give_the_same_rollouts(scripted_policy, gym_actor, tiny_tokenizer):
    rows = [equivalence_row("Reply with exactly: 9", "9"), tool_call_rows()[2]]
    batch = [r async for r in run_async_nemo_gym_rollout(
        scripted_policy, repeated_batch(rows, 2), tiny_tokenizer, {"nemo_gym": gym_actor}, GENERATION, 2, False
    )]
    manager = RolloutManager(
        tiny_tokenizer, {"nemo_gym": gym_actor}, 2, MAX_SEQ_LEN, generation_config=GENERATION, use_nemo_gym=True
    )
    records = [await manager.run_rollout(datum_from_gym_row(row, idx=i)) for i, row in enumerate(rows)]
    by_agent = {r.final_batch["agent_ref"][0]["name"]: r for r in batch}
    for record in records:
        agent = record.extra_env_info["agent_ref"]["name"]
        group = by_agent[agent]
        assert group.final_batch["total_reward"].tolist() == [c.reward for c in record.completions]
        for log, completion in zip(group.final_batch["message_log"], record.completions, strict=True):
            assert [m["token_ids"].tolist() for m in log] == [m["token_ids"].tolist() for m in completion.message_log]
        for key in ("total_reward/mean", "gen_tokens_per_sample/mean", "turns_per_sample/mean", f"{agent}/reward/mean"):
            assert group.rollout_metrics[key] == record.rollout_metrics[key], key


def test_reward_penalties_act_on_the_gym_rewards(scripted_policy, gym_actor, tiny_tokenizer):
    batch = repeated_batch([equivalence_row("Reply with exactly: 42", "42")], 2)
    penalties = {"penalize_unwanted_tokens": True, "token_ids": {"unwanted": [tiny_tokenizer.eos_token_id]}}
    result = grpo_sync_rollout(scripted_policy, batch, tiny_tokenizer, gym_actor, reward_penalty_config=penalties)
    assert result.final_batch["total_reward"].tolist() == [0.0, 0.0]  # 1.0 before: every reply ends with EOS
    assert result.rollout_metrics["unwanted_token_rate"] == 1.0
    assert result.rollout_metrics[f"{EQUIVALENCE_AGENT}/reward/mean"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"greedy": True}, "greedy"),
        ({"max_rollout_turns": 4}, "max_rollout_turns"),
        ({"generation_config": {**GENERATION, "stop_strings": ["\n"]}}, "stop_strings"),
        ({"sampling_params": GenerationSamplingParams(top_k=5)}, "top_k"),
    ],
)
def test_options_the_gym_path_cannot_honour_are_refused(
    overrides, message, scripted_policy, gym_actor, tiny_tokenizer
):
    batch = repeated_batch([equivalence_row("Reply with exactly: 1", "1")], 2)
    with pytest.raises(ValueError, match=message):
        grpo_sync_rollout(scripted_policy, batch, tiny_tokenizer, gym_actor, **overrides)


async def test_bad_batches_are_refused_before_anything_is_sent(scripted_policy, gym_actor, tiny_tokenizer):
    def stream(batch, n):
        return run_async_nemo_gym_rollout(
            scripted_policy, batch, tiny_tokenizer, {"nemo_gym": gym_actor}, GENERATION, n, False
        )

    mixed = repeated_batch([equivalence_row("Reply with exactly: 1", "1"), tool_call_rows()[0]], 1)
    with pytest.raises(ValueError, match=r"prompt group 0 .* mixes NeMo-Gym agents"):
        await anext(stream(mixed, 2))
    with pytest.raises(ValueError, match="not divisible by num_generations=2"):
        await anext(stream(repeated_batch([equivalence_row("a", "a")], 3), 2))
    broken = repeated_batch([equivalence_row("a", "a"), {"responses_create_params": {"input": "b"}}], 2)
    with pytest.raises(InvalidGymRow, match="prompt_idx=1: invalid Gym row: agent_ref"):
        await anext(stream(broken, 2))


async def test_generate_and_push_commits_each_group_to_the_replay_buffer(gym_actor, tiny_tokenizer):
    buffer = InMemoryReplayBuffer()
    manager = RolloutManager(
        tokenizer=tiny_tokenizer,
        task_to_env={"nemo_gym": gym_actor},
        num_generations_per_prompt=2,
        max_seq_len=MAX_SEQ_LEN,
        generation_config=GENERATION,
        use_nemo_gym=True,
        tq_buffer=buffer,
        retry_policy=RolloutRetryPolicy(
            max_infra_attempts=2, max_data_attempts=1, max_gym_row_attempts=2, max_skipped_prompts=1
        ),
    )
    manager.set_weight_version(3)
    registry: dict = {}
    task = asyncio.ensure_future(
        manager.generate_and_push(
            datum_from_gym_row(equivalence_row("Reply with exactly: 3", "3"), idx=0),
            target_step=5,
            inflight_registry=registry,
        )
    )
    (slot_task, version), *_ = (await async_wait_until(lambda: list(registry.values()), 60, "the attempt registers"))
    assert slot_task is task and version == 3
    manager.set_weight_version(4)  # a refit lands while the group is in flight
    outcome = await task
    assert outcome == "committed" and outcome is RolloutOutcome.COMMITTED and registry == {}
    (slot,) = buffer.ready(target_step=5)
    assert (slot.start_weight_version, slot.end_weight_version) == (3, 4)
    assert [c.reward for c in slot.record.completions] == [1.0, 1.0]

    bad = datum_from_gym_row({"responses_create_params": {"input": "x"}}, idx=1)
    assert await manager.generate_and_push(bad, target_step=5) == "skipped"
    assert len(buffer.slots) == 1 and manager.stats.skipped == 1  # the failed attempt's slot is removed
