"""Per-environment metrics of a training step, as NeMo-RL logs them: each agent's Gym result fields over the step's
completions (``train/<agent>/<field>/mean``, ...), so a run whose data mixes environments shows how each one does."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from gym_bridge.gym.protocol.routing import row_agent
from gym_bridge.rollout.nemo_gym import group_metrics
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.types import Completion

UNKNOWN_AGENT = "(unknown)"
"""The agent of a completion whose Gym result names none (the native backend's)."""


def completion_agent(completion: Completion) -> str:
    """The agent that ran this completion (:attr:`Completion.agent`, else its Gym result's ``agent_ref.name``), or
    :data:`UNKNOWN_AGENT`."""
    return completion.agent or row_agent(completion.env_extras or {}) or UNKNOWN_AGENT


def step_agent_metrics(groups: Iterable[CommittedGroup]) -> dict[str, float]:
    """:func:`agent_metrics` of a training step's committed groups, under ``train/``."""
    return agent_metrics([c for group in groups for c in group.record.completions], "train/")


def agent_metrics(completions: Sequence[Completion], prefix: str) -> dict[str, float]:
    """``<prefix><agent>/<key>`` for every agent of ``completions``: NeMo-RL's per-agent metrics (each numeric
    field of the agent's Gym results, summed over its completions and divided by their count, and its masked rate
    and failure kinds), computed over all of them at once as NeMo-RL computes them over its batch. Finite numbers
    only; none when no completion names an agent."""
    agents = [completion_agent(c) for c in completions]
    named = sorted(set(agents) - {UNKNOWN_AGENT})
    if not named:
        return {}
    metrics = group_metrics(completions, agents)
    return {
        f"{prefix}{key}": float(value)
        for key, value in metrics.items()
        if key.split("/", 1)[0] in named and isinstance(value, int | float) and math.isfinite(value)
    }
