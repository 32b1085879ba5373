"""A resources server's integration test written against gym-bridge's pytest plugin only:
rows go through RolloutManager(use_nemo_gym=True) -> the NemoGym actor -> real Gym servers -> our
OpenAI-compatible endpoint, and come back as token-level completions with the environment's rewards."""

import torch

from gym_bridge import datum_from_gym_row

AGENT = {"type": "responses_api_agents", "name": "lc_equivalence_rule_simple_agent"}


def row(question: str, expected_answer: str) -> dict:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}], "max_output_tokens": 64},
        "expected_answer": expected_answer,
        "agent_ref": AGENT,
    }


async def test_the_right_answer_is_rewarded_and_a_wrong_one_is_not(gym_rollout_manager):
    right = await gym_rollout_manager.run_rollout(datum_from_gym_row(row("Reply with exactly: 42", "42"), idx=0))
    wrong = await gym_rollout_manager.run_rollout(datum_from_gym_row(row("What is the capital of France?", "Paris"), idx=1))
    assert [c.reward for c in right.completions] == [1.0, 1.0]  # num_generations_per_prompt=2
    assert [c.reward for c in wrong.completions] == [0.0, 0.0]
    assert right.rollout_metrics["lc_equivalence_rule_simple_agent/reward/mean"] == 1.0


async def test_completions_carry_the_policy_tokens_and_logprobs(gym_rollout_manager, gym_tokenizer):
    record = await gym_rollout_manager.run_rollout(datum_from_gym_row(row("Reply with exactly: 7", "7"), idx=0))
    for completion in record.completions:
        user, assistant = completion.message_log
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert gym_tokenizer.decode(assistant["token_ids"], skip_special_tokens=True).strip() == "7"
        assert assistant["generation_logprobs"].shape == assistant["token_ids"].shape
        assert torch.all(assistant["generation_logprobs"] <= 0) and not completion.truncated
