"""ClippedPGLoss: the old policy is the trainer's own logprobs, the clip, truncated importance sampling, the
reference KL, and the config keys a NeMo-RL user sets (refused when the loss does not implement them)."""

from __future__ import annotations

import math

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.config.grpo import loss_config_from, policy_config
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.training import ClippedPGLoss, ClippedPGLossConfig, GRPOLoopConfig
from gym_bridge.training.loss import loss_metrics


def batch(gen, advantages, prev=None, **extra):
    """A loss batch; the trainer's logprobs before the update (``prev``) default to the sampling ones."""
    gen = torch.tensor(gen)
    return BatchedDataDict({"generation_logprobs": gen, "token_mask": torch.ones_like(gen),
                            "prev_logprobs": gen.clone() if prev is None else torch.tensor(prev),
                            "advantages": torch.tensor(advantages), **extra})


def loss_and_grad(loss_fn, current, data):
    current = torch.tensor(current, requires_grad=True)
    tokens = torch.tensor(float(current.numel()))
    loss, metrics = loss_fn(current, data, torch.tensor(1.0), tokens)
    loss.backward()
    return float(loss.detach()), current.grad, metrics


def test_the_old_policy_is_the_trainers_logprobs_before_the_update_never_the_sampling_ones():
    # The engine sampled with logprob -3; the trainer gave -1 before the update and gives -1 now: ratio 1, no clip.
    data = batch([[-3.0, -3.0]], [1.0], prev=[[-1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(ClippedPGLoss(), [[-1.0, -1.0]], data)
    assert loss == pytest.approx(-1.0) and grad[0].tolist() == pytest.approx([-0.5, -0.5])
    assert metrics["clipped_tokens"] == 0.0, "exp(-1 - -3) would be clipped if the sampler were the old policy"
    assert metrics["on_policy"].abs_diff_max == pytest.approx(2.0), "on_policy compares prev with the sampler"
    del data["prev_logprobs"]
    with pytest.raises(KeyError, match="prev_logprobs"):
        loss_and_grad(ClippedPGLoss(), [[-1.0, -1.0]], data)
    forced = ClippedPGLoss(ClippedPGLossConfig(force_on_policy_ratio=True))
    forced_loss, forced_grad, _ = loss_and_grad(forced, [[-1.0, -1.0]], data)
    assert forced_loss == loss and torch.equal(forced_grad, grad), "the update's own logprobs: ratio 1"


def test_a_batch_that_takes_two_optimizer_steps_keeps_its_old_policy(tiny_model_dir):
    """HFPolicy.train with two global batches: the second step's ratio is against prev, not its own logprobs."""
    from gym_bridge.policy import HFPolicy, HFPolicyConfig

    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=5e-2, keep_reference_model=False))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]] * 4)
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([6] * 4),
                            "token_mask": torch.tensor([[0, 0, 0, 1, 1, 1]] * 4).float(),
                            "advantages": torch.tensor([1.0, 1.0, 1.0, 1.0])})
    prev = policy.get_logprobs(data)["logprobs"]
    data["prev_logprobs"], data["generation_logprobs"] = prev, prev.clone()
    result = policy.train(data, ClippedPGLoss(), gbs=2, mbs=2)
    assert result["num_global_batches"] == 2
    second = result["all_mb_metrics"][1]
    # The first step raised these tokens' logprobs a lot: against prev, the second step's ratios leave the clip.
    assert second["clipped_tokens"] > 0, second


