"""Where finished prompt groups go: a sink (or NeMo-RL's replay buffer) reserves a slot, then commits or drops it.

``RolloutManager.collect`` reserves a fresh slot per attempt, commits only a
complete group, and discards the slot of every failed attempt, so a sink never
holds a partial or failed group. Each commit says which policy weights produced the
group: the manager's weight version when the attempt started and when it finished
(NeMo-RL's ``generate_and_push`` semantics); they differ when a refit landed mid-rollout.

:class:`ReplayBuffer` is the contract of NeMo-RL's ``TQReplayBuffer`` as
``RolloutManager.generate_and_push`` uses it (``reserve`` tagged with the weight version and
target step, async ``commit`` and ``remove_group``); :class:`InMemoryReplayBuffer` implements
it for tests and single-process loops.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gym_bridge.failures import GymBridgeError
from gym_bridge.types import PromptGroupRecord


class SlotError(GymBridgeError, ValueError):
    """A replay-buffer group id that is unknown (never reserved, or removed), committed twice, or committed on
    other weights than it was reserved on; a ``ValueError``, as NeMo-RL's buffer raises."""


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


@runtime_checkable
class ReplayBuffer(Protocol):
    """NeMo-RL's replay-buffer contract for ``generate_and_push``: reserve a slot, then commit or remove it."""

    def reserve(self, *, weight_version: int, target_step: int | None = None) -> str:
        """A fresh group id for one attempt, tagged with the weights it starts on and the step it targets."""

    async def commit(
        self, group_id: str, record: PromptGroupRecord, start_weight_version: int, end_weight_version: int
    ) -> object:
        """Store the complete group reserved as ``group_id``; an unknown id raises ``ValueError``."""

    async def remove_group(self, group_id: str) -> int:
        """Forget the slot ``group_id`` (a failed attempt); an unknown id raises ``ValueError``."""


@dataclass
class BufferSlot:
    """One reserved slot of :class:`InMemoryReplayBuffer`; ``record`` is set by the commit."""

    group_id: str
    start_weight_version: int
    target_step: int | None
    end_weight_version: int = -1
    record: PromptGroupRecord | None = None

    @property
    def ready(self) -> bool:
        return self.record is not None


class InMemoryReplayBuffer:
    """:class:`ReplayBuffer` in a list: slots in reservation order, ready once committed."""

    def __init__(self) -> None:
        self.slots: list[BufferSlot] = []

    def reserve(self, *, weight_version: int, target_step: int | None = None) -> str:
        group_id = str(uuid.uuid4())
        self.slots.append(BufferSlot(group_id, int(weight_version), target_step))
        return group_id

    async def commit(
        self, group_id: str, record: PromptGroupRecord, start_weight_version: int, end_weight_version: int
    ) -> BufferSlot:
        slot = self._slot(group_id)
        if slot.ready:
            raise SlotError(f"group_id={group_id!r} was already committed")
        if start_weight_version != slot.start_weight_version:
            raise SlotError(
                f"group_id={group_id!r} was reserved on weight version {slot.start_weight_version}, "
                f"committed as {start_weight_version}"
            )
        slot.record, slot.end_weight_version = record, int(end_weight_version)
        return slot

    async def remove_group(self, group_id: str) -> int:
        self.slots.remove(self._slot(group_id))
        return 1

    def ready(self, target_step: int | None = None) -> list[BufferSlot]:
        """The committed slots (for ``target_step`` when given), in reservation order."""
        return [s for s in self.slots if s.ready and (target_step is None or s.target_step == target_step)]

    def _slot(self, group_id: str) -> BufferSlot:
        for slot in self.slots:
            if slot.group_id == group_id:
                return slot
        raise SlotError(f"unknown group_id={group_id!r} (never reserved, or already removed)")
