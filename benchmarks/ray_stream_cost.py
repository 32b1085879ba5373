"""What one Ray actor call and one streamed element cost in CPU, driver and actor side, on this machine.

The bridge's rows travel from the NemoGym actor to the driver as elements of a streaming actor call
(``num_returns="streaming"``, awaited on the driver's asyncio loop), one call per prompt group. This
measures that transport alone, with a trivial async actor yielding ``items`` elements of ``rows / items``
200-byte payloads: CPU ms per call and per element of the driver and of the actor process. It is the floor
under ``make bench-bridge``'s driver + actor CPU per row, whatever gym-bridge does with the rows.

    uv run python benchmarks/ray_stream_cost.py [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from datetime import date

import psutil
import ray
from results_file import git_revision, publish

ROWS = 16  # one prompt group
CASES = [(64, 1), (64, 4), (64, 16)]  # (concurrent calls, elements per call)
REPS = 3


@ray.remote(num_cpus=0)
class Streamer:
    def pid(self) -> int:
        return os.getpid()

    async def stream(self, rows: int, items: int):  # type: ignore[no-untyped-def]
        for _ in range(items):
            yield [b"x" * 200] * (rows // items)


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def drain(actor: ray.actor.ActorHandle, calls: int, items: int) -> None:
    async def one() -> None:
        async for ref in actor.stream.options(num_returns="streaming").remote(ROWS, items):
            await ref

    await asyncio.gather(*(one() for _ in range(calls)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = Streamer.remote()
        driver, remote = psutil.Process(), psutil.Process(ray.get(actor.pid.remote(), timeout=60))
        lines = [
            f"\n## Ray streaming cost, {date.today()} ({psutil.cpu_count()} cores, {platform.machine()}, "
            f"Python {platform.python_version()}, ray {ray.__version__}, {git_revision()})\n",
            f"Load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}. A group of {ROWS} rows "
            f"in 1, 4 or {ROWS} streamed elements; {REPS} rounds of each after a warm-up.\n",
            "| calls at once | elements per call | driver ms / call | actor ms / call | driver + actor ms / row |",
            "|---|---|---|---|---|",
        ]
        for calls, items in CASES:
            asyncio.run(drain(actor, calls, items))
            d0, a0 = cpu_s(driver), cpu_s(remote)
            for _ in range(REPS):
                asyncio.run(drain(actor, calls, items))
            d, a = (cpu_s(driver) - d0) * 1e3 / (REPS * calls), (cpu_s(remote) - a0) * 1e3 / (REPS * calls)
            lines.append(f"| {calls} | {items} | {d:.2f} | {a:.2f} | {(d + a) / ROWS:.3f} |")
    finally:
        ray.shutdown()
    publish("\n".join(lines) + "\n", topic="ray-streaming-cost", write=not args.no_write)


if __name__ == "__main__":
    main()