def test_the_clip_acts_on_samples_from_another_policy():
    # The trainer gave logprob -1 before the update and now gives log(1.5) - 1 and log(0.5) - 1: ratios 1.5, 0.5.
    current = [[math.log(1.5) - 1.0, math.log(0.5) - 1.0, -1.0]]
    loss, grad, metrics = loss_and_grad(ClippedPGLoss(), current, batch([[-1.0, -1.0, -1.0]], [1.0]))
    # A > 0: ratio 1.5 is clipped at 1.2 (no gradient); ratio 0.5 is not (min keeps it); ratio 1 trains.
    assert loss == pytest.approx(-(1.2 + 0.5 + 1.0) / 3)
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(-0.5 / 3) and grad[0, 2] == pytest.approx(-1 / 3)
    assert metrics["clipped_tokens"] == 1.0
    _, grad, metrics = loss_and_grad(ClippedPGLoss(), current, batch([[-1.0, -1.0, -1.0]], [-1.0]))
    assert grad[0, 1] == 0.0 and grad[0, 0] != 0.0, "A < 0: the low ratio is the clipped one"
    on_policy = loss_and_grad(ClippedPGLoss(), [[-1.0, -2.0]], batch([[-1.0, -2.0]], [1.0]))[2]
    assert on_policy["clipped_tokens"] == 0.0, "on-policy samples are never clipped"


def test_dual_clip_caps_the_loss_of_negative_advantages():
    current = [[math.log(5.0) - 1.0]]  # ratio 5
    plain = loss_and_grad(ClippedPGLoss(), current, batch([[-1.0]], [-1.0]))[0]
    dual = loss_and_grad(ClippedPGLoss(ClippedPGLossConfig(ratio_clip_c=3.0)), current, batch([[-1.0]], [-1.0]))[0]
    assert plain == pytest.approx(5.0) and dual == pytest.approx(3.0)


def test_truncated_importance_sampling_weights_each_token_by_its_clipped_ratio():
    # IS correction: the ratio is against the trainer's own weights (1), each token weighted by exp(prev - gen).
    current = [[-1.0, -1.0, -1.0]]
    gen = [[-1.0 - math.log(3.0), -1.0 - math.log(0.5), -1.0]]  # IS weights 3, 0.5, 1
    tis = ClippedPGLoss(ClippedPGLossConfig(use_importance_sampling_correction=True,
                                            truncated_importance_sampling_type="tis",
                                            truncated_importance_sampling_ratio=2.0))
    loss, grad, metrics = loss_and_grad(tis, current, batch(gen, [1.0], prev=current))
    assert loss == pytest.approx(-(2.0 + 0.5 + 1.0) / 3), "3 truncated to 2"
    assert grad[0].tolist() == pytest.approx([-2 / 3, -0.5 / 3, -1 / 3])
    assert metrics["is_out_of_bounds_tokens"] == 1.0 and metrics["clipped_tokens"] == 0.0
    icepop = ClippedPGLoss(ClippedPGLossConfig(use_importance_sampling_correction=True,
                                               truncated_importance_sampling_type="icepop",
                                               truncated_importance_sampling_ratio=2.0,
                                               truncated_importance_sampling_ratio_min=0.8))
    loss, grad, _ = loss_and_grad(icepop, current, batch(gen, [1.0], prev=current))
    assert loss == pytest.approx(-1.0 / 3) and grad[0].tolist() == pytest.approx([0.0, 0.0, -1 / 3])
    untruncated = ClippedPGLoss(ClippedPGLossConfig(use_importance_sampling_correction=True))
    assert loss_and_grad(untruncated, current, batch(gen, [1.0], prev=current))[0] == pytest.approx(-(3.0 + 0.5 + 1.0) / 3)


def test_reference_kl_adds_its_penalty_and_reports_the_mean():
    current, reference = [[-1.0, -2.0]], torch.tensor([[-1.5, -2.0]])
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1)
    loss, grad, metrics = loss_and_grad(ClippedPGLoss(cfg), current,
                                        batch([[-1.0, -2.0]], [0.0], reference_policy_logprobs=reference))
    k3 = math.exp(-0.5) - 1 + 0.5
    assert loss == pytest.approx(0.1 * k3 / 2)
    assert loss_metrics([metrics])["loss/reference_kl"] == pytest.approx(k3 / 2)
    # NeMo-RL weighs the KL by exp(curr - curr.detach()): d/dc [k3 + k3 * dlogp] = (1 - e^r) + k3 = -r, r = ref - c.
    assert grad[0].tolist() == pytest.approx([0.1 * 0.5 / 2, 0.0])


