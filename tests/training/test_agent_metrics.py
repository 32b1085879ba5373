"""Per-environment metrics of a training step and of a validation (training/agent_metrics.py), NeMo-RL's per-agent
rule over the whole step: each agent's Gym result fields, summed over its completions and divided by their count."""

from __future__ import annotations

import math

import pytest

from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training.agent_metrics import agent_metrics, step_agent_metrics
from gym_bridge.training.loggers import nemo_rl_scalars
from gym_bridge.types import Completion, PromptGroupRecord, token_tensor


def completion(agent: str | None, reward: float, **fields: object) -> Completion:
    log = [{"role": "user", "content": "q", "token_ids": token_tensor([1, 2])},
           {"role": "assistant", "content": "a", "token_ids": token_tensor([3]), "generation_logprobs": None}]  # fmt: skip
    extras = {"reward": reward, "_ng_task_index": 7, **fields, **({"agent_ref": {"name": agent}} if agent else {})}
    return Completion(message_log=log, env_extras=extras, truncated=False, reward=reward)


def group(idx: int, *completions: Completion) -> CommittedGroup:
    return CommittedGroup(PromptGroupRecord(idx, [], None, {}, list(completions)), 0, 0)


def test_a_step_over_two_environments_reports_each_agent_over_the_step():
    math_group = group(0, completion("math_agent", 1.0, judge_score=0.5), completion("math_agent", 0.0, judge_score=1.0))
    tool_group = group(1, completion("tool_agent", 1.0, called_tool=True), completion("tool_agent", 1.0, called_tool=False))
    metrics = step_agent_metrics([math_group, tool_group])
    assert metrics["train/math_agent/reward/mean"] == 0.5 and metrics["train/tool_agent/reward/mean"] == 1.0
    assert metrics["train/math_agent/judge_score/mean"] == 0.75 and metrics["train/tool_agent/called_tool/mean"] == 0.5
    assert metrics["train/math_agent/masked_rate"] == 0.0
    assert not any("_ng_task_index" in key for key in metrics), "Gym's rollout identity is no verifier field"
    assert not any(key.startswith(("train/total_reward", "train/turns")) for key in metrics), "per agent only"
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    _, scalars = nemo_rl_scalars({"kind": "train", "step": 0, **metrics})
    assert scalars["train/tool_agent/reward/mean"] == 1.0, "the loggers carry them under NeMo-RL's names"


def test_the_agent_beside_the_result_names_it_and_gyms_result_stays_as_it_came():
    """A ``task_source`` row's agent is known once routed: the completion keeps it beside Gym's result
    (``Completion.agent``), whose keys stay NeMo-RL's."""
    routed = completion(None, 1.0)
    routed.agent = "math_agent"
    metrics = step_agent_metrics([group(0, routed, completion("math_agent", 0.0))])
    assert metrics["train/math_agent/reward/mean"] == 0.5
    assert "agent_ref" not in (routed.env_extras or {})


def test_completions_that_name_no_agent_give_no_per_agent_metrics():
    assert step_agent_metrics([group(0, completion(None, 1.0))]) == {}
    assert agent_metrics([completion("a", 1.0), completion(None, 0.0)], "val/") == pytest.approx(
        {k: v for k, v in agent_metrics([completion("a", 1.0)], "val/").items()}
    )


def test_the_training_plot_draws_each_environments_reward_when_there_are_several():
    from gym_bridge.training.plots import TrainingRun, panels

    steps = [
        {"step": s, "train/mean_reward": 0.5, "train/math_agent/reward/mean": 0.2 * s, "train/tool_agent/reward/mean": 1.0}
        for s in range(3)
    ]
    reward = panels(TrainingRun(steps=steps), {})[0]
    assert set(reward.series) == {"mean reward", "math_agent", "tool_agent"}
    assert reward.series["math_agent"] == [(1, 0.0), (2, 0.2), (3, 0.4)]
    one_agent = [{k: v for k, v in m.items() if "tool_agent" not in k} for m in steps]
    assert set(panels(TrainingRun(steps=one_agent), {})[0].series) == {"mean reward"}, "one environment: its mean"
