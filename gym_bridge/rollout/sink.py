"""Where finished prompt groups go: a sink reserves a slot, then commits or discards it.

``RolloutManager.collect`` reserves a fresh slot per attempt, commits only a
complete group, and discards the slot of every failed attempt, so a sink never
holds a partial or failed group.
"""

from __future__ import annotations

import itertools
from typing import Protocol, runtime_checkable

from gym_bridge.types import PromptGroupRecord


@runtime_checkable
class RolloutSink(Protocol):
    """The contract a sink implements. Methods are plain calls on the event loop: keep them quick."""

    def reserve(self, prompt_idx: int) -> str:
        """A fresh slot id for one attempt at ``prompt_idx``."""

    def commit(self, slot: str, record: PromptGroupRecord) -> None:
        """Store the complete group held by ``slot``; called at most once per slot."""

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        """Forget ``slot``: its attempt failed with ``error``. Must not raise for an unknown slot."""


class InMemorySink:
    """Keeps committed groups in a list, in commit order, and the last error of each prompt."""

    def __init__(self) -> None:
        self.records: list[PromptGroupRecord] = []
        self.reserved: dict[str, int] = {}
        self.discarded: list[str] = []
        self.last_error: dict[int, BaseException | None] = {}
        self._ids = itertools.count()

    def reserve(self, prompt_idx: int) -> str:
        slot = f"{prompt_idx}-{next(self._ids)}"
        self.reserved[slot] = prompt_idx
        return slot

    def commit(self, slot: str, record: PromptGroupRecord) -> None:
        if self.reserved.pop(slot, None) is None:
            raise KeyError(f"slot {slot!r} was not reserved, or was already committed or discarded")
        self.records.append(record)

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        prompt_idx = self.reserved.pop(slot, None)
        if prompt_idx is not None:
            self.discarded.append(slot)
            self.last_error[prompt_idx] = error
