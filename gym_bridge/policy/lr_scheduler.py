"""NeMo-RL's ``policy.scheduler`` built into a torch learning-rate scheduler, as its DTensor policy worker builds it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch

from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonMapping


def _scheduler_class(name: object) -> type[torch.optim.lr_scheduler.LRScheduler]:
    """The learning-rate scheduler class a dotted name names (``torch.optim.lr_scheduler.LinearLR``)."""
    module_name, _, attr = str(name).rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        found = None
    if not (isinstance(found, type) and issubclass(found, torch.optim.lr_scheduler.LRScheduler)):
        raise SettingError(f"{name!r} is not a torch learning-rate scheduler class (torch.optim.lr_scheduler.*)")
    return found


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, spec: Sequence[JsonMapping] | JsonMapping | None
) -> torch.optim.lr_scheduler.LRScheduler:
    """NeMo-RL's scheduler from ``policy.scheduler``, as its DTensor policy worker builds it.

    A mapping ``{name, kwargs}`` is one scheduler; a list holds schedulers (``{name, kwargs}``) and one
    ``{milestones: [...]}`` entry, chained by ``SequentialLR`` (the milestones are the optimizer steps at which
    the next scheduler takes over); None is a constant rate (``LambdaLR`` of 1). A bad entry raises
    :class:`~gym_bridge.failures.errors.SettingError` saying which.
    """
    if spec is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda _: 1.0)
    if isinstance(spec, Mapping):
        spec = [spec]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
    milestones: list[int] | None = None
    for i, entry in enumerate(spec):
        if not isinstance(entry, Mapping):
            raise SettingError(f"entry {i} is not a mapping: {entry!r}")
        if "name" in entry:
            try:
                schedulers.append(_scheduler_class(entry["name"])(optimizer, **dict(entry.get("kwargs") or {})))
            except TypeError as exc:
                raise SettingError(f"entry {i} ({entry['name']}): {exc}") from None
        elif "milestones" in entry:
            milestones = [int(m) for m in entry["milestones"]]
        else:
            raise SettingError(f"entry {i} has neither 'name' nor 'milestones': {dict(entry)!r}")
    if not schedulers:
        raise SettingError("no scheduler named")
    if len(schedulers) == 1 and milestones is None:
        return schedulers[0]
    if milestones is None or len(milestones) != len(schedulers) - 1:
        raise SettingError(
            f"{len(schedulers)} schedulers need {len(schedulers) - 1} milestones in a {{milestones: [...]}} entry, "
            f"got {milestones}"
        )
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones)
