"""Our suite's fixtures come from the public plugin (gym_bridge.testing), registered here once, so each
session fixture (Ray, the tiny model, the scripted policy, the default Gym actor) exists once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["gym_bridge.testing"]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ray workers cannot import test modules: ship their actors and helpers by value."""
    import ray.cloudpickle

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        ray.cloudpickle.register_pickle_by_value(module)