def test_the_on_policy_kl_approximation_weighs_each_tokens_kl_by_curr_over_gen():
    current, reference, gen = [[-1.0, -2.0]], torch.tensor([[-1.5, -2.5]]), [[-1.0, -3.0]]
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True)
    loss, _, _ = loss_and_grad(ClippedPGLoss(cfg), current, batch(gen, [0.0], reference_policy_logprobs=reference))
    k3 = math.exp(-0.5) - 1 + 0.5
    assert loss == pytest.approx(0.1 * (k3 * 1.0 + k3 * math.exp(1.0)) / 2), "weights exp(curr - gen): 1 and e"
    plain = ClippedPGLoss(ClippedPGLossConfig(reference_policy_kl_penalty=0.1))
    assert loss_and_grad(plain, current, batch(gen, [0.0], reference_policy_logprobs=reference))[0] == pytest.approx(
        0.1 * k3
    ), "without it the weight is 1 in value"
    assert loss_config_from({"loss_fn": {"use_on_policy_kl_approximation": True}}).use_on_policy_kl_approximation


def test_incomplete_truncation_settings_are_refused():
    with pytest.raises(ValueError, match="needs use_importance_sampling_correction"):
        ClippedPGLossConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    with pytest.raises(ValueError, match="needs truncated_importance_sampling_ratio"):
        ClippedPGLossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis")
    with pytest.raises(ValueError, match="truncated_importance_sampling_ratio_min"):
        ClippedPGLossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                            truncated_importance_sampling_ratio=2.0)


def test_nemo_rl_loss_keys_are_read_and_unimplemented_variants_refused():
    cfg = loss_config_from({"loss_fn": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.28, "ratio_clip_c": None,
                                        "reference_policy_kl_penalty": 0.0, "token_level_loss": True,
                                        "use_importance_sampling_correction": True,
                                        "truncated_importance_sampling_type": "tis",
                                        "truncated_importance_sampling_ratio": 2.0, "kl_input_clamp_value": 20.0}})
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.truncated_importance_sampling_ratio) == (0.1, 0.28, 2.0)
    with pytest.raises(TrainingConfigError, match=r"loss_fn.use_cispo=True is not implemented"):
        loss_config_from({"loss_fn": {"use_cispo": True, "token_level_loss": False}})
    gspo = loss_config_from({"loss_fn": {"token_level_loss": False, "sequence_level_importance_ratios": True}})
    assert (gspo.token_level_loss, gspo.sequence_level_importance_ratios) == (False, True)
    with pytest.raises(TrainingConfigError, match="sequence_level_importance_ratios"):
        loss_config_from({"loss_fn": {"sequence_level_importance_ratios": True}})


def test_the_sampling_temperature_reaches_the_policy():
    config = {"policy": {"generation": {"temperature": 0.7}, "optimizer": {"kwargs": {"lr": 1e-4}}},
              "loss_fn": {"reference_policy_kl_penalty": 0.01}}
    loop = GRPOLoopConfig(loss=loss_config_from(config))
    cfg = policy_config(config, "tiny", loop)
    assert cfg.temperature == 0.7 and cfg.learning_rate == 1e-4
    assert cfg.keep_reference_model, "a KL penalty needs the reference weights"


IS = ClippedPGLossConfig(use_importance_sampling_correction=True)


def test_async_rollouts_need_an_age_bound_of_at_least_one_step():
    with pytest.raises(ValueError, match="max_trajectory_age_steps >= 1"):
        GRPOLoopConfig(async_rollouts=True, max_trajectory_age_steps=0, loss=IS)
    assert GRPOLoopConfig(async_rollouts=True, max_trajectory_age_steps=3, loss=IS).lookahead == 3
    assert GRPOLoopConfig(max_trajectory_age_steps=3).lookahead == 0


