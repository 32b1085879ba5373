"""The refit step: the policy's new weights into the serving engine, the new version on the manager, and
a direct check that the engine now holds them (its weight version and a weight fingerprint)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from gym_bridge.failures import RefitMismatch
from gym_bridge.models.fingerprint import fingerprint_mismatches, weight_fingerprint


class RefitTarget(Protocol):
    """An engine that takes new weights in place (``HFGeneration``)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> object: ...


class RefitSource(Protocol):
    """A policy that hands out its current weights by name (``HFPolicy``)."""

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]: ...


class VersionTagger(Protocol):
    """Tags the groups it rolls out from now on with a weight version (``RolloutManager``)."""

    def set_weight_version(self, version: int) -> None: ...


def refit(policy: RefitSource, engine: RefitTarget, version: int, manager: VersionTagger | None = None) -> float:
    """Load ``policy``'s weights into ``engine`` as ``version``; tag later rollouts with it. Returns seconds."""
    started = time.perf_counter()
    engine.update_weights(policy.state_dict_for_refit(), version)
    if manager is not None:
        manager.set_weight_version(version)
    return time.perf_counter() - started


def check_refit(policy: RefitSource, engine: object, version: int, *, step: int) -> dict[str, bool]:
    """Raise :class:`RefitMismatch` unless ``engine`` reports ``version`` and the policy's weight fingerprint.

    An engine without ``weight_version`` or ``weight_fingerprint`` (a remote vLLM) is checked on what it
    has; the returned metrics say what was checked.
    """
    checked = {"refit/version_checked": False, "refit/fingerprint_checked": False}
    engine_version = getattr(engine, "weight_version", None)
    if engine_version is not None:
        checked["refit/version_checked"] = True
        if int(engine_version) != version:
            raise RefitMismatch(
                f"step {step}: after the refit the engine serves weight version {engine_version}, expected {version}"
            )
    fingerprint = getattr(engine, "weight_fingerprint", None)
    if callable(fingerprint):
        checked["refit/fingerprint_checked"] = True
        differ = fingerprint_mismatches(weight_fingerprint(policy.state_dict_for_refit()), fingerprint())
        if differ:
            raise RefitMismatch(
                f"step {step}: the engine reports weight version {version} but {len(differ)} parameter(s) differ "
                f"from the trained policy (first: {', '.join(differ[:3])}); the refit did not reach the engine"
            )
    return checked
