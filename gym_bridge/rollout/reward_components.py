"""Multi-reward results: Gym's ``reward_components`` as NeMo-RL's ``reward/<name>`` columns, and the verifier's
contract that a result's ``reward`` is the sum of its components (NeMo-RL's ``nemo_gym.py`` helpers).

The components are parsed once, where a Gym result is converted
(:func:`gym_bridge.gym.protocol.result_fields.reward_components`: names as text, scores finite numbers); these helpers
read that parse, so a malformed mapping is a :class:`~gym_bridge.failures.GymResultError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from gym_bridge.failures import GymResultError
from gym_bridge.gym.protocol.result_fields import reward_components
from gym_bridge.json_types import JsonMapping

COLUMN_PREFIX = "reward/"
"""NeMo-RL's prefix of a component column (``get_gdpo_reward_component_keys`` selects on it)."""


def extract_reward_components(full_result: JsonMapping) -> dict[str, float] | None:
    """A multi-reward result's ``reward_components`` as ``{name: float}``; None for a single-reward result."""
    return reward_components(full_result)


def component_columns(components: Sequence[Mapping[str, float] | None]) -> dict[str, list[float]]:
    """``reward/<name>`` -> one score per sample, for every name any sample has (sorted, NeMo-RL's order); a sample
    without the name scores 0.0, as NeMo-RL fills it. Empty when no sample has components."""
    names = sorted({name for scores in components if scores for name in scores})
    return {f"{COLUMN_PREFIX}{name}": [(scores or {}).get(name, 0.0) for scores in components] for name in names}


def build_reward_component_columns(component_dicts: Sequence[Mapping[str, float] | None]) -> dict[str, torch.Tensor]:
    """:func:`component_columns` as float tensors: the columns NeMo-RL's ``final_batch`` carries."""
    return {key: torch.tensor(values) for key, values in component_columns(component_dicts).items()}


def check_component_sum(reward: float, components: Mapping[str, float] | None, where: str) -> None:
    """Raise :class:`GymResultError` naming ``where`` when ``reward`` is not the sum of ``components`` (NeMo-RL's
    tolerance: relative 1e-5, absolute 1e-6); a single-reward result (None) passes."""
    if components is None:
        return
    total = sum(components.values())
    if not math.isclose(reward, total, rel_tol=1e-5, abs_tol=1e-6):
        raise GymResultError(
            f"{where} has reward={reward} but its reward_components sum to {total} ({dict(components)}); a "
            "multi-reward verifier must set reward = sum(reward_components.values())"
        )


def validate_reward_components_match_scalar(full_results: Sequence[JsonMapping]) -> None:
    """Raise ``GymResultError`` for the first multi-reward result whose ``reward`` is not the sum of its components."""
    for index, full_result in enumerate(full_results):
        components = extract_reward_components(full_result)
        check_component_sum(float(full_result["reward"]), components, f"NeMo-Gym result {index}")