def test_async_without_importance_sampling_correction_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="need loss_fn.use_importance_sampling_correction: true"):
        GRPOLoopConfig(async_rollouts=True, loss=ClippedPGLossConfig(ratio_clip_c=3.0))
    tis = ClippedPGLossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                              truncated_importance_sampling_ratio=2.0)
    assert GRPOLoopConfig(async_rollouts=True, loss=tis).async_rollouts
    assert not GRPOLoopConfig(loss=ClippedPGLossConfig()).async_rollouts, "sync needs no correction"
    from gym_bridge.config.grpo import loop_config_from
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = {"env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": ["a.yaml"]}},
              "policy": {"model_name": "tiny", "max_total_sequence_length": 64,
                         "generation": {"max_new_tokens": 8, "vllm_cfg": {"async_engine": True}}},
              "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "async_grpo": {"enabled": True}}}
    settings = nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:1/v1"])
    with pytest.raises(TrainingConfigError, match=r"^config: async rollouts \(grpo.async_grpo.enabled: true\) need "
                                                  r"loss_fn.use_importance_sampling_correction: true[^\n]*$"):
        loop_config_from(config, settings)


def test_the_reference_kl_is_clamped_as_nemo_rls_by_default():
    from gym_bridge.training.loss import kl_estimate

    logprobs, reference = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([-30.0, 3.0, 0.5])
    k3 = [math.exp(r) - 1 - r for r in (-20.0, 3.0, 0.5)]  # the log-ratio clamped to +-20 first
    expected = [min(v, 10.0) for v in k3]  # then the estimate to +-10
    assert kl_estimate(logprobs, reference, "k3", 20.0, 10.0).tolist() == pytest.approx(expected)
    assert kl_estimate(logprobs, reference, "k1", None, None).tolist() == pytest.approx([30.0, -3.0, -0.5])
    assert ClippedPGLossConfig().kl_input_clamp_value == 20.0 and ClippedPGLossConfig().kl_output_clamp_value == 10.0
    off = loss_config_from({"loss_fn": {"kl_input_clamp_value": None, "kl_output_clamp_value": None}})
    assert (off.kl_input_clamp_value, off.kl_output_clamp_value) == (None, None)


