"""HFPolicy on the tiny model: logprob alignment against HFGeneration, one train step, checkpoints."""

from __future__ import annotations

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.policy import HFPolicy, HFPolicyConfig, policy_gradient_loss

# Generation decodes with a KV cache over a left-padded batch; the policy runs one full
# forward over a right-padded one. In float32 the two agree to rounding: we allow 1e-4 nats.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def prompts_batch(tokenizer, texts):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.int64)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict({"input_ids": input_ids, "input_lengths": torch.tensor([len(r) for r in ids])})


def test_logprobs_match_generation_at_temperature_one(tiny_model_dir, loaded):
    model, tokenizer = loaded
    gen = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=12, temperature=1.0, seed=3))
    prompts = prompts_batch(tokenizer, ["What is 12 + 7?", "Hi", "Tell me a story about a cat."])
    out = gen.generate(prompts)
    gen.shutdown()
    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), keep_reference_model=False))
    lp = policy.get_logprobs(BatchedDataDict({"input_ids": out["output_ids"],
                                              "input_lengths": out["unpadded_sequence_lengths"]}))["logprobs"]
    assert lp.shape == out["output_ids"].shape and lp.dtype == torch.float32
    assert bool((lp[:, 0] == 0).all())
    for i in range(3):
        start, end = int(prompts["input_lengths"][i]), int(out["unpadded_sequence_lengths"][i])
        assert end > start
        torch.testing.assert_close(lp[i, start:end], out["logprobs"][i, start:end], atol=LOGPROB_ATOL, rtol=0)
        assert bool((lp[i, end:] == 0).all())  # padding
        assert bool((lp[i, 1:start] < 0).all())  # prompt tokens are scored too
    with pytest.raises(RuntimeError, match="keep_reference_model"):
        policy.get_reference_policy_logprobs(prompts)


def fixed_batch(tokenizer):
    batch = prompts_batch(tokenizer, ["What is 12 + 7? 19", "Hi there", "One two three four", "cat dog"])
    mask = (torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]).float()
    mask[:, 0] = 0
    batch["token_mask"] = mask
    batch["advantages"] = torch.tensor([1.0, 0.5, 1.0, 0.25])
    return batch


def test_one_train_step_changes_weights_and_lowers_loss(loaded, tmp_path):
    import copy

    model, tokenizer = loaded
    policy = HFPolicy(HFPolicyConfig(learning_rate=1e-2, max_grad_norm=None),
                      model=copy.deepcopy(model), tokenizer=tokenizer)
    batch = fixed_batch(tokenizer)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    loss_before = policy.train(batch, policy_gradient_loss, eval_mode=True)["loss"]
    assert policy.steps_taken == 0
    metrics = policy.train(batch, policy_gradient_loss, gbs=4, mbs=2)
    assert metrics["num_global_batches"] == 1 and metrics["num_micro_batches"] == 2
    assert metrics["loss"] == pytest.approx(loss_before, rel=1e-5)  # accumulated micro-batches = one pass
    assert metrics["grad_norm"] > 0 and policy.steps_taken == 1
    after = policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    loss_after = policy.train(batch, policy_gradient_loss, eval_mode=True)["loss"]
    assert loss_after < loss_before
    # The reference model keeps the initial weights.
    ref = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    now = policy.get_logprobs(batch)["logprobs"]
    assert not torch.allclose(ref, now)

    policy.save_checkpoint(tmp_path / "ckpt")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for k, v in reloaded.state_dict().items():
        torch.testing.assert_close(v, after[k])
    assert (tmp_path / "ckpt" / "optimizer.pt").exists() and policy.shutdown()


def test_micro_batching_equals_one_pass(loaded):
    import copy

    model, tokenizer = loaded
    batch = fixed_batch(tokenizer)
    results = []
    for mbs in (1, 4):
        policy = HFPolicy(HFPolicyConfig(learning_rate=1e-3, keep_reference_model=False),
                          model=copy.deepcopy(model), tokenizer=tokenizer)
        policy.train(batch, policy_gradient_loss, gbs=4, mbs=mbs)
        # Compare the accumulated gradients (left in place after the step): AdamW's first
        # update is about lr * sign(grad), which would magnify rounding differences.
        results.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple"):
        policy.train(batch, policy_gradient_loss, gbs=4, mbs=3)


def test_logprobs_from_the_first_trained_position_skip_only_the_prompts_logits(loaded):
    model, tokenizer = loaded
    policy = HFPolicy(HFPolicyConfig(keep_reference_model=False), model=model, tokenizer=tokenizer)
    batch = fixed_batch(tokenizer)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    with torch.no_grad():
        full = policy._token_logprobs(model, ids, lengths)
        tail = policy._token_logprobs(model, ids, lengths, first=3)
    assert bool((tail[:, :3] == 0).all()) and bool((full[:, 1:3] < 0).all())
    torch.testing.assert_close(tail[:, 3:], full[:, 3:], atol=1e-5, rtol=0)


def test_topk_logits_shape(loaded):
    model, tokenizer = loaded
    policy = HFPolicy(model=model, tokenizer=tokenizer, cfg=HFPolicyConfig(keep_reference_model=False))
    batch = fixed_batch(tokenizer)
    top = policy.get_topk_logits(batch, k=3)
    width = batch["input_ids"].shape[1]
    assert top["topk_logits"].shape == (4, width - 1, 3) and top["topk_indices"].dtype == torch.int64


def test_the_scheduler_is_built_as_nemo_rls_policy_workers_build_it():
    from gym_bridge.policy.lr_scheduler import build_lr_scheduler

    def lrs(spec, steps=4):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(optimizer, spec)
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    warmup = {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 2}}
    constant = {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10**10}}
    assert lrs(None) == [1.0] * 4
    assert lrs(warmup) == pytest.approx([0.1, 0.55, 1.0, 1.0])
    assert lrs([warmup, constant, {"milestones": [2]}]) == pytest.approx([0.1, 0.55, 1.0, 1.0])
    decay = {"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}}
    assert lrs([constant, decay, {"milestones": [2]}]) == pytest.approx([1.0, 1.0, 1.0, 0.5])
    for bad, message in [
        ([warmup, constant], "2 schedulers need 1 milestones"),
        ({"name": "torch.optim.AdamW"}, "not a torch learning-rate scheduler"),
        ({"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"warmup": 3}}, "entry 0 .*warmup"),
        ([{"kwargs": {}}], "neither 'name' nor 'milestones'"),
    ]:
        with pytest.raises(ValueError, match=message):
            lrs(bad)


def test_the_scheduler_steps_once_per_training_call_and_not_in_eval_mode(tiny_model_dir, loaded):
    _, tokenizer = loaded
    warmup = {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5, "total_iters": 4}}
    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False,
                                     scheduler=warmup))
    batch = fixed_batch(tokenizer)
    assert policy.train(batch, policy_gradient_loss, eval_mode=True)["lr"] == pytest.approx(5e-4)
    two_steps = policy.train(batch, policy_gradient_loss, gbs=2)
    assert two_steps["num_global_batches"] == 2 and two_steps["lr"] == pytest.approx(5e-4)
    assert policy.train(batch, policy_gradient_loss)["lr"] == pytest.approx(6.25e-4), "one scheduler step per call"
