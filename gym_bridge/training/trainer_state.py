"""What a checkpoint holds besides the weights: :class:`TrainerState` (step, version, counters, prompt queue),
written beside the policy's files and read back on resume.

Checkpoints are passed around, so :func:`load_trainer_state` reads ``trainer_state.json`` as untrusted input, through
the trust boundary (:mod:`gym_bridge.boundary`): a regular file under :data:`MAX_STATE_BYTES`, JSON nested at most
:data:`STATE_DEPTH` levels, of exactly these fields with counts in range; anything else is one
:class:`~gym_bridge.failures.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import loads_object
from gym_bridge.boundary.text import shown
from gym_bridge.failures.errors import CheckpointError
from gym_bridge.models.loading import read_checkpoint_bytes
from gym_bridge.training.prompts import PromptQueueState

STATE_FILE = "trainer_state.json"
MAX_STATE_BYTES = 64 * 2**20
"""The largest ``trainer_state.json`` read: the prompt queue lists at most a few million dataset indices."""
STATE_DEPTH = 3
"""How deeply ``trainer_state.json`` nests: the state, its prompt queue, the queue's list of indices."""
MAX_COUNT = 2**53
"""The largest count a state field may hold (JSON numbers are exact up to here)."""


@dataclass
class TrainerState:
    """What a checkpoint restores besides the weights and the optimizer."""

    step: int = 0
    weight_version: int = 0
    dropped_stale_total: int = 0
    requeued_total: int = 0
    prompts: PromptQueueState = field(default_factory=PromptQueueState)


def load_trainer_state(checkpoint_dir: Path) -> TrainerState | None:
    """The state saved with a checkpoint, or None when there is no complete checkpoint (no state file).

    Raises:
        CheckpointError: the state file is not a regular file, is over :data:`MAX_STATE_BYTES`, is not JSON, or
            does not hold exactly :class:`TrainerState`'s fields as counts.
    """
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.exists() and not path.is_symlink():
        return None
    data = read_checkpoint_bytes(path, MAX_STATE_BYTES)
    try:
        saved = loads_object(data, shown(path), max_depth=STATE_DEPTH)
    except UntrustedInputError as exc:  # not JSON, not an object, nested too deeply
        raise CheckpointError(str(exc)) from None
    return _trainer_state(saved, shown(path))


def _counts(saved: object, names: list[str], where: str) -> dict[str, int]:
    """The counts ``names`` of a JSON object holding exactly those keys (a missing one is 0)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise CheckpointError(f"{where}: unknown field {unknown[0][:60]!r}")
    for name in names:
        value = saved.get(name, 0)
        if type(value) is not int or not 0 <= value <= MAX_COUNT:
            raise CheckpointError(f"{where}: {name} is {str(value)[:40]!r}, not a count from 0 to {MAX_COUNT}")
    return {name: saved.get(name, 0) for name in names}


def _prompt_queue_state(saved: object, where: str) -> PromptQueueState:
    """The prompt queue's saved state: two counts and a list of dataset indices."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    requeued = saved.get("requeued", [])
    if not isinstance(requeued, list) or not all(type(i) is int and 0 <= i <= MAX_COUNT for i in requeued):
        raise CheckpointError(f"{where}: requeued is not a list of dataset indices")
    counts = _counts({k: v for k, v in saved.items() if k != "requeued"}, ["position", "next_idx"], where)
    return PromptQueueState(requeued=list(requeued), **counts)


def _trainer_state(saved: dict[str, object], where: str) -> TrainerState:
    """A :class:`TrainerState` from the parsed ``trainer_state.json`` (named ``where``), every field checked."""
    names = [f.name for f in fields(TrainerState) if f.name != "prompts"]
    prompts = _prompt_queue_state(saved.get("prompts", {}), f"{where}: prompts")
    counts = _counts({k: v for k, v in saved.items() if k != "prompts"}, names, where)
    return TrainerState(prompts=prompts, **counts)