def test_grpo_advantage_keys_are_read_and_the_estimator_and_reference_skip_are_checked(caplog):
    from gym_bridge.config.grpo import loop_config_from
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = {
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": ["a.yaml"],
                                                          "effort_levels": {"low_weight": 1.0, "low_string": "/low"}}},
        "policy": {"model_name": "tiny", "max_total_sequence_length": 64, "generation": {"max_new_tokens": 8}},
        "reward_penalties": {"penalize_empty_final_answer": True},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "overlong_filtering": True,
                 "invalid_tool_call_advantage": -5.0, "malformed_thinking_advantage": -4.0,
                 "advantage_clip_low": -3.0, "advantage_clip_high": 3.0, "seq_logprob_error_threshold": 2.0,
                 "adv_estimator": {"name": "grpo", "normalize_rewards": False}},
    }
    settings = nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:1/v1"])
    loop = loop_config_from(config, settings)
    assert loop.advantage_settings.overlong_filtering and not loop.normalize_rewards
    assert (loop.invalid_tool_call_advantage, loop.malformed_thinking_advantage) == (-5.0, -4.0)
    assert (loop.advantage_clip_low, loop.advantage_clip_high, loop.seq_logprob_error_threshold) == (-3.0, 3.0, 2.0)
    assert loop.effort_levels.low_string == "/low" and loop.reward_penalties == {"penalize_empty_final_answer": True}
    assert loop.max_num_epochs == 1, "NeMo-RL's default epoch bound"

    def refused(grpo=None, **top):
        with pytest.raises(TrainingConfigError) as raised:
            loop_config_from({**config, "grpo": {**config["grpo"], **(grpo or {})}, **top}, settings)
        return str(raised.value)

    with caplog.at_level("WARNING", logger="gym_bridge.config.grpo"):
        both = loop_config_from({**config, "grpo": {**config["grpo"], "normalize_rewards": True}}, settings)
    assert not both.normalize_rewards, "NeMo-RL's estimator reads grpo.adv_estimator.normalize_rewards"
    assert "grpo.adv_estimator.normalize_rewards=False sets the advantages" in caplog.text
    assert "grpo.adv_estimator.name='opd'" in refused({"adv_estimator": {"name": "opd"}})
    assert "grpo.adv_estimator.name='mine'" in refused({"adv_estimator": {"name": "mine"}})
    assert "grpo.adv_estimator.reward_weights" in refused({"adv_estimator": {"reward_weights": [1.0, 2.0]}})
    gdpo = loop_config_from({**config, "grpo": {**config["grpo"], "adv_estimator": {
        "name": "gdpo", "reward_weights": [1.0, 0.5], "use_leave_one_out_baseline": False}}}, settings)
    assert gdpo.advantage_settings.estimator == "gdpo" and gdpo.advantage_settings.reward_weights == (1.0, 0.5)
    assert not gdpo.advantage_settings.leave_one_out
    assert "grpo.skip_reference_policy_logprobs_calculation" in refused(
        {"skip_reference_policy_logprobs_calculation": True}, loss_fn={"reference_policy_kl_penalty": 0.01})
    assert "policy.router_replay.enabled=True" in refused(policy={**config["policy"], "router_replay": {"enabled": True}})
    assert "policy.train_global_batch_size=8" in refused(policy={**config["policy"], "train_global_batch_size": 8})
    assert loop_config_from({**config, "grpo": {**config["grpo"], "skip_reference_policy_logprobs_calculation": True}},
                            settings)


def test_gspo_is_one_ratio_and_one_weight_per_sample_and_a_mean_over_samples():
    gspo = ClippedPGLossConfig(token_level_loss=False, sequence_level_importance_ratios=True)
    current = [[-1.0, -0.8], [-2.0, -2.0]]  # log-ratios [0, 0.2] and [0, 0]: sample ratios exp(0.1) and 1
    data = batch([[-1.0, -1.0], [-2.0, -2.0]], [[1.0], [1.0]], token_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    ratio = math.exp(0.1)
    # each sample's loss is its tokens' mean (-ratio, -1), the batch's the mean over 2 samples (global_valid_seqs)
    current_t = torch.tensor(current, requires_grad=True)
    seqs, toks = torch.tensor(2.0), torch.tensor(3.0)
    loss, _ = ClippedPGLoss(gspo)(current_t, data, seqs, toks)
    loss.backward()
    assert math.isclose(float(loss), (-ratio - 1.0) / 2, rel_tol=1e-6)
    # d exp(mean log-ratio) / d token = ratio / 2 tokens, halved again by the mean over samples
    assert torch.allclose(current_t.grad[0], torch.tensor([-ratio / 4, -ratio / 4]))
    assert math.isclose(float(current_t.grad[1, 0]), -0.5, rel_tol=1e-6) and float(current_t.grad[1, 1]) == 0.0
    weighted = ClippedPGLossConfig(token_level_loss=False, sequence_level_importance_ratios=True,
                                   use_importance_sampling_correction=True)  # fmt: skip
    prev = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    data = batch([[-1.5, -1.0], [-2.0, -2.0]], [[1.0], [1.0]], prev=prev.tolist())
    weights, _ = ClippedPGLoss(weighted)._weights(prev, data["generation_logprobs"], torch.ones(2, 2))
    assert torch.allclose(weights, torch.tensor([[math.exp(0.5)], [1.0]])), "exp of the sample's summed prev - gen"
