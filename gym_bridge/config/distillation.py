"""NeMo-RL's on-policy distillation through Gym (``run_distillation_nemo_gym.py``'s config) as a run of this trainer.

A distillation config has a ``distillation`` section where a GRPO config has ``grpo``, a ``teacher`` policy, and
``loss_fn`` keys of ``DistillationLossFn``. :func:`with_grpo_keys` rewrites it in NeMo-RL's key space into the keys
this trainer reads (``distillation.num_prompts_per_step`` -> ``grpo.num_prompts_per_step``, ...), keeping the
``distillation`` and ``teacher`` sections, which :func:`distillation_config` reads: the student's rollouts go
through Gym as GRPO's do, and the update is the distillation loss
(:class:`~gym_bridge.training.distillation.DistillationLoss`) over the teacher's top-k logits.
"""

from __future__ import annotations

import copy

from pydantic import ValidationError

from gym_bridge.config.keys import TrainingConfigError, config_section
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.training.distillation import DistillationConfig

LOOP_KEYS = (
    "num_prompts_per_step",
    "num_generations_per_prompt",
    "max_num_steps",
    "max_num_epochs",
    "val_period",
    "val_at_start",
    "val_at_end",
    "max_val_samples",
    "seed",
)
"""``distillation.<key>`` that mean what ``grpo.<key>`` means."""
LOSS_KEYS = ("kl_type", "mixed_kl_weight", "zero_outside_topk")
"""``loss_fn.<key>`` of NeMo-RL's ``DistillationLossConfig``."""
MARK = "_distillation_recipe"
"""Set by :func:`with_grpo_keys`: the config was a distillation config (a GRPO recipe may carry a ``distillation``
section of its own, which does not make it one)."""


def is_distillation(config: JsonMapping) -> bool:
    """Whether ``config`` is a distillation config: a ``distillation`` section and no ``grpo`` one."""
    return isinstance(config.get("distillation"), dict) and "grpo" not in config


def with_grpo_keys(config: JsonMapping) -> JsonObject:
    """A distillation config with the trainer's ``grpo`` keys set from ``distillation``'s and the distillation loss
    keys moved out of ``loss_fn`` (the policy-gradient loss is not run; no reference policy is kept). Any other
    config is returned as it is (a copy)."""
    out: JsonObject = copy.deepcopy(dict(config))
    if not is_distillation(config):
        return out
    section = config_section(config, "distillation")
    out["grpo"] = {key: section[key] for key in LOOP_KEYS if key in section}
    loss = config_section(config, "loss_fn")
    out["distillation"] = {**section, **{key: loss[key] for key in LOSS_KEYS if key in loss}}
    out["loss_fn"] = {"reference_policy_kl_penalty": 0.0}
    out[MARK] = True
    return out


def distillation_config(config: JsonMapping) -> DistillationConfig | None:
    """The distillation settings of a config :func:`with_grpo_keys` rewrote; None for a GRPO config."""
    section = config.get("distillation")
    if config.get(MARK) is not True or not isinstance(section, dict):
        return None
    teacher = config_section(config, "teacher").get("model_name")
    if teacher is None:
        raise TrainingConfigError("the distillation config has no 'teacher.model_name' (NeMo-RL's recipes set it)")
    values = {"teacher_model": str(teacher), **{k: section[k] for k in ("topk_logits_k", *LOSS_KEYS) if k in section}}
    try:
        return DistillationConfig(**values)
    except ValidationError as exc:
        keys = {"topk_logits_k": "distillation.topk_logits_k", "teacher_model": "teacher.model_name"}
        raise TrainingConfigError(
            "; ".join(f"{keys.get(str(e['loc'][0]), 'loss_fn.' + str(e['loc'][0]))}: {e['msg']}" for e in exc.errors())
        ) from None
