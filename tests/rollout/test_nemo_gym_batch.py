"""The batch functions' post-processing of fields our bundled Gym servers never send: ``mask_sample`` and
``reward_components`` (GDPO). A streaming Ray actor stands in for the NemoGym actor and sends converted rows
built by the real schema reader; the whole path over real Gym servers is tests/recipes/test_nemo_rl_dropin.py."""

from __future__ import annotations

import pytest
import ray
import torch

from gym_bridge import GymResultError, run_async_nemo_gym_rollout
from gym_bridge.failures import SettingError
from gym_bridge.gym.protocol.result import GymRowBatch
from gym_bridge.gym.protocol.result_fields import gym_row_result
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.types import GenerationSamplingParams, token_tensor

pytestmark = pytest.mark.usefixtures("ray_session")

GENERATION = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
AGENT = "agent_a"


@ray.remote
class StreamedResults:
    """Streams one converted row per dispatched row, its Gym fields taken from ``fields[_rowidx]``."""

    def __init__(self, fields: list[dict]):
        self.fields = fields

    async def routes(self):
        return GymRoutes(agents=(AGENT,))

    async def run_row_batches(self, rows, timer_prefix):
        converted = []
        for row in rows:
            i = row["_rowidx"]
            user = {"role": "user", "content": "", "token_ids": token_tensor([1, 2, 3])}
            reply = {
                "role": "assistant",
                "content": "",
                "token_ids": token_tensor([7, i]),
                "generation_logprobs": torch.zeros(2),
            }
            converted.append(gym_row_result(i, [user, reply], {"response": {}, **self.fields[i]}))
        yield GymRowBatch(converted, {f"{timer_prefix}/await_results": 0.0})


def batch(n: int) -> dict:
    row = {"responses_create_params": {"input": "hi"}, "agent_ref": {"type": "responses_api_agents", "name": AGENT}}
    return {"extra_env_info": [dict(row) for _ in range(n)], "loss_multiplier": torch.tensor([1.0, 0.5, 1.0])[:n]}


async def collect(fields: list[dict], tokenizer, **kwargs) -> list:
    actor = StreamedResults.remote(fields)
    try:
        stream = run_async_nemo_gym_rollout(
            None, batch(len(fields)), tokenizer, {"nemo_gym": actor}, GENERATION, len(fields), False, **kwargs
        )
        return [r async for r in stream]
    finally:
        ray.kill(actor)


async def test_mask_sample_and_reward_components_reach_the_final_batch(tiny_tokenizer):
    fields = [
        {"reward": 1.5, "reward_components": {"format": 0.5, "answer": 1.0}},
        {"reward": 0.0, "mask_sample": True, "failure_kind": "session_lost", "reward_components": {"format": 0.0}},
        {"reward": 0.25, "instance_config": {"mask_sample": True}},
    ]
    (result,) = await collect(fields, tiny_tokenizer)
    final = result.final_batch
    assert final["mask_sample"].tolist() == [False, True, True]
    assert final["reward/answer"].tolist() == [1.0, 0.0, 0.0]  # a component a sample lacks is 0.0
    assert final["reward/format"].tolist() == [0.5, 0.0, 0.0]
    assert final["total_reward"].tolist() == [1.5, 0.0, 0.25]
    assert final["loss_multiplier"].tolist() == [1.0, 0.5, 1.0]
    assert result.rollout_metrics[f"{AGENT}/failure_kind/session_lost"] == 1.0
    assert result.rollout_metrics["masked_rate"] == pytest.approx(2 / 3)

    (unmasked,) = await collect(fields, tiny_tokenizer, mask_env_flagged_samples=False)
    assert "mask_sample" not in unmasked.final_batch and unmasked.rollout_metrics["masked_rate"] == 0.0


async def test_components_that_do_not_add_up_fail_the_group(tiny_tokenizer):
    fields = [{"reward": 1.0, "reward_components": {"a": 0.25, "b": 0.25}}, {"reward": 0.0}]
    with pytest.raises(GymResultError, match=r"reward=1.0 but its reward_components sum to 0.5"):
        await collect(fields, tiny_tokenizer)


async def test_components_are_checked_before_a_penalty_changes_the_reward(tiny_tokenizer):
    fields = [{"reward": 1.0, "reward_components": {"a": 1.0}}, {"reward": 1.0, "reward_components": {"a": 1.0}}]
    penalties = {"penalize_unwanted_tokens": True, "token_ids": {"unwanted": [7]}}
    (result,) = await collect(fields, tiny_tokenizer, reward_penalty_config=penalties)
    assert result.final_batch["total_reward"].tolist() == [0.0, 0.0]
    assert result.final_batch["reward/a"].tolist() == [1.0, 1.0]
    assert result.rollout_metrics["unwanted_token_rate"] == 1.0


@pytest.mark.parametrize(
    ("rows", "overrides", "message"),
    [
        (2, {"greedy": True}, "greedy is not supported"),
        (2, {"max_rollout_turns": 4}, "max_rollout_turns must be None"),
        (2, {"generation_config": {**GENERATION, "stop_token_ids": [0]}}, "stop_token_ids is not supported"),
        (2, {"sampling_params": GenerationSamplingParams(top_k=5)}, "top_k is not supported"),
        (0, {}, r"batch \(extra_env_info\) is empty"),
        (3, {}, "3 rows, not divisible by num_generations=2"),
        (2, {"loss_multiplier": [1.0]}, "1 loss_multiplier values for 2 NeMo-Gym rows"),
    ],
)
async def test_what_the_gym_path_cannot_take_is_a_setting_error_before_anything_is_sent(
    rows, overrides, message, tiny_tokenizer
):
    overrides = dict(overrides)
    generation = overrides.pop("generation_config", GENERATION)
    input_batch = batch(rows)
    if "loss_multiplier" in overrides:
        input_batch["loss_multiplier"] = overrides.pop("loss_multiplier")
    stream = run_async_nemo_gym_rollout(None, input_batch, tiny_tokenizer, {}, generation, 2, False, **overrides)
    with pytest.raises(SettingError, match=message) as refused:
        await anext(stream)
    assert isinstance(refused.value, ValueError)  # NeMo-RL's callers catch ValueError
