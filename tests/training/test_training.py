"""Training components: GRPO advantages, the batch, the loss on generated tokens, on-policy error, staleness."""

from __future__ import annotations

import math

import pytest
import torch

from gym_bridge.models.fingerprint import fingerprint_mismatches, weight_fingerprint
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.stats import mcnemar_exact
from gym_bridge.training import (
    AdvantageSettings,
    ClippedPGLoss,
    PromptQueue,
    RewardShaper,
    StalenessBuffer,
    baseline_and_std_per_group,
    clip_advantages,
    grpo_advantages,
    message_level_advantages,
    on_policy_error,
    seq_logprob_error_mask,
    sum_on_policy_errors,
    train_batch,
)
from gym_bridge.types import Completion, PromptGroupRecord


def test_leave_one_out_advantages_match_nemo_rl_by_hand():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # Sample 0: the others are all 0, so baseline 0 and std 0: not rescaled.
    assert adv[0, 0].item() == pytest.approx(1.0)
    # The others: baseline 1/3, Bessel-corrected std of {1, 0, 0} = sqrt(1/3).
    assert adv[0, 1:].tolist() == pytest.approx([-(1 / 3) / (math.sqrt(1 / 3) + 1e-6)] * 3, rel=1e-6)


def test_zero_std_groups_get_zero_advantage_and_no_division():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]))
    assert torch.equal(adv, torch.zeros(3, 3))
    assert torch.equal(grpo_advantages(torch.tensor([[0.7]])), torch.zeros(1, 1)), "a group of one has no baseline"


def test_plain_mean_baseline_and_unnormalised_option():
    rewards = torch.tensor([[1.0, 0.0], [0.2, 0.6]])
    baseline, std = baseline_and_std_per_group(rewards, leave_one_out=False)
    assert baseline.flatten().tolist() == pytest.approx([0.5, 0.5, 0.4, 0.4])
    assert std[0].tolist() == pytest.approx([math.sqrt(0.5)] * 2)
    adv = grpo_advantages(rewards, leave_one_out=False)
    assert adv[0].tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rel=1e-5)
    raw = grpo_advantages(rewards, leave_one_out=False, normalize=False)
    assert raw[1].tolist() == pytest.approx([-0.2, 0.2])
    with pytest.raises(ValueError, match="groups, samples_per_group"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


def completion(prompt, reply, logprobs, reward, truncated=False):
    log = [
        {"role": "user", "content": "", "token_ids": torch.tensor(prompt, dtype=torch.int64)},
        {"role": "assistant", "content": "", "token_ids": torch.tensor(reply, dtype=torch.int64),
         "generation_logprobs": torch.tensor(logprobs, dtype=torch.float32)},
    ]
    return Completion(log, None, truncated, reward)


def group(idx, completions, start=0, end=0):
    return CommittedGroup(PromptGroupRecord(idx, [], None, {}, completions, {}), start, end)


def test_batch_trains_only_generated_tokens_with_their_sampling_logprobs():
    groups = [group(0, [completion([5, 6, 7], [8, 9], [-0.5, -0.25], 1.0),
                        completion([5, 6, 7], [10], [-2.0], 0.0, truncated=True)])]
    batch, stats = train_batch(groups, pad_token_id=0, settings=AdvantageSettings(leave_one_out=False))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    assert batch["input_lengths"].tolist() == [5, 4]
    assert batch["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert batch["generation_logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, 0, -2.0, 0]]
    assert batch["advantages"][:, 0].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    assert batch["advantages"].shape == (2, 5) and batch["sample_mask"].tolist() == [1.0, 1.0]
    assert (stats.mean_reward, stats.pass_rate, stats.truncation_rate) == (0.5, 0.5, 0.5)
    assert stats.mean_generated_tokens == 1.5 and stats.zero_std_groups == 0
    bad = [group(1, [completion([1], [2, 3], [-1.0], 1.0)] * 2)]
    with pytest.raises(ValueError, match="prompt_idx=1 completion 0 message 1: 2 token_ids but 1 logprobs"):
        train_batch(bad, pad_token_id=0)


