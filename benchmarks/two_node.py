"""Two-node throughput: rows/s of one RolloutManager over 1 NemoGym actor vs 2 actors, one per node of a real
two-node Ray cluster on this machine (``ray start --head`` + ``ray start --address``, :mod:`gym_bridge.testing.cluster`).

What runs, all on 127.0.0.1: the two-node cluster (custom resources ``node_a`` / ``node_b``), this process
joined to it; our server with ``InstantGeneration`` (``gym-bridge serve --policy instant``, a fixed 16-token
answer, no model) in its own process; one NemoGym actor pinned to each node, each with its own Gym servers
(gym-bridge's model server + ``equivalence_rule`` lc, single-turn rows). The same groups of 16 rows, all in
flight at once, go through a manager over the node_a actor alone and through a manager over both actors
(interleaved, median of ``--reps`` after a warm-up of each). A dated section goes to
``benchmarks/history/<date>-two-node-cluster.md``.

On one machine both nodes share its cores, so two actors cannot be faster in wall time here: the row measures
what spreading over nodes costs (cross-node Ray plumbing, a second Gym set), not a scale-out.

Run: ``uv run python benchmarks/two_node.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

from bridge_throughput import (
    GROUP,
    RUN_TIMEOUT_S,
    WORKLOADS,
    EndpointProcess,
    gym_config,
)
from results_file import HISTORY, git_revision, publish
from transformers import AutoTokenizer

from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RolloutTimeouts
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.testing.cluster import LocalRayCluster, NodeSpec

SINGLE = WORKLOADS["single"]  # single-turn equivalence rows, instant answers
NODES = ("node_a", "node_b")
log = logging.getLogger("bench-two-node")


def manager(actors: list[Any], tokenizer: Any) -> RolloutManager:
    return RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"nemo_gym": actors},
        num_generations_per_prompt=GROUP,
        max_seq_len=4096,
        generation_config=SINGLE.generation_config,
        use_nemo_gym=True,
        timeouts=RolloutTimeouts(rollout_s=RUN_TIMEOUT_S - 30),
    )


async def rows_per_s(rollouts: RolloutManager, rows: int) -> float:
    """Roll out ``rows`` rows (groups of 16, all launched at once); rows per second of wall time."""
    data = [datum_from_gym_row(row, idx=i) for i, row in enumerate(SINGLE.templates(rows // GROUP))]
    started = time.perf_counter()
    records = await asyncio.wait_for(asyncio.gather(*(rollouts.run_rollout(d) for d in data)), RUN_TIMEOUT_S)
    wall = time.perf_counter() - started
    if sum(len(r.completions) for r in records) != rows:
        raise RuntimeError("incomplete groups")
    return rows / wall


def run(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    endpoint = EndpointProcess(free_port("127.0.0.1"), workdir / "endpoint.log")
    actors: dict[str, Any] = {}
    with LocalRayCluster([NodeSpec(name) for name in NODES]) as cluster:
        cluster.connect()
        try:
            endpoint.start("instant")

            def spin(node: str) -> Any:
                config = gym_config(endpoint.base_url, workdir / node, SINGLE).model_copy(
                    update={"actor_options": {"num_cpus": 0, "resources": {node: 0.01}}}
                )
                return start_nemo_gym_actor(config, tokenizer)

            with ThreadPoolExecutor(len(NODES)) as pool:
                for node, actor in zip(NODES, pool.map(spin, NODES), strict=True):
                    actors[node] = actor
            managers = {1: manager([actors["node_a"]], tokenizer), 2: manager(list(actors.values()), tokenizer)}
            results: dict[str, list[float]] = {"1": [], "2": []}

            async def measure() -> None:
                for m in managers.values():  # warm-up: connections, first conversion
                    await rows_per_s(m, args.rows)
                for rep in range(args.reps):
                    for n, m in managers.items():
                        value = await rows_per_s(m, args.rows)
                        results[str(n)].append(value)
                        log.info("rep %d, %d actor(s): %.1f rows/s", rep + 1, n, value)

            asyncio.run(measure())
            return results
        finally:
            for actor in actors.values():
                stop_nemo_gym_actors([actor])
            endpoint.stop()


def markdown(results: dict[str, list[float]], args: argparse.Namespace, load: tuple[Any, Any]) -> str:
    before, after = (" / ".join(f"{x:.2f}" for x in avg) for avg in load)
    one, two = (statistics.median(results[k]) for k in ("1", "2"))

    def spread(k: str) -> str:
        return f"{min(results[k]):.1f}–{max(results[k]):.1f}"

    return f"""
## Two-node cluster, {date.today().isoformat()} ({os.cpu_count()} cores, {platform.machine()}, {git_revision()})

Load average before {before}, after {after} (1 / 5 / 15 min). A two-node Ray cluster on this one machine
(`ray start --head` + `ray start --address`, custom resources `node_a` / `node_b`, `gym_bridge.testing.cluster`);
one NemoGym actor pinned to each node, each with its own Gym servers (gym-bridge's model server +
equivalence_rule lc, single-turn rows); our server with InstantGeneration (16-token answer, no model) in
its own process. {args.rows} rows (groups of {GROUP}) launched at once through one RolloutManager; median of
{args.reps} interleaved runs after a warm-up.

| actors (nodes) | rows/s (min–max) | vs 1 actor |
|---|---|---|
| 1 (node_a) | {one:.1f} ({spread("1")}) | 1.00 |
| 2 (node_a + node_b) | {two:.1f} ({spread("2")}) | {two / one:.2f} |

Both nodes share this machine's {os.cpu_count()} cores, so the second node brings no CPU: the row shows the cost
of spreading groups over two nodes (a second Gym set and actor event loop, cross-node Ray messages), not a
scale-out. A second Gym set can still help a little here, since Gym's busiest server is one process and
two sets spread that work over both cores. On separate machines each node brings its own cores.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help=f"rows per run, a multiple of {GROUP} (default 256)")
    parser.add_argument("--reps", type=int, default=3, help="measured runs per setting (default 3)")
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not append to {HISTORY.name}/")
    args = parser.parse_args()
    if args.rows % GROUP:
        parser.error(f"--rows must be a multiple of {GROUP}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    workdir = Path(tempfile.mkdtemp(prefix="bench-two-node-"))
    load_before = os.getloadavg()
    results = run(args, workdir)
    text = markdown(results, args, (load_before, os.getloadavg()))
    publish(text, topic="two-node-cluster", write=not args.no_write)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
