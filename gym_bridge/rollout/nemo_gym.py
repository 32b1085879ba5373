"""The NeMo-Gym rollout backend (registered as ``nemo_gym``).

The NeMo-Gym path (the NemoGym actor and real Gym servers) lands in its own
change; until then the name is registered so configs can refer to it, and
constructing it says clearly that it is not available yet.
"""

from __future__ import annotations

from typing import Any

from gym_bridge.types import DatumSpec, PromptGroupRecord


class BackendNotAvailableError(NotImplementedError):
    """The backend is registered but not implemented in this version."""


class AsyncNemoGymRolloutImpl:
    """Rolls out one prompt through NeMo-Gym servers (not available yet)."""

    def __init__(self, **kwargs: Any) -> None:
        raise BackendNotAvailableError(
            "the 'nemo_gym' rollout backend is registered but not available yet in this version "
            "of gym-bridge; use backend='native' for now"
        )

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        raise BackendNotAvailableError("the 'nemo_gym' rollout backend is not available yet")
