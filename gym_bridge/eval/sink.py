"""``RunStoreSink``: the eval's :class:`~gym_bridge.rollout.sink.RolloutSink` over the run folder.

A committed group becomes one ``results.jsonl`` line at once (flushed and fsynced by
the store); a failed attempt writes nothing, and its error is kept so a prompt the
retry policy skips gets exactly one ``failures.jsonl`` line (:meth:`record_skip`).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from gym_bridge.eval.dataset import DatasetRow
from gym_bridge.eval.records import failure_record, group_record
from gym_bridge.eval.store import RunStore

if TYPE_CHECKING:  # torch stays out until the run loop: a refused config or dataset stops before it
    from gym_bridge.types import PromptGroupRecord, Tokenizer


class RunStoreSink:
    """Writes committed groups of the given dataset rows to ``store``."""

    def __init__(self, store: RunStore, rows: list[DatasetRow], tokenizer: Tokenizer) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self._rows = {row.prompt_idx: row for row in rows}
        self._slots: dict[str, int] = {}
        self._started: dict[int, float] = {}
        self._last_error: dict[int, BaseException | None] = {}
        self.rewards: dict[int, list[float]] = {}
        """Rewards of each committed prompt, for progress display."""
        self._ids = itertools.count()

    def reserve(self, prompt_idx: int) -> str:
        if prompt_idx not in self._rows:
            raise KeyError(f"prompt_idx={prompt_idx} is not a pending row of this run")
        self._started.setdefault(prompt_idx, time.perf_counter())
        slot = f"{prompt_idx}-{next(self._ids)}"
        self._slots[slot] = prompt_idx
        return slot

    def commit(
        self, slot: str, record: PromptGroupRecord, *, start_weight_version: int, end_weight_version: int
    ) -> None:
        prompt_idx = self._slots.pop(slot)
        row = self._rows[prompt_idx]
        line = group_record(
            record, agent=row.agent, line=row.line, tokenizer=self.tokenizer, elapsed_s=self._elapsed(prompt_idx)
        )
        line["start_weight_version"] = start_weight_version
        line["end_weight_version"] = end_weight_version
        self.store.append_result(line)
        self.rewards[prompt_idx] = [c["reward"] for c in line["completions"]]

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        prompt_idx = self._slots.pop(slot, None)
        if prompt_idx is not None:
            self._last_error[prompt_idx] = error

    def record_skip(self, prompt_idx: int, error: BaseException | None = None) -> None:
        """One ``failures.jsonl`` line for a prompt given up on: ``error``, else its last attempt's."""
        row = self._rows[prompt_idx]
        error = error or self._last_error.get(prompt_idx) or RuntimeError("skipped without a recorded error")
        self.store.append_failure(
            failure_record(
                error, prompt_idx=prompt_idx, agent=row.agent, line=row.line, elapsed_s=self._elapsed(prompt_idx)
            )
        )

    def _elapsed(self, prompt_idx: int) -> float:
        return time.perf_counter() - self._started.get(prompt_idx, time.perf_counter())
