"""On-policy distillation's loss (NeMo-RL's ``DistillationLossFn``) against a KL computed by hand, term by term,
for each ``kl_type`` and ``zero_outside_topk``; its gradient reaches the student's logits through ``HFPolicy.train``;
and a NeMo-RL distillation config reads into the trainer's settings (``config/distillation.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.config.distillation import distillation_config, with_grpo_keys
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.training.distillation import DistillationConfig, DistillationLoss

STUDENT = [[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, -0.4]]  # two positions' logits over a vocabulary of 4
TEACHER_TOP = [[1.5, 0.0], [0.7, -0.2]]  # the teacher's top-2 logits at each position
TEACHER_IDS = [[0, 3], [2, 1]]


def log_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    norm = math.log(sum(math.exp(x - top) for x in xs)) + top
    return [x - norm for x in xs]


def by_hand(kl_type: str, weight: float, zero_outside_topk: bool) -> float:
    """The mean over the two (generated) positions of NeMo-RL's per-token KL, written out."""
    total = 0.0
    for logits, top, ids in zip(STUDENT, TEACHER_TOP, TEACHER_IDS, strict=True):
        t = log_softmax(top)
        full = log_softmax(logits)
        s = [full[i] for i in ids] if zero_outside_topk else log_softmax([logits[i] for i in ids])
        forward = sum(math.exp(ti) * (ti - si) for ti, si in zip(t, s, strict=True))
        reverse = sum(math.exp(si) * (si - ti) for ti, si in zip(t, s, strict=True))
        kl = {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[kl_type]
        if zero_outside_topk and kl_type != "forward":
            rest = [j for j in range(len(logits)) if j not in ids]
            entropy_rest = sum(math.exp(full[j]) * full[j] for j in rest)
            mass_rest = sum(math.exp(full[j]) for j in rest)
            correction = entropy_rest + 100.0 * mass_rest
            kl += correction * (1 - weight if kl_type == "mixed" else 1.0)
        total += kl
    return total / 2


def batch() -> BatchedDataDict:
    """Three tokens; the two after the first are generated, so positions 0 and 1 (predicting them) count."""
    return BatchedDataDict({
        "input_ids": torch.tensor([[1, 2, 3]]), "input_lengths": torch.tensor([3]),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0]]), "sample_mask": torch.tensor([1.0]),
        "teacher_topk_logits": torch.tensor([TEACHER_TOP]), "teacher_topk_indices": torch.tensor([TEACHER_IDS]),
    })  # fmt: skip


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_the_loss_is_nemo_rls_kl_over_the_teachers_top_k_by_hand(kl_type: str, zero_outside_topk: bool) -> None:
    cfg = DistillationConfig(teacher_model="tiny", kl_type=kl_type, mixed_kl_weight=0.3,
                             zero_outside_topk=zero_outside_topk)  # fmt: skip
    logits = torch.tensor([STUDENT], requires_grad=True)
    loss, metrics = DistillationLoss(cfg)(logits, batch(), torch.tensor(1.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx(by_hand(kl_type, 0.3, zero_outside_topk), rel=1e-6)
    assert metrics["loss"] == pytest.approx(float(loss))
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_a_masked_sample_and_prompt_tokens_add_nothing() -> None:
    data = batch()
    data["token_mask"] = torch.tensor([[0.0, 0.0, 1.0]])  # only the last token generated: position 1 counts
    loss, _ = DistillationLoss(DistillationConfig(teacher_model="tiny", kl_type="reverse"))(
        torch.tensor([STUDENT]), data, torch.tensor(1.0), torch.tensor(1.0)
    )
    t, s = log_softmax(TEACHER_TOP[1]), log_softmax([STUDENT[1][i] for i in TEACHER_IDS[1]])
    assert float(loss) == pytest.approx(sum(math.exp(b) * (b - a) for a, b in zip(t, s, strict=True)), rel=1e-6)
    data["sample_mask"] = torch.tensor([0.0])
    zero, _ = DistillationLoss(DistillationConfig(teacher_model="tiny"))(
        torch.tensor([STUDENT]), data, torch.tensor(1.0), torch.tensor(1.0)
    )
    assert float(zero) == 0.0


def test_the_student_moves_toward_the_teacher_through_hf_policy_train(tiny_model_dir) -> None:
    from gym_bridge.policy.hf import HFPolicy, HFPolicyConfig

    student = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False))
    teacher = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-2, keep_reference_model=False))
    with torch.no_grad():
        for p in teacher.model.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    data = BatchedDataDict({"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "input_lengths": torch.tensor([6]),
                            "token_mask": torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0]]),
                            "sample_mask": torch.tensor([1.0])})  # fmt: skip
    top = teacher.get_topk_logits(data, k=8)
    data["teacher_topk_logits"], data["teacher_topk_indices"] = top["topk_logits"], top["topk_indices"]
    loss = DistillationLoss(DistillationConfig(teacher_model="tiny", kl_type="forward"))
    before = student.train(data, loss, eval_mode=True)["loss"]
    for _ in range(3):
        student.train(data, loss)
    after = student.train(data, loss, eval_mode=True)["loss"]
    assert 0 < after < before, (before, after)


def test_a_nemo_rl_distillation_config_reads_as_the_trainers_keys() -> None:
    recipe = {
        "distillation": {"num_prompts_per_step": 2, "num_generations_per_prompt": 1, "max_num_steps": 1,
                         "topk_logits_k": 16, "val_period": 1, "seed": 7},
        "loss_fn": {"kl_type": "reverse", "mixed_kl_weight": 0.5},
        "teacher": {"model_name": "smollm2"},
        "policy": {"model_name": "tiny"},
    }  # fmt: skip
    config = with_grpo_keys(recipe)
    assert config["grpo"] == {"num_prompts_per_step": 2, "num_generations_per_prompt": 1, "max_num_steps": 1,
                              "val_period": 1, "seed": 7}  # fmt: skip
    assert config["loss_fn"] == {"reference_policy_kl_penalty": 0.0} and "grpo" not in recipe
    assert with_grpo_keys(config) == config, "a rewritten config is left as it is"
    assert distillation_config(config) == DistillationConfig(teacher_model="smollm2", topk_logits_k=16,
                                                             kl_type="reverse", mixed_kl_weight=0.5)  # fmt: skip
    assert distillation_config({"grpo": {}, "distillation": {}, "teacher": {"model_name": "x"}}) is None, (
        "a GRPO recipe's own distillation section does not make it a distillation run"
    )
    with pytest.raises(TrainingConfigError, match=r"no 'teacher\.model_name'"):
        distillation_config(with_grpo_keys({**recipe, "teacher": {}}))
    with pytest.raises(TrainingConfigError, match=r"loss_fn\.kl_type"):
        distillation_config(with_grpo_keys({**recipe, "loss_fn": {"kl_type": "sideways"}}))
    with pytest.raises(TrainingConfigError, match=r"distillation\.topk_logits_k"):
        distillation_config(with_grpo_keys({**recipe, "distillation": {**recipe["distillation"], "topk_logits_k": 0}}))
