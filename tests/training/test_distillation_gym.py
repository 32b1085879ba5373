"""On-policy distillation through real Gym servers: NeMo-RL's distillation config (``distillation``, ``teacher``,
``loss_fn.kl_type``) run by ``gym-bridge train``'s ``train``. The tiny student's rollouts go through Gym's
example_single_tool_call environment; a second tiny model (another seed, the same tokenizer) is the teacher; the
step's loss is the reverse KL over the teacher's top-k, positive, and the update moves the student's weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gym_bridge.testing.gym_rows import tool_call_rows

pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

GYM_CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
]


def test_a_distillation_step_through_gym_trains_on_the_teachers_kl(
    ray_session, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from safetensors.torch import load_file

    from gym_bridge.models.tiny import build_tiny_model
    from gym_bridge.recipes.train import train

    folder = tmp_path_factory.mktemp("distillation")
    teacher = build_tiny_model(cache_dir=folder / "teacher-cache", seed=1)
    rows = tool_call_rows()[:2]
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config: dict[str, Any] = {
        "distillation": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 1,
                         "topk_logits_k": 8, "seed": 0},
        "loss_fn": {"kl_type": "reverse"},
        "teacher": {"model_name": str(teacher)},
        "policy": {"model_name": str(tiny_model_dir), "max_total_sequence_length": 2048,
                   "optimizer": {"kwargs": {"lr": 1e-3}},
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}},
        "checkpointing": {"enabled": True},
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": GYM_CONFIGS, "rollout_timeout_s": 240, "startup_timeout_s": 240,
                             "actor_options": {"num_cpus": 0}}},
        "data": {"shuffle": False, "train": {"data_path": str(data)}},
    }  # fmt: skip
    outcome = train(config, folder / "run", progress=False)
    (line,) = [m for m in outcome.lines if m["kind"] == "train"]
    assert line["train/samples"] == 4 and line["train/refit"] is True, line
    assert math.isfinite(line["train/loss"]) and line["train/loss"] > 0, "two different models: a positive KL"
    assert "loss/clip_fraction" not in line, "no policy-gradient loss ran"
    assert outcome.checkpoint is not None
    trained, start = (load_file(next(Path(f).glob("*.safetensors"))) for f in (outcome.checkpoint, tiny_model_dir))
    assert any(not (trained[name] == start[name]).all() for name in start), "the update moved the student"
