"""GDPO (``grpo.adv_estimator.name: gdpo``): NeMo-RL's multi-reward advantages over Gym's ``reward_components``,
by hand and as properties, the components read from converted Gym results, checked against the scalar reward, and
reported per agent. The comparison with NeMo-RL's own estimator is ``test_against_nemo_rl.py``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gym_bridge.failures import GymResultError, SettingError
from gym_bridge.gym.protocol.result_fields import gym_row_result
from gym_bridge.rollout.nemo_gym import group_metrics, gym_completion
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training import AdvantageSettings, grpo_advantages, train_batch
from gym_bridge.training.advantages import gdpo_advantages
from gym_bridge.types import Completion, PromptGroupRecord

GDPO = AdvantageSettings(estimator="gdpo", leave_one_out=False)


def test_gdpo_normalises_each_component_in_its_group_then_the_weighted_sum_over_the_batch():
    correctness = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    fmt = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    adv = gdpo_advantages({"format": fmt, "correctness": correctness}, weights=[1.0, 0.5], leave_one_out=False)
    # correctness (weight 1.0, first by name): group 0 is +-1/sqrt(0.5); group 1 has no spread.
    # format (weight 0.5): group 0 has no spread; group 1 is -+1/sqrt(0.5).
    part = 1 / (math.sqrt(0.5) + 1e-6)
    combined = torch.tensor([part, -part, -0.5 * part, 0.5 * part])
    expected = (combined - combined.mean()) / combined.std()
    assert adv.reshape(-1).tolist() == pytest.approx(expected.tolist(), rel=1e-6)


def test_gdpo_refuses_one_component_and_a_weight_count_that_differs():
    one = torch.tensor([[1.0, 0.0]])
    with pytest.raises(
        SettingError, match=r"two or more reward components .* has 1: \['a'\].*adv_estimator.name: grpo"
    ):
        gdpo_advantages({"a": one})
    with pytest.raises(SettingError, match=r"reward_weights has 3 entries but this batch has 2 reward components"):
        gdpo_advantages({"a": one, "b": one}, weights=[1.0, 1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(
    groups=st.integers(1, 4),
    size=st.integers(1, 5),
    names=st.integers(2, 4),
    data=st.data(),
)
def test_gdpo_is_finite_centred_and_unit_scaled_over_the_valid_samples(groups, size, names, data):
    scores = st.floats(-1e6, 1e6, allow_nan=False) | st.sampled_from([0.0, 1.0])
    parts = {
        f"c{k}": torch.tensor(data.draw(st.lists(scores, min_size=groups * size, max_size=groups * size))).view(
            groups, size
        )
        for k in range(names)
    }
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=groups * size, max_size=groups * size)))
    valid = valid.view(groups, size)
    adv = gdpo_advantages(parts, leave_one_out=data.draw(st.booleans()), valid=valid)
    assert torch.isfinite(adv).all()
    assert (adv[~valid] == 0).all(), "a sample out of the baseline gets no advantage"
    kept = adv[valid].double()
    if kept.numel():
        assert abs(float(kept.mean())) < 1e-3
    if kept.numel() > 1 and float(kept.std()) > 1e-3:
        assert float(kept.std()) == pytest.approx(1.0, abs=1e-3)


def gym_done(reward, components, agent="tool_agent"):
    """A one-turn converted Gym row as the nemo_gym backend's completion."""
    full_result = {"reward": reward, "response": {"output": []}}
    if components is not None:
        full_result["reward_components"] = components
    log = [
        {"role": "user", "content": "", "token_ids": torch.tensor([1, 2])},
        {"role": "assistant", "content": "", "token_ids": torch.tensor([3]),
         "generation_logprobs": torch.tensor([-0.5])},
    ]  # fmt: skip
    return gym_completion(gym_row_result(0, log, full_result), max_seq_len=None, mask_env_flagged_samples=True,
                          agent=agent)  # fmt: skip


def committed(idx, completions):
    return CommittedGroup(PromptGroupRecord(idx, [], None, {}, completions, {}), 0, 0)


def test_the_batch_reads_each_completions_components_and_fills_a_missing_one_with_zero():
    rows = [(1.5, {"correctness": 1.0, "format": 0.5}), (0.5, {"format": 0.5}), (1.0, {"correctness": 1.0}),
            (0.0, {"correctness": 0.0, "format": 0.0})]  # fmt: skip
    groups = [committed(0, [gym_done(*rows[0]), gym_done(*rows[1])]), committed(1, [gym_done(*rows[2]),
                                                                                    gym_done(*rows[3])])]  # fmt: skip
    batch, _ = train_batch(groups, 0, settings=GDPO)
    expected = gdpo_advantages(
        {"correctness": torch.tensor([[1.0, 0.0], [1.0, 0.0]]), "format": torch.tensor([[0.5, 0.5], [0.0, 0.0]])},
        leave_one_out=False,
    )
    assert torch.allclose(batch["advantages"][:, -1], expected.reshape(-1))
    grpo, _ = train_batch(groups, 0, settings=AdvantageSettings(leave_one_out=False))
    assert torch.allclose(grpo["advantages"][:, -1], grpo_advantages(torch.tensor([[1.5, 0.5], [1.0, 0.0]]),
                                                                     leave_one_out=False).reshape(-1))  # fmt: skip
    assert not torch.allclose(batch["advantages"], grpo["advantages"])


def test_a_reward_that_is_not_its_components_sum_names_the_group_and_completion():
    groups = [committed(7, [gym_done(1.0, {"a": 0.5, "b": 0.5}), gym_done(1.0, {"a": 0.25, "b": 0.5})])]
    with pytest.raises(GymResultError, match=r"prompt_idx=7 completion 1 has reward=1\.0 but its reward_components "
                                             r"sum to 0\.75"):  # fmt: skip
        train_batch(groups, 0, settings=GDPO)


def test_a_single_reward_environment_under_gdpo_is_one_line_naming_the_setting():
    groups = [committed(0, [gym_done(1.0, None), gym_done(0.0, None)])]
    with pytest.raises(
        SettingError, match=r"results from tool_agent carry 0: \[\]\. Point env\.nemo_gym at a multi"
    ):
        train_batch(groups, 0, settings=GDPO)


@settings(max_examples=150, deadline=None)
@given(
    components=st.one_of(
        st.dictionaries(
            st.text(max_size=5),
            st.text(max_size=3) | st.booleans() | st.none() | st.lists(st.integers()),
            min_size=1,
            max_size=3,
        ),
        st.text(max_size=5),
        st.lists(st.floats(allow_nan=False), min_size=1, max_size=3),
        st.integers(),
        st.just({"a": float("inf")}),
        st.just({"a": 2**60}),
    )
)
def test_malformed_reward_components_are_a_gym_result_error_naming_the_field(components):
    log = [{"role": "user", "content": "", "token_ids": torch.tensor([1])}]
    with pytest.raises(GymResultError, match="reward_components"):
        gym_row_result(0, log, {"reward": 1.0, "reward_components": components})


def test_each_agents_components_reach_its_metrics():
    done = [gym_done(1.5, {"correctness": 1.0, "format": 0.5}), gym_done(0.5, {"format": 0.5}),
            gym_done(1.0, None, agent="math_agent")]  # fmt: skip
    metrics = group_metrics(done, [c.agent for c in done])
    assert metrics["tool_agent/reward/correctness/mean"] == 0.5
    assert metrics["tool_agent/reward/format/mean"] == 0.5
    assert not any(key.startswith(("math_agent/reward/correctness", "math_agent/reward/format")) for key in metrics)
    assert isinstance(done[2], Completion) and done[2].reward_components is None
