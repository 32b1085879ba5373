"""Gym set start-up and stop: servers forked from the launcher's fork server vs a fresh ``python app.py`` each.

What runs, all on 127.0.0.1: one ``GymServers`` set of five servers (the vllm_model policy server,
example_single_tool_call's agent and resources server, equivalence_rule lc's agent and resources server),
started and stopped ``--reps`` times per setting, interleaved: ``fork_servers`` True / False, each without
Ray and joined to a local Ray. Start is ``GymServers.start()`` until every server answers. CPU (user +
system, read just before the stop) is the servers' own, and the whole set's (launcher, fork server and
helpers included). Stop is ``GymServers.stop()`` until no process is left. A dated section goes to
``benchmarks/history/<date>-gym-set-start-up.md``.

Run: ``uv run python benchmarks/gym_startup.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil
import ray
from results_file import HISTORY, git_revision, publish

from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.server_config import GymServersConfig
from gym_bridge.gym.servers.server_set import GymServers
from gym_bridge.ray_utils import init_ray

CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "resources_servers/equivalence_rule/configs/lc.yaml",
]


def _cpu(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(fork: bool, use_ray: bool, log_dir: Path) -> tuple[float, float, float, float]:
    """(start s, servers' CPU s, the whole set's CPU s, stop s) of one five-server set."""
    servers = GymServers(
        GymServersConfig(
            config_paths=[str(wheel_config_path(p)) for p in CONFIGS],
            policy_base_urls=["http://127.0.0.1:9/v1"],  # never called: nothing is rolled out
            policy_model_name="bench",
            use_ray=use_ray,
            fork_servers=fork,
            log_dir=log_dir,
        )
    )
    t0 = time.monotonic()
    servers.start()
    started = time.monotonic() - t0
    cpu = _cpu(set(servers.server_pids.values()))
    set_cpu = _cpu(servers.pids())
    t0 = time.monotonic()
    servers.stop()
    return started, cpu, set_cpu, time.monotonic() - t0


Results = dict[tuple[bool, bool], list[tuple[float, float, float, float]]]
"""(fork_servers, use_ray) -> one (start, servers' CPU, set's CPU, stop) per run."""


def markdown(results: Results, args: argparse.Namespace) -> str:
    def cell(key: tuple[bool, bool], i: int) -> str:
        values = [r[i] for r in results[key]]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    rows = "\n".join(
        f"| {'joined to a Ray' if ray else 'no Ray'} | {'forked' if fork else 'shell'} | "
        f"{cell((fork, ray), 0)} | {cell((fork, ray), 1)} | {cell((fork, ray), 2)} | {cell((fork, ray), 3)} |"
        for ray in (False, True)
        for fork in (False, True)
    )
    machine = f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, {git_revision()}"
    return f"""

## Gym set start-up, {date.today()} ({machine})

One `GymServers` set of five servers (vllm_model policy server, example_single_tool_call agent + resources,
equivalence_rule lc agent + resources), started until every server answers and stopped until nothing is
left; median (min-max) of {args.reps} interleaved runs per setting. CPU at the stop: the five servers' own,
and the whole set's (launcher, fork server and helpers included).

| Ray | servers | start (s) | servers' CPU (s) | the set's CPU (s) | stop (s) |
|---|---|---|---|---|---|
{rows}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs per setting (default 3)")
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not append to {HISTORY.name}/")
    args = parser.parse_args()
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="bench-gym-startup-") as workdir:
        try:
            for use_ray in (False, True):
                if use_ray:
                    init_ray(num_cpus=os.cpu_count())
                for rep in range(args.reps):
                    for fork in (False, True):
                        log_dir = Path(workdir) / f"{use_ray}-{fork}-{rep}"
                        results.setdefault((fork, use_ray), []).append(measure(fork, use_ray, log_dir))
        finally:
            ray.shutdown()
    text = markdown(results, args)
    publish(text, topic="gym-set-start-up", write=not args.no_write)


if __name__ == "__main__":
    main()
