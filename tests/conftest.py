"""Our suite's fixtures come from the public plugin (gym_bridge.testing), registered here once, so each
session fixture (Ray, the tiny model, the scripted policy, the default Gym actor) exists once per session.

The modules that share the session Gym (``gym_actor``) run one after another, and the Gym stops right
after the last test that uses it instead of idling to the end of the session. So do the end-to-end flows that
run ``gym-bridge eval`` in a subprocess joined to one Ray (``eval_ray_env``) instead of each starting its own.

Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) the suite runs in two lanes, one per
worker: every module that needs the session Ray, so Ray and each Gym set start once, in one worker;
every other module (subprocess end-to-end runs with their own Ray, model builds, unit tests) in the
other, except the few ``BALANCING_MODULES`` that even out the two lanes' totals. A lane keeps collection
order, so each module's fixtures are set up once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["gym_bridge.testing"]

SHARED_GYM = "gym_actor"
SHARED_EVAL_RAY = "eval_ray_env"
SHARED = (SHARED_GYM, SHARED_EVAL_RAY)
"""Session fixtures whose users run one after another and which stop right after their last user."""
RAY_LANE, LOCAL_LANE = "ray", "local"
GYM_LAYER_MODULES = ("test_gym_", "test_nemo_gym")  # with the gym-marked tests: what the compat lanes run
BALANCING_MODULES = ("test_cli_errors.py", "test_kv_cache.py", "test_shared_prefix.py")
"""Modules that need no Ray but run in the Ray lane: the local lane holds every end-to-end flow with a Ray of its own
or the evals' (``eval_ray_env``), so these even out the lane totals ``make test`` prints."""
_LAST_USERS = pytest.StashKey[dict[str, pytest.Item]]()


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny model's (tokenizer, model) in float32 eval mode, loaded once per module; its engines share them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return AutoTokenizer.from_pretrained(tiny_model_dir), model


@pytest.fixture(scope="module")
def tiny_sampling_policy(tiny_lm: tuple[Any, Any]) -> Iterator[Any]:
    """Our server over the tiny model sampling at temperature 1 (24 new tokens, seeded engine), for one module."""
    from gym_bridge.generation.hf import HFGeneration
    from gym_bridge.generation.hf_config import HFGenerationConfig
    from gym_bridge.serving import OpenAIServer
    from gym_bridge.testing import SERVED_MODEL_NAME

    tokenizer, model = tiny_lm
    generation = HFGeneration(
        HFGenerationConfig(max_new_tokens=24, temperature=1.0, seed=0), model=model, tokenizer=tokenizer
    )
    server = OpenAIServer(generation, tokenizer, served_model_name=SERVED_MODEL_NAME)
    server.start_in_thread()
    yield server
    server.stop_thread()
    generation.shutdown()


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct, built once into the default cache (``$GYM_BRIDGE_CACHE`` or ~/.cache/gym-bridge).

    The default cache, not a private one: the ~1 min build is then shared by every session and process.
    """
    from gym_bridge.models.smollm2 import build_smollm2

    return build_smollm2()


@pytest.fixture(scope="session")
def eval_ray_env() -> Iterator[dict[str, str]]:
    """The environment for ``gym-bridge eval`` subprocesses that join one Ray instead of each starting its own:
    ``RAY_ADDRESS`` of a one-node cluster (``ray start``) of this worker's lane. Its users run one after another
    and it stops after the last of them. This worker itself never joins it, so the module stays in its lane."""
    from gym_bridge.testing.cluster import LocalRayCluster, NodeSpec

    with LocalRayCluster([NodeSpec("evals", num_cpus=2, object_store_memory=256 * 1024**2)]) as cluster:
        yield {
            **os.environ,
            "RAY_ADDRESS": cluster.address,
            "RAY_AUTH_MODE": "disabled",  # as the cluster was started (gym_bridge.testing.cluster)
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]):
    """Ship test modules to Ray workers by value; split the modules into the two xdist lanes (before any
    other implementation runs: xdist reads the lanes in its own); then group the shared Gym's users and
    note the last of them (after pytest's own reordering)."""
    import ray.cloudpickle

    modules = {getattr(item, "module", None) for item in items} - {None}
    for module in modules:  # Ray workers cannot import test modules: ship their actors and helpers by value
        ray.cloudpickle.register_pickle_by_value(module)

    ray_modules = {
        getattr(item, "module", None) for item in items if "ray_session" in getattr(item, "fixturenames", ())
    }
    for item in items:  # two lanes of whole modules: each module's fixtures are set up once, in one worker
        in_ray_lane = getattr(item, "module", None) in ray_modules or item.path.name in BALANCING_MODULES
        lane = RAY_LANE if in_ray_lane else LOCAL_LANE
        item.add_marker(pytest.mark.xdist_group(lane))
        if item.get_closest_marker("gym") or item.path.name.startswith(GYM_LAYER_MODULES):
            item.add_marker(pytest.mark.gym_layer)
    result = yield

    for fixture in SHARED:  # each shared fixture's modules one after another, where its first user runs
        users = {getattr(item, "module", None) for item in items if _uses(item, fixture)}
        first = next((i for i, item in enumerate(items) if getattr(item, "module", None) in users), None)
        if first is not None:
            rank: dict[object, int] = {}
            for i, item in enumerate(items):
                module = getattr(item, "module", None)
                rank.setdefault(module, first if module in users else i)
            items.sort(key=lambda item: rank[getattr(item, "module", None)])  # stable: file order inside a module
    last = {fixture: next((item for item in reversed(items) if _uses(item, fixture)), None) for fixture in SHARED}
    config.stash[_LAST_USERS] = {fixture: item for fixture, item in last.items() if item is not None}
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test that uses a shared session fixture (the session Gym, the evals' Ray), stop it right away."""
    result = yield
    if nextitem is not None:
        for fixture, last in item.config.stash.get(_LAST_USERS, {}).items():
            if item is last:
                for fixturedef in item._fixtureinfo.name2fixturedefs.get(fixture, ()):  # type: ignore[attr-defined]
                    if fixturedef.scope == "session":
                        fixturedef.finish(item._request)  # type: ignore[attr-defined]
    return result


_lane_totals: dict[str, tuple[float, int]] = {}
"""lane -> (seconds of setup, call and teardown, tests): what the xdist controller saw of each lane."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's phases to its lane's total (the ``@lane`` suffix loadgroup puts on a test's id)."""
    if "@" in report.nodeid:
        lane = report.nodeid.rpartition("@")[2]
        seconds, tests = _lane_totals.get(lane, (0.0, 0))
        _lane_totals[lane] = (seconds + report.duration, tests + (report.when == "call"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each lane's total: the suite takes as long as its longer lane, so these are what to balance."""
    if _lane_totals:
        lanes = ", ".join(f"{lane} {s:.0f} s ({n} tests)" for lane, (s, n) in sorted(_lane_totals.items()))
        terminalreporter.write_line(f"lane totals: {lanes}")
