"""Checks of the NeMo-Gym path that any Gym set with the example agents must pass (our tests run them against
Gym's own ``vllm_model`` and against gym-bridge's model server, both in front of the scripted policy).

Each takes a started NemoGym actor (with ``example_single_tool_call`` and ``equivalence_rule``) and the tokenizer
of the scripted policy behind it, and raises ``AssertionError`` naming what differs.
"""

from __future__ import annotations

import asyncio
import math

import torch

from gym_bridge.data import datum_from_gym_row
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.testing.gym_rows import EQUIVALENCE_AGENT, TOOL_AGENT, equivalence_row, tool_call_rows
from gym_bridge.types import ActorHandle, GenerationConfig, LLMMessageLogType, Tokenizer

GEN_CFG: GenerationConfig = {
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 64,
    "top_k": None,
    "stop_strings": None,
}
SCRIPTED_LOGPROB = math.log(0.5)


def manager(
    actor: ActorHandle,
    tokenizer: Tokenizer,
    n: int = 3,
    max_seq_len: int = 4096,
    generation_config: GenerationConfig = GEN_CFG,
) -> RolloutManager:
    return RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"nemo_gym": actor},
        num_generations_per_prompt=n,
        max_seq_len=max_seq_len,
        generation_config=generation_config,
        use_nemo_gym=True,
    )


def flat(log: LLMMessageLogType) -> list[int]:
    return torch.cat([m["token_ids"] for m in log]).tolist()


async def check_tool_call_group_is_exact_and_in_order(gym_actor: ActorHandle, tiny_tokenizer: Tokenizer) -> None:
    """A tool-call group through the scripted policy: exact tokens, logprobs and Gym's items, in generation order."""
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
            reply = tiny_tokenizer.encode(scripted.reply_text(tiny_tokenizer.decode(history)), add_special_tokens=False)
            expected = [*reply, tiny_tokenizer.eos_token_id]
            assert log[i]["token_ids"].tolist() == expected  # exactly the server's generation
            assert log[i]["token_ids"].dtype == torch.int64
            assert log[i]["generation_logprobs"].dtype == torch.float32
            assert torch.allclose(log[i]["generation_logprobs"], torch.tensor(SCRIPTED_LOGPROB))
        extras = completion.env_extras
        assert extras is not None
        assert completion.reward == float(extras["reward"])
        assert not completion.truncated and not completion.token_drift
        items = extras["response"]["output"]
        assert [item["type"] for item in items][:2] == ["function_call", "function_call_output"]
        assert all("generation_token_ids" not in item for item in items)  # popped from the logged result
    m = record.rollout_metrics
    assert m["turns_per_sample/mean"] == 2 and m["token_drift_rate"] == 0.0
    assert f"{TOOL_AGENT}/reward/mean" in m
    for key in ("timing/rollout/total", "timing/rollout/run_rollouts", "timing/rollout/await_results"):
        assert key in m


async def check_two_agents_and_several_groups_in_flight(gym_actor: ActorHandle, tiny_tokenizer: Tokenizer) -> None:
    """Two agents, four groups at once: each group's rewards and per-agent metrics are its own."""
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


async def check_truncation_flag(gym_actor: ActorHandle, tiny_tokenizer: Tokenizer) -> None:
    """A completion whose tokens total ``max_seq_len`` is truncated (NeMo-RL's equality rule)."""
    row = equivalence_row("Reply with exactly: 42", "42")
    full = await manager(gym_actor, tiny_tokenizer, n=1).run_rollout(datum_from_gym_row(row, idx=0))
    total = len(flat(full.completions[0].message_log))
    short = await manager(gym_actor, tiny_tokenizer, n=2, max_seq_len=total).run_rollout(datum_from_gym_row(row, idx=0))
    assert all(c.truncated for c in short.completions)
    assert short.rollout_metrics["truncation_rate"] == 1.0 and short.rollout_metrics["natural_termination_rate"] == 0.0
