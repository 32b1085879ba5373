"""Where finished prompt groups go: a sink reserves a slot, then commits or discards it.

``RolloutManager.collect`` reserves a fresh slot per attempt, commits only a
complete group, and discards the slot of every failed attempt, so a sink never
holds a partial or failed group. Each commit says which policy weights produced the
group: the manager's weight version when the attempt started and when it finished
(NeMo-RL's ``generate_and_push`` semantics); they differ when a refit landed mid-rollout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gym_bridge.types import PromptGroupRecord


@runtime_checkable
class RolloutSink(Protocol):
    """The contract a sink implements. Methods are plain calls on the event loop: keep them quick."""

    def reserve(self, prompt_idx: int) -> str:
        """A fresh slot id for one attempt at ``prompt_idx``."""

    def commit(
        self, slot: str, record: PromptGroupRecord, *, start_weight_version: int, end_weight_version: int
    ) -> None:
        """Store the complete group held by ``slot``, rolled out on weights ``start..end``; at most once per slot."""

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        """Forget ``slot``: its attempt failed with ``error``. Must not raise for an unknown slot."""


@dataclass(frozen=True)
class CommittedGroup:
    """A committed group and the weight versions at the start and the end of its attempt."""

    record: PromptGroupRecord
    start_weight_version: int
    end_weight_version: int


class InMemorySink:
    """Keeps committed groups in a list, in commit order, and the last error of each prompt."""

    def __init__(self) -> None:
        self.groups: list[CommittedGroup] = []
        self.reserved: dict[str, int] = {}
        self.discarded: list[str] = []
        self.last_error: dict[int, BaseException | None] = {}
        self._ids = itertools.count()

    def reserve(self, prompt_idx: int) -> str:
        slot = f"{prompt_idx}-{next(self._ids)}"
        self.reserved[slot] = prompt_idx
        return slot

    @property
    def records(self) -> list[PromptGroupRecord]:
        """The committed groups' records, in commit order."""
        return [group.record for group in self.groups]

    def commit(
        self, slot: str, record: PromptGroupRecord, *, start_weight_version: int, end_weight_version: int
    ) -> None:
        if self.reserved.pop(slot, None) is None:
            raise KeyError(f"slot {slot!r} was not reserved, or was already committed or discarded")
        self.groups.append(CommittedGroup(record, start_weight_version, end_weight_version))

    def take(self) -> list[CommittedGroup]:
        """Remove and return every committed group (a trainer draining the sink)."""
        groups, self.groups = self.groups, []
        return groups

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        prompt_idx = self.reserved.pop(slot, None)
        if prompt_idx is not None:
            self.discarded.append(slot)
            self.last_error[prompt_idx] = error
