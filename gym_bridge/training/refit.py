"""The refit step: the policy's new weights into the serving engine, then the new version on the manager."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class RefitTarget(Protocol):
    """An engine that takes new weights in place (``HFGeneration``)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Any: ...


class RefitSource(Protocol):
    def state_dict_for_refit(self) -> dict[str, torch.Tensor]: ...


def refit(policy: RefitSource, engine: RefitTarget, version: int, manager: Any = None) -> float:
    """Load ``policy``'s weights into ``engine`` as ``version``; tag later rollouts with it. Returns seconds."""
    started = time.perf_counter()
    engine.update_weights(policy.state_dict_for_refit(), version)
    if manager is not None:
        manager.set_weight_version(version)
    return time.perf_counter() - started
