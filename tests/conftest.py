"""Session-wide fixtures: one real Ray cluster and one tiny model per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, built once per session into a private cache folder."""
    from gym_bridge.models.tiny import build_tiny_model

    return build_tiny_model(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct, built once into the default cache (``$GYM_BRIDGE_CACHE`` or ~/.cache/gym-bridge).

    The default cache, not a private one: the ~1 min build is then shared by every session and process.
    """
    from gym_bridge.models.smollm2 import build_smollm2

    return build_smollm2()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A real local Ray cluster, started once for the whole session."""
    import ray

    from gym_bridge.ray_utils import init_ray

    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ray workers cannot import test modules: ship their actors and helpers by value."""
    import ray.cloudpickle

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        ray.cloudpickle.register_pickle_by_value(module)
