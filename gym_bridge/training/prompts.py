"""The order prompts are trained in: the dataset shuffled per epoch with ``grpo.seed``, and prompts queued
again when their group was dropped (too stale) or never committed."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gym_bridge.failures.errors import SettingError
from gym_bridge.types import DatumSpec


@dataclass
class PromptQueueState:
    """What a checkpoint keeps: how far into the shuffled stream, the next ``idx``, the prompts to redo."""

    position: int = 0
    next_idx: int = 0
    requeued: list[int] = field(default_factory=list)
    """Dataset indices queued again, drawn before new ones."""


class PromptQueue:
    """Draws prompts with a run-unique ``idx``; remembers which dataset entry each ``idx`` came from."""

    def __init__(
        self, dataset: Sequence[DatumSpec], *, seed: int, shuffle: bool = True, state: PromptQueueState | None = None
    ) -> None:
        if not dataset:
            raise SettingError("the training dataset is empty")
        self.dataset = list(dataset)
        self.seed, self.shuffle = seed, shuffle
        self.state = state or PromptQueueState()
        self.in_flight: dict[int, int] = {}
        """``idx`` of every drawn prompt not yet settled -> its dataset index."""
        self._orders: dict[int, list[int]] = {}

    def _dataset_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.dataset)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return order[offset]

    def draw(self, count: int) -> list[DatumSpec]:
        """``count`` prompts: requeued ones first, then the shuffled stream."""
        out: list[DatumSpec] = []
        for _ in range(count):
            if self.state.requeued:
                index = self.state.requeued.pop(0)
            else:
                index = self._dataset_index(self.state.position)
                self.state.position += 1
            idx = self.state.next_idx
            self.state.next_idx += 1
            self.in_flight[idx] = index
            out.append({**self.dataset[index], "idx": idx})
        return out

    def settle(self, idx: int) -> None:
        """The group of ``idx`` was trained on."""
        self.in_flight.pop(idx, None)

    def requeue(self, idxs: Iterable[int]) -> int:
        """Queue the prompts of these ``idx`` again (dropped or lost groups); returns how many."""
        count = 0
        for idx in idxs:
            index = self.in_flight.pop(idx, None)
            if index is not None:
                self.state.requeued.append(index)
                count += 1
        return count

    def checkpoint_state(self) -> PromptQueueState:
        """The state to save: prompts still in flight count as requeued (their rollouts die with the run)."""
        return PromptQueueState(
            position=self.state.position,
            next_idx=self.state.next_idx,
            requeued=[*self.state.requeued, *self.in_flight.values()],
        )
