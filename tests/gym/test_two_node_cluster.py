"""A real two-node Ray cluster on one machine: ``ray start --head`` plus a second ``ray start --address``,
each node its own raylet with a custom resource; one NemoGym actor pinned to each node; one
``RolloutManager`` spreading prompt groups over both; the second node is killed mid-run and every group
still commits through the first, none lost, none duplicated (docs/nemo_gym.md, "Multi-node").

The test joins its own cluster (``ray.init(address=...)``), not the session Ray, so under xdist it runs in
the "local" lane, whose worker has no other Ray; it disconnects and stops the cluster at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.rollout.manager import RolloutOutcome
from gym_bridge.rollout.sink import InMemorySink
from gym_bridge.testing import async_wait_until
from gym_bridge.testing.cluster import LocalRayCluster, NodeSpec
from gym_bridge.testing.gym_rows import (
    EQUIVALENCE_AGENT,
    EQUIVALENCE_GYM_CONFIGS,
    N,
    gym_actor_config,
    make_manager,
    prompt,
)

logger = logging.getLogger(__name__)
pytestmark = [pytest.mark.timeout(900), pytest.mark.gym, pytest.mark.slow]

NODES = ("node_a", "node_b")  # the head, then the node this test kills
PROMPTS = 24
CONCURRENT_GROUPS = 2  # groups in flight at once: the manager gives each to the actor with fewer rows in flight


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    """Two nodes of one cluster, this process connected to it; disconnected and stopped at the end."""
    if ray.is_initialized():
        pytest.fail("this worker is already connected to a Ray; the two-node test must run in the local lane")
    with LocalRayCluster([NodeSpec(name) for name in NODES]) as started:
        started.connect()
        yield started
        nodes = list(started.nodes.values())
    assert not ray.is_initialized()
    left = [p.pid for node in nodes for p in node.processes()]
    assert not left, f"processes of the cluster survived its stop: {left}"


@pytest.fixture(scope="module")
def pinned_actors(cluster, scripted_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """One NemoGym actor (model server + equivalence agent) per node, pinned by the node's custom resource."""
    logs = tmp_path_factory.mktemp("two-node-gym")

    def spin(node: str) -> Any:
        config = gym_actor_config([scripted_policy.base_url], logs / node).model_copy(
            update={
                "config_paths": [str(wheel_config_path(p)) for p in EQUIVALENCE_GYM_CONFIGS],
                "request_timeout_s": 30.0,
                "health_poll_s": 0.5,
                "overrides": {"uvicorn_logging_show_200_ok": True},  # each served /run is a line in the agent's log
                "actor_options": {"num_cpus": 0, "resources": {node: 0.01}},
            }
        )
        return start_nemo_gym_actor(config, tiny_tokenizer)

    with ThreadPoolExecutor(len(NODES)) as pool:
        actors = dict(zip(NODES, pool.map(spin, NODES), strict=True))
    yield actors
    for node, actor in actors.items():
        try:
            if not cluster.nodes[node].killed:
                ray.get(actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(actor)


def served_rows(info: dict[str, Any]) -> int:
    """The /run calls an actor's Gym agent answered (from its access log)."""
    log = Path(info["log_dir"]) / f"{EQUIVALENCE_AGENT}.log"
    return log.read_text().count('"POST /run HTTP/1.1" 200') if log.exists() else 0


def raylet_of(pid: int) -> int | None:
    """The pid of the raylet above ``pid`` (its Ray worker's parent), or None."""
    for parent in psutil.Process(pid).parents():
        if parent.name() == "raylet":
            return parent.pid
    return None


async def test_groups_spread_over_two_nodes_and_survive_losing_one(cluster, pinned_actors, tiny_tokenizer):
    """Each actor's Gym runs under its own node's raylet; groups go to both; after node_b is SIGKILLed
    mid-run (raylet, agents, workers), every group is COMMITTED through node_a exactly once, the lost rows
    were re-sent, node_b is dead in the GCS and its Gym processes are gone."""
    infos = {node: await actor.server_info.remote() for node, actor in pinned_actors.items()}
    for node, info in infos.items():
        raylets = {raylet_of(pid) for pid in info["pids"]}
        assert raylets == {cluster.nodes[node].raylet_pid}, f"{node}'s Gym processes are not under its raylet"

    manager = make_manager([pinned_actors["node_a"], pinned_actors["node_b"]], tiny_tokenizer, rollout_s=120.0,
                           max_gym_row_attempts=2)
    sink = InMemorySink()
    slots = asyncio.Semaphore(CONCURRENT_GROUPS)

    async def one(k: int) -> RolloutOutcome:
        async with slots:
            return await manager.collect(prompt(k), sink)

    run = asyncio.gather(*(one(k) for k in range(PROMPTS)))
    def both_served() -> list[int] | None:
        served = [served_rows(info) for info in infos.values()]
        return served if len(sink.records) >= 4 and all(served) else None

    served_before = await async_wait_until(both_served, 120, "groups committed through both nodes", poll_s=0.05)
    # Freeze node_b's Gym so the rows it holds cannot finish; once two more groups commit through node_a, any row
    # node_b finished before the freeze has long been delivered, and what it still holds is really in flight.
    frozen = [p for p in map(_process, infos["node_b"]["pids"]) if p]
    for proc in frozen:
        proc.suspend()
    committed_at_freeze = len(sink.records)

    def node_b_holds_rows() -> bool:
        return len(sink.records) >= committed_at_freeze + 2 and manager.backend.in_flight_rows[1] > 0

    await async_wait_until(node_b_holds_rows, 120, "node_b holding rows while node_a commits", poll_s=0.05)
    committed_before = len(sink.records)
    killed = await asyncio.to_thread(cluster.kill_node, "node_b")
    killed_at = time.monotonic()
    for proc in frozen:  # resumed so they can see their node is gone and exit
        try:
            proc.resume()
        except psutil.NoSuchProcess:
            pass
    assert killed and cluster.nodes["node_b"].raylet_pid in killed
    outcomes = await asyncio.wait_for(run, 300)
    logger.info("node_b killed after %d groups (rows served per node %s); the other %d committed %.1fs later; %s",
                committed_before, served_before, PROMPTS - committed_before, time.monotonic() - killed_at,
                {k: v for k, v in manager.stats.as_metrics().items() if v})

    assert committed_before < PROMPTS, "the kill came after the run: nothing was left to fail over"
    assert outcomes == [RolloutOutcome.COMMITTED] * PROMPTS, f"last error: {sink.last_error}"
    assert sorted(r.prompt_idx for r in sink.records) == list(range(PROMPTS)), "a group was lost or doubled"
    assert not sink.reserved
    for record in sink.records:
        assert len(record.completions) == N and all(c.reward == 1.0 for c in record.completions)
    metrics = manager.stats.as_metrics()
    assert metrics.get("rollout/gym_row_redispatch_total", 0) > 0, "no row was in flight on the dead node"
    assert served_rows(infos["node_a"]) > served_before[0]

    dead = cluster.nodes["node_b"].node_id
    await async_wait_until(lambda: dead not in cluster.alive_node_ids(), 60, "node_b marked dead by the GCS")
    _, alive = psutil.wait_procs([p for p in map(_process, infos["node_b"]["pids"]) if p], timeout=30)
    assert not alive, f"node_b's Gym processes outlived it: {[p.pid for p in alive]}"
    await pinned_actors["node_a"].health_check.remote()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