def test_on_policy_error_reports_mean_max_and_gen_kl():
    gen = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    train = torch.tensor([[0.0, -1.1, -2.0], [0.0, -0.3, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    err = on_policy_error(train, gen, mask)
    assert err.tokens == 3 and err.abs_diff_max == pytest.approx(0.2)
    assert err.mean_abs_diff == pytest.approx(0.3 / 3)
    k3 = [math.exp(r) - 1 - r for r in (-0.1, 0.0, 0.2)]
    assert err.gen_kl_error == pytest.approx(sum(k3) / 3)
    assert on_policy_error(gen, gen, mask).as_metrics()["on_policy/gen_kl_error"] == 0.0


def test_staleness_drops_and_counts_groups_older_than_the_bound():
    buffer = StalenessBuffer(max_trajectory_age_steps=1)
    fresh, one_old, two_old, refit_mid = group(0, [], 5, 5), group(1, [], 4, 5), group(2, [], 3, 4), group(3, [], 4, 5)
    buffer.add([fresh, one_old, two_old, refit_mid])
    usable, dropped = buffer.take(current_weight_version=5)
    assert usable == [fresh, one_old, refit_mid] and dropped == [two_old] and buffer.dropped_total == 1
    assert buffer.take(5) == ([], []), "dropped groups are gone, never used later"
    strict = StalenessBuffer(max_trajectory_age_steps=0)
    strict.add([fresh, one_old])
    assert strict.take(5) == ([fresh], [one_old])
    strict.add([group(9, [], 6, 6)])
    with pytest.raises(ValueError, match="prompt_idx=9 claims weight version 6"):
        strict.take(5)


def test_fingerprint_sees_a_tiny_update_and_compares_across_dtypes():
    weights = {"w": torch.randn(300, 70), "b": torch.randn(70)}
    engine_side = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    assert fingerprint_mismatches(weight_fingerprint(weights), weight_fingerprint(engine_side)) == []
    weights["w"] += 1e-7 * weights["w"].sign()  # an update far below any logprob threshold
    assert fingerprint_mismatches(weight_fingerprint(weights), weight_fingerprint({**weights})) == []
    stale_fp32 = {"w": weights["w"] - 1e-7 * weights["w"].sign(), "b": weights["b"]}
    assert fingerprint_mismatches(weight_fingerprint(weights), weight_fingerprint(stale_fp32)) == ["w"]
    assert fingerprint_mismatches(weight_fingerprint(weights), weight_fingerprint({"w": weights["w"]})) == ["b"]


def test_prompt_queue_shuffles_per_epoch_with_the_seed_and_redraws_requeued_prompts_first():
    data = [{"n": i} for i in range(6)]
    first = [p["n"] for p in PromptQueue(data, seed=3).draw(12)]
    assert first == [p["n"] for p in PromptQueue(data, seed=3).draw(12)], "the seed fixes the order"
    assert sorted(first[:6]) == sorted(first[6:]) == list(range(6)) and first[:6] != first[6:]
    assert [p["n"] for p in PromptQueue(data, seed=0, shuffle=False).draw(7)] == [0, 1, 2, 3, 4, 5, 0]
    queue = PromptQueue(data, seed=3)
    drawn = queue.draw(3)
    assert [p["idx"] for p in drawn] == [0, 1, 2]
    queue.settle(0)
    assert queue.requeue([1, 0, 99]) == 1, "only prompts in flight come back"
    again = queue.draw(2)
    assert again[0]["n"] == drawn[1]["n"] and again[0]["idx"] == 3, "a redrawn prompt gets a fresh idx"
    state = queue.checkpoint_state()
    assert sorted(state.requeued) == sorted(p["n"] for p in [drawn[2], *again]) and state.next_idx == 5


def test_mcnemar_exact_counts_discordant_pairs_and_matches_scipys_binomial_test():
    from scipy.stats import binomtest

    before = [False] * 20 + [True] * 10 + [False] * 5 + [True] * 3
    after = [True] * 20 + [True] * 10 + [False] * 5 + [False] * 3
    result = mcnemar_exact(before, after)
    assert (result.n, result.wrong_to_right, result.right_to_wrong) == (38, 20, 3)
    assert result.p_value == pytest.approx(binomtest(3, 23, 0.5).pvalue, rel=1e-12)
    assert mcnemar_exact([True, False], [True, False]).p_value == 1.0, "no discordant pair: no evidence"
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar_exact([True], [True, False])


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from gym_bridge.policy import HFPolicy, HFPolicyConfig

    return HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False,
                                   freeze_embeddings=True))


def test_training_raises_logprobs_of_rewarded_tokens_and_leaves_the_prompt_alone(tiny_policy):
    policy = tiny_policy
    prompt, good, bad = [11, 12, 13, 14], [40, 41, 42], [50, 51, 52]
    probe = train_batch([group(0, [completion(prompt, good, [0.0] * 3, 1.0),
                                   completion(prompt, bad, [0.0] * 3, 0.0)])], pad_token_id=0)[0]
    before = policy.get_logprobs(probe)["logprobs"]
    probe["generation_logprobs"], probe["prev_logprobs"] = before.clone(), before.clone()
    embedding = policy.model.get_input_embeddings().weight.detach().clone()
    result = policy.train(probe, ClippedPGLoss(), mbs=1)
    after = policy.get_logprobs(probe)["logprobs"]
    gen = slice(len(prompt), len(prompt) + 3)
    assert after[0, gen].sum() > before[0, gen].sum() + 1e-3, "the rewarded reply became more likely"
    assert after[1, gen].sum() < before[1, gen].sum() - 1e-3, "the unrewarded reply became less likely"
    assert torch.equal(policy.model.get_input_embeddings().weight, embedding), "freeze_embeddings held"
    error = sum_on_policy_errors(result["all_mb_metrics"])
    assert error.tokens == 6 and error.abs_diff_max == 0.0, "on_policy compares prev with the sampling logprobs"


def test_pairs_with_leave_one_out_are_not_rescaled():
    assert grpo_advantages(torch.tensor([[1.0, 0.25]])).tolist() == [[0.75, -0.75]]


def test_masked_samples_leave_the_baseline_and_the_loss():
    """A sample the environment masked (Gym's mask_sample) moves no sibling's advantage and gets none itself."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True, False]])
    masked = grpo_advantages(rewards, valid=valid)
    three = grpo_advantages(rewards[:, :3])
    assert torch.allclose(masked[:, :3], three) and masked[0, 3] == 0
    baseline, std = baseline_and_std_per_group(rewards, valid=valid)
    assert torch.allclose(baseline[:, :3], baseline_and_std_per_group(rewards[:, :3])[0])
    assert torch.equal(grpo_advantages(rewards, valid=torch.zeros(1, 4, dtype=torch.bool)), torch.zeros(1, 4))


def test_masked_samples_in_baseline_is_nemo_rls_behaviour_one_setting_away():
    """Default: a masked sample is out of its group's baseline. ``masked_samples_in_baseline`` (NeMo-RL's
    behaviour) counts it there; either way it never trains."""
    rewards = [1.0, 0.0, 0.0, 1.0]
    done = [completion([1, 2], [3 + i], [-0.5], reward) for i, reward in enumerate(rewards)]
    done[3].masked = True
    groups = [group(0, done)]
    ours, _ = train_batch(groups, 0)
    nemo_rl, _ = train_batch(groups, 0, settings=AdvantageSettings(masked_in_baseline=True))
    assert torch.allclose(ours["advantages"][:3, -1], grpo_advantages(torch.tensor([rewards[:3]]))[0])
    assert torch.allclose(nemo_rl["advantages"][:3, -1], grpo_advantages(torch.tensor([rewards]))[0, :3])
    assert not torch.allclose(ours["advantages"][:3, -1], nemo_rl["advantages"][:3, -1])
    assert ours["sample_mask"].tolist() == nemo_rl["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]


def flagged(prompt, reply, reward, *, invalid=False, malformed=False, truncated=False, env_extras=None):
    done = completion(prompt, reply, [-0.5] * len(reply), reward, truncated=truncated)
    done.message_log[1].update(is_invalid_tool_call=invalid, has_malformed_thinking=malformed)
    done.env_extras = env_extras
    return done


def test_message_level_penalties_overwrite_flagged_turns_then_the_clip_bounds_everything():
    logs = [
        [{"role": "user", "token_ids": [1, 2]}, {"role": "assistant", "token_ids": [3, 4], "generation_logprobs": [0, 0],
          "is_invalid_tool_call": True, "has_malformed_thinking": True},
         {"role": "user", "token_ids": [5]}, {"role": "assistant", "token_ids": [6], "generation_logprobs": [0],
                                              "has_malformed_thinking": True}],
        [{"role": "user", "token_ids": [1, 2]}, {"role": "assistant", "token_ids": [7, 8, 9], "generation_logprobs": [0] * 3,
                                                 "is_invalid_tool_call": True}],
    ]
    advantages = torch.tensor([[0.5] * 6, [-0.5] * 6])
    out, metrics = message_level_advantages(advantages, logs, invalid_tool_call_advantage=-5.0,
                                            malformed_thinking_advantage=-3.0)
    # An invalid tool call wins over malformed thinking in the same turn; prompts and padding keep theirs.
    assert out.tolist() == [[0.5, 0.5, -5.0, -5.0, 0.5, -3.0], [-0.5, -0.5, -5.0, -5.0, -5.0, -0.5]]
    assert advantages[0, 2] == 0.5, "the caller's tensor is not written"
    assert metrics == {"invalid_tool_call_rate": 2 / 3, "malformed_thinking_rate": 1 / 3, "num_invalid_tool_calls": 2.0,
                       "num_malformed_thinking": 1.0, "num_assistant_messages": 3.0}
    only_thinking, _ = message_level_advantages(advantages, logs, malformed_thinking_advantage=-3.0)
    assert only_thinking[0].tolist() == [0.5, 0.5, -3.0, -3.0, 0.5, -3.0] and only_thinking[1].eq(-0.5).all()
    assert message_level_advantages(advantages, logs) == (advantages, {})
    assert clip_advantages(out, -2.0, 0.25).tolist() == [[0.25, 0.25, -2.0, -2.0, 0.25, -2.0],
                                                         [-0.5, -0.5, -2.0, -2.0, -2.0, -0.5]]
    assert torch.equal(clip_advantages(out), out)


def test_the_batch_applies_penalties_clip_and_overlong_filtering_per_token_and_per_sample():
    groups = [group(0, [flagged([1], [2, 3], 1.0, invalid=True), flagged([1], [4, 5], 0.0),
                        flagged([1], [6, 7], 1.0, truncated=True), flagged([1], [8, 9], 0.0)])]
    settings = AdvantageSettings(leave_one_out=False, overlong_filtering=True, invalid_tool_call_advantage=-5.0,
                                 advantage_clip_low=-2.0)
    batch, stats = train_batch(groups, pad_token_id=0, settings=settings)
    # rewards 1, 0, 1, 0: mean 0.5, std 0.5774 (Bessel) -> +-0.866; the truncated sample stays in the baseline.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([[-2.0, -2.0], [-a, -a], [a, a], [-a, -a]])
    torch.testing.assert_close(batch["advantages"][:, 1:], expected)
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert stats.overlong_filtered == 1 and stats.advantage_metrics["num_invalid_tool_calls"] == 1.0
    unfiltered, _ = train_batch(groups, pad_token_id=0, settings=AdvantageSettings(leave_one_out=False))
    assert unfiltered["sample_mask"].tolist() == [1.0] * 4 and unfiltered["advantages"][0, 1] == pytest.approx(a)


def test_seq_logprob_error_mask_drops_sequences_over_the_threshold_by_hand():
    token_mask = torch.tensor([[0.0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 0]])
    gen = torch.tensor([[0.0, -1.0, -1.0], [0, -1.0, 0], [0, -1.0, -2.0], [0, 0, 0]])
    prev = torch.tensor([[0.0, -1.0, -1.5], [0, -1.0, 0], [0, -2.0, -3.0], [0, 0, 0]])
    sample_mask, rewards = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    errors = [(1 + math.exp(0.5)) / 2, 1.0, math.e]  # the fourth sequence has no trained token: no statistic
    kept, metrics = seq_logprob_error_mask(token_mask, sample_mask, prev, gen, rewards, 1.2)
    assert kept.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(math.e)
    assert metrics["mean_seq_mult_prob_error"] == pytest.approx(sum(errors) / 3)
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(1.0)
    assert metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.0)
    assert metrics["num_masked_seqs"] == 2 and metrics["masked_correct_pct"] == 1.0
    same, unmasked = seq_logprob_error_mask(token_mask, sample_mask, prev, gen, rewards, None)
    assert torch.equal(same, sample_mask) and unmasked["num_masked_seqs"] == 0
    assert unmasked["mean_seq_mult_prob_error_after_mask"] == unmasked["mean_seq_mult_prob_error"]
    already_out, counted = seq_logprob_error_mask(token_mask, torch.tensor([0.0, 1, 1, 1]), prev, gen, rewards, 1.2)
    assert already_out.tolist() == [0.0, 1.0, 0.0, 1.0] and counted["num_masked_seqs"] == 1, "counted once"


class OneTokenTags:
    def encode(self, text, add_special_tokens=False):
        return {"<think>": [90], "</think>": [91]}.get(text, [1, 2])


def gym_result(text):
    return {"reward": 1.0, "response": {"output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}}


def test_reward_shaper_applies_nemo_rls_penalties_and_effort_shaping_to_committed_groups():
    row = {"responses_create_params": {"input": [{"role": "user", "content": "be brief /low"}]}}
    empty = flagged([1], [2, 3], 1.0, env_extras=gym_result(""))
    answered = flagged([1], [2, 3, 4, 5], 1.0, env_extras=gym_result("42"))
    groups = [CommittedGroup(PromptGroupRecord(0, [], row, {}, [empty, answered], {}), 0, 0)]
    penalties = RewardShaper(OneTokenTags(), reward_penalties={"penalize_empty_final_answer": True})
    shaped, metrics = penalties.shape_groups(groups)
    assert [c.reward for c in shaped[0].record.completions] == [0.0, 1.0]
    assert metrics == {"empty_final_answer_rate": 0.5}
    assert empty.reward == 1.0 and empty.env_extras["reward"] == 1.0, "the committed result is left as Gym gave it"
    effort = RewardShaper(OneTokenTags(), effort_levels={"low_weight": 2.0, "low_ub": 8, "low_string": "/low",
                                                         "low_penalty": 1.0})
    shaped, metrics = effort.shape_groups(groups)
    # length 2: min(1, 2 * (1 - 2/8)) = 1 -> 1 + 1 * 1; length 4: min(1, 2 * 0.5) = 1 -> 2
    assert [c.reward for c in shaped[0].record.completions] == [2.0, 2.0]
    assert metrics["mean_length_low"] == 3.0 and metrics["mean_length_reward_low"] == 1.0
    off = RewardShaper(OneTokenTags(), reward_penalties={"penalize_empty_final_answer": False})
    assert not off.enabled and off.shape_groups(groups) == (groups, {})
    with pytest.raises(ValueError, match="no NeMo-Gym result"):
        penalties.shape([row], [completion([1], [2], [0.0], 1.0)])
