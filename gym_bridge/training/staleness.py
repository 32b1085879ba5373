"""Bounded staleness: which committed groups a trainer may still use.

A group's age at a training step is ``current_weight_version - start_weight_version``
(the oldest weights that produced any of its tokens). Groups older than
``max_trajectory_age_steps`` are dropped and counted, never trained on.
"""

from __future__ import annotations

from collections.abc import Iterable

from gym_bridge.failures.errors import SettingError
from gym_bridge.rollout.sink import CommittedGroup


class StalenessBuffer:
    """Holds committed groups until a training step takes the fresh ones."""

    def __init__(self, max_trajectory_age_steps: int = 1) -> None:
        if max_trajectory_age_steps < 0:
            raise SettingError(f"max_trajectory_age_steps must be >= 0, got {max_trajectory_age_steps}")
        self.max_trajectory_age_steps = max_trajectory_age_steps
        self.groups: list[CommittedGroup] = []
        self.dropped_total = 0

    def add(self, groups: Iterable[CommittedGroup]) -> None:
        """Hold ``groups`` until the next :meth:`take`."""
        self.groups.extend(groups)

    def take(self, current_weight_version: int) -> tuple[list[CommittedGroup], list[CommittedGroup]]:
        """``(usable groups, groups dropped now)``: every held group is in exactly one of the two."""
        usable: list[CommittedGroup] = []
        stale: list[CommittedGroup] = []
        for group in self.groups:
            if group.start_weight_version > current_weight_version:
                raise SettingError(
                    f"prompt_idx={group.record.prompt_idx} claims weight version {group.start_weight_version}, "
                    f"newer than the trainer's {current_weight_version}"
                )
            if current_weight_version - group.start_weight_version <= self.max_trajectory_age_steps:
                usable.append(group)
            else:
                stale.append(group)
        self.groups = []
        self.dropped_total += len(stale)
        return usable, stale
