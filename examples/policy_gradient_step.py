"""Collect a batch with run_multi_turn_rollout on the tiny model, then take one policy-gradient step.

Run with `uv run python examples/policy_gradient_step.py`. Everything is local
and offline. Steps: roll out a number-guessing game for a few prompts (several
samples each), turn rewards into group-baselined advantages, train only on the
generated tokens, and check the policy's logprobs against the sampling ones. A wrong
guess that is a number earns 0.1, so the random model's samples differ in reward.
"""

from __future__ import annotations

import logging

import torch

from gym_bridge import (
    BatchedDataDict,
    HFGeneration,
    HFGenerationConfig,
    HFPolicy,
    HFPolicyConfig,
    batched_message_log_to_flat_message,
    datum_from_chat,
    guessing_env_actor,
    init_ray,
    policy_gradient_loss,
    run_multi_turn_rollout,
)

MAX_SEQ_LEN = 256
SAMPLES_PER_PROMPT = 4
STOPS = ["\n"]
QUESTIONS = [("Guess my number from 1 to 9.", 7), ("Pick a digit.", 3)]


def training_batch(final: BatchedDataDict, pad_id: int) -> BatchedDataDict:
    """Right-padded token batch; ``token_mask`` marks generated tokens; group-baselined advantages."""
    logs = [
        [{"token_ids": m["token_ids"], "token_mask": torch.full_like(m["token_ids"], int(m["role"] == "assistant"))}
         for m in log]
        for log in final["message_log"]
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": pad_id})
    rewards = final["total_reward"].view(-1, SAMPLES_PER_PROMPT)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)
    return BatchedDataDict({
        "input_ids": flat["token_ids"],
        "input_lengths": lengths.to(torch.int64),
        "token_mask": flat["token_mask"].float(),
        "advantages": advantages,
    })


def main() -> None:
    init_ray(num_cpus=2)
    generation = HFGeneration(HFGenerationConfig(model="tiny", max_new_tokens=16, max_model_len=MAX_SEQ_LEN, seed=0))
    tokenizer = generation.tokenizer
    data = [
        datum_from_chat(tokenizer, [{"role": "user", "content": q}], idx=i, task_name="guessing",
                        extra_env_info={"target": target, "low": 1, "high": 9, "guesses_left": 2}, stop_strings=STOPS)
        for i, (q, target) in enumerate(QUESTIONS)
        for _ in range(SAMPLES_PER_PROMPT)
    ]
    batch = BatchedDataDict({k: [d[k] for d in data] for k in ("message_log", "extra_env_info", "task_name",
                                                                "stop_strings")})
    final, metrics = run_multi_turn_rollout(
        generation, batch, tokenizer, {"guessing": guessing_env_actor(stop_strings_per_turn=[STOPS], valid_guess_reward=0.1)},
        max_seq_len=MAX_SEQ_LEN, max_rollout_turns=3,
    )
    print(f"rollout: mean reward {final['total_reward'].mean():.3f}, rewards {final['total_reward'].tolist()}")
    print("rollout metrics: " + ", ".join(f"{k}={v:.3g}" for k, v in metrics.items()))

    train = training_batch(final, tokenizer.pad_token_id)
    policy = HFPolicy(HFPolicyConfig(learning_rate=1e-3), model=generation.model, tokenizer=tokenizer)
    # The training/inference mismatch check: the policy rescoring the sampled tokens.
    logprobs = policy.get_logprobs(train)["logprobs"]
    sampled = [m["generation_logprobs"] for log in final["message_log"] for m in log if m["role"] == "assistant"]
    rescored = [logprobs[i][train["token_mask"][i].bool()] for i in range(len(data))]
    gap = (torch.cat(rescored) - torch.cat(sampled)).abs().max()
    print(f"max |policy logprob - sampling logprob| = {gap:.2e}")

    before = policy.train(train, policy_gradient_loss, eval_mode=True)["loss"]
    step = policy.train(train, policy_gradient_loss, mbs=SAMPLES_PER_PROMPT)
    after = policy.train(train, policy_gradient_loss, eval_mode=True)["loss"]
    print(f"policy-gradient step: loss {step['loss']:.5f} (grad norm {step['grad_norm']:.3g}); "
          f"loss on the same batch before {before:.5f}, after {after:.5f}")
    if bool((train["advantages"] == 0).all()):
        print("every sample in a group got the same reward, so every advantage is 0 and the step changes nothing")
    generation.shutdown()
    policy.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
