"""What a checkpoint holds besides the weights: :class:`TrainerState` (step, version, counters, prompt queue),
written beside the policy's files and read back on resume."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gym_bridge.training.prompts import PromptQueueState

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """What a checkpoint restores besides the weights and the optimizer."""

    step: int = 0
    weight_version: int = 0
    dropped_stale_total: int = 0
    requeued_total: int = 0
    prompts: PromptQueueState = field(default_factory=PromptQueueState)


def load_trainer_state(checkpoint_dir: Path) -> TrainerState | None:
    """The state saved with a checkpoint, or None when there is no complete checkpoint."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return TrainerState(**{**saved, "prompts": PromptQueueState(**saved.get("prompts", {}))})
