"""Rows in flight at scale: 1,024 groups of 16 (16,384 rows) through one NemoGym actor and one manager.

What runs, all on 127.0.0.1 (the pieces are ``bridge_throughput.py``'s, imported from it):

- Ray (``init_ray``); our server with the instant policy (a fixed 16-token answer, no
  model) in a subprocess (``gym-bridge serve --policy instant``);
- ONE NemoGym actor with one set of Gym servers (``--model-server``, default gym-bridge's
  own; ``equivalence_rule`` lc, single-turn rows), optionally with ``num_workers`` uvicorn
  workers for the agent and the resources server (``--agent-workers``, ``--resources-workers``);
- ONE ``RolloutManager(use_nemo_gym=True)``; every group is launched at once with
  ``manager.collect(datum, sink)`` into a sink that writes one JSON line per committed
  group and keeps only counters.

Recorded: wall time and rows/s; that every row is accounted for (committed groups x group
size == rows written, no prompt committed twice, failures counted by type); the resident
memory of the driver and the actor at idle (after a warm-up), peak and end, sampled every
``--sample-s``, and at 25/50/75/100 % of the groups committed (memory that grows with the
run, not with what is in flight, shows as a rise across those points); the driver's
event-loop lag (a 10 ms ticker: p50/p99/max, and the worst tick's CPU); the number of
asyncio tasks on the driver's loop over time; garbage-collector pauses. A dated section
goes to ``benchmarks/history/<date>-rows-in-flight-at-scale.md``.

Deadlines: a row waits behind every other row in flight (16,384 rows at ~50 rows/s on two
cores is ~6 minutes), so the group deadline (``rollout_s``) and the actor's ``/run`` bound
(``request_timeout_s``) are set from the run's size: ``--deadline-s`` (default
``120 + rows / 10`` seconds, i.e. a floor of 10 rows/s) instead of the library's defaults.

Run: ``make bench-scale`` (or ``uv run python benchmarks/scale_rows.py --help``; develop with ``--groups 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, TextIO

import psutil
from bridge_throughput import (
    ANSWER_TOKENS,
    WORKLOADS,
    EndpointProcess,
    LoopLag,
    gym_config,
)
from results_file import HISTORY, git_revision, publish, ray_get, verdict
from transformers import AutoTokenizer

from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.ray_utils import init_ray
from gym_bridge.rollout.manager import RolloutManager, RolloutOutcome
from gym_bridge.types import PromptGroupRecord

SINGLE = WORKLOADS["single"]  # single-turn equivalence rows, instant answers
TARGET_GROWTH_MIB = 600.0
TARGET_P99_MS = 20.0
TARGET_MAX_MS = 100.0
MILESTONES = (0.25, 0.5, 0.75, 1.0)
AGENT_SERVER = ("lc_equivalence_rule_simple_agent", "responses_api_agents", "simple_agent")
RESOURCES_SERVER = ("lc_equivalence_rule", "resources_servers", "equivalence_rule")
VLLM_MODEL_SERVER = ("policy_model", "responses_api_models", "vllm_model")

log = logging.getLogger("bench-scale")


class StreamingSink:
    """A :class:`~gym_bridge.rollout.sink.RolloutSink` that writes each committed group as one JSON line.

    It keeps counters only (and the set of committed prompt indices, to catch a duplicate),
    so the driver's memory shows what the rollout path holds, not what a sink retains.
    """

    def __init__(self, out: TextIO, group_size: int, total_groups: int, on_milestone: Any) -> None:
        self.out = out
        self.group_size = group_size
        self.total_groups = total_groups
        self.on_milestone = on_milestone
        self.reserved: dict[str, int] = {}
        self.committed_prompts: set[int] = set()
        self.rows = 0
        self.duplicates: list[int] = []
        self.wrong_size: list[int] = []
        self.failures: Counter[str] = Counter()
        self.first_failure: dict[str, str] = {}
        self._ids = 0
        self._next_milestone = 0

    def reserve(self, prompt_idx: int) -> str:
        self._ids += 1
        slot = f"{prompt_idx}-{self._ids}"
        self.reserved[slot] = prompt_idx
        return slot

    def commit(
        self, slot: str, record: PromptGroupRecord, *, start_weight_version: int, end_weight_version: int
    ) -> None:
        prompt_idx = self.reserved.pop(slot)
        if prompt_idx in self.committed_prompts:
            self.duplicates.append(prompt_idx)
        self.committed_prompts.add(prompt_idx)
        n = len(record.completions)
        if n != self.group_size:
            self.wrong_size.append(prompt_idx)
        self.rows += n
        line = {
            "prompt_idx": prompt_idx,
            "rows": n,
            "rewards": [c.reward for c in record.completions],
            "tokens": [sum(int(m["token_ids"].numel()) for m in c.message_log) for c in record.completions],
            "weight_versions": [start_weight_version, end_weight_version],
        }
        self.out.write(json.dumps(line) + "\n")
        done = len(self.committed_prompts)
        while self._next_milestone < len(MILESTONES) and done >= MILESTONES[self._next_milestone] * self.total_groups:
            self.on_milestone(MILESTONES[self._next_milestone])
            self._next_milestone += 1

    def discard(self, slot: str, error: BaseException | None = None) -> None:
        if self.reserved.pop(slot, None) is None:
            return
        reason = type(error).__name__ if error is not None else "unknown"
        self.failures[reason] += 1
        self.first_failure.setdefault(reason, str(error)[:300])


class Sampler:
    """Samples the resident memory of the driver and the actor on a thread, every ``interval_s``."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> dict[str, int]:
        return {name: proc.memory_info().rss for name, proc in self.procs.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._t0, self.now()))
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def peak(self, name: str) -> int:
        return max((s[name] for _, s in self.samples), default=0)


class StallSampler:
    """While the driver's loop is stalled (no tick for ``stall_s``), samples where its thread is, every 10 ms.

    A thread, so it sees the loop while the loop cannot run anything; reports the most
    frequent innermost gym_bridge / asyncio / ray frames, which names what a long tick spent its time in.
    """

    def __init__(self, stall_s: float = 0.05) -> None:
        self.stall_s = stall_s
        self.last_tick = time.monotonic()
        self.where: Counter[str] = Counter()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)

    async def ticks(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(0.005)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            if time.monotonic() - self.last_tick < self.stall_s:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            stack = traceback.extract_stack(frame) if frame is not None else []
            ours = [f for f in stack if "gym_bridge" in f.filename or "scale_rows" in f.filename]
            inner = ours[-1] if ours else (stack[-1] if stack else None)
            if inner is not None:
                leaf = stack[-1]
                self.where[f"{Path(inner.filename).name}:{inner.name} > {Path(leaf.filename).name}:{leaf.name}"] += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


async def count_tasks(interval_s: float, into: list[tuple[float, int]]) -> None:
    """Record the number of asyncio tasks alive on this loop every ``interval_s`` (cancel to stop)."""
    t0 = time.monotonic()
    while True:
        into.append((time.monotonic() - t0, len(asyncio.all_tasks())))
        await asyncio.sleep(interval_s)


def worker_overrides(agent_workers: int, resources_workers: int, model_workers: int) -> dict[str, Any]:
    """Gym config overrides giving the agent, the resources server and Gym's vllm_model ``num_workers``.

    nemo-gym 0.4.0 runs ``num_workers > 1`` as uvicorn workers that import ``<server module>:app``;
    only servers that define a module-level ``app`` start that way (vllm_model does; simple_agent
    and equivalence_rule do not, and exit at start-up).
    """
    overrides: dict[str, Any] = {}
    servers = ((AGENT_SERVER, agent_workers), (RESOURCES_SERVER, resources_workers), (VLLM_MODEL_SERVER, model_workers))
    for (name, kind, impl), workers in servers:
        if workers > 1:
            overrides[name] = {kind: {impl: {"num_workers": workers}}}
    return overrides


@dataclass
class Report:
    groups: int
    group_size: int
    deadline_s: float
    wall_s: float = 0.0
    committed: int = 0
    skipped: int = 0
    rows_written: int = 0
    lines_written: int = 0
    """Lines in the results file: one per committed group."""
    duplicates: list[int] = field(default_factory=list)
    wrong_size: list[int] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    first_failure: dict[str, str] = field(default_factory=dict)
    raised: dict[str, int] = field(default_factory=dict)
    rss_idle: dict[str, int] = field(default_factory=dict)
    rss_peak: dict[str, int] = field(default_factory=dict)
    rss_end: dict[str, int] = field(default_factory=dict)
    rss_milestones: list[tuple[float, float, dict[str, int]]] = field(default_factory=list)
    """(fraction of groups committed, seconds since launch, RSS) at 25/50/75/100 %."""
    lags_s: list[float] = field(default_factory=list)
    worst_tick: tuple[float, float, float] = (0.0, 0.0, 0.0)
    max_gc_pause_s: float = 0.0
    gc_collections: list[int] = field(default_factory=list)
    tasks: list[tuple[float, int]] = field(default_factory=list)
    tasks_idle: int = 0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rss_samples: int = 0
    stalls: list[tuple[str, int]] = field(default_factory=list)
    """Where the loop's thread was while no tick ran for 50 ms: (innermost frames, 10 ms samples), most first."""


async def run_scale(args: argparse.Namespace, workdir: Path) -> Report:
    rows_total = args.groups * args.group_size
    deadline_s = args.deadline_s or 120.0 + rows_total / 10.0
    report = Report(args.groups, args.group_size, deadline_s, load_before=os.getloadavg())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    init_ray(num_cpus=2)
    endpoint = EndpointProcess(free_port("127.0.0.1"), workdir / "endpoint.log")
    actor = None
    try:
        await asyncio.to_thread(endpoint.start, "instant")
        config = gym_config(endpoint.base_url, workdir / "gym-logs", SINGLE, args.model_server).model_copy(
            update={
                "request_timeout_s": deadline_s,
                "overrides": worker_overrides(args.agent_workers, args.resources_workers, args.model_workers),
            }
        )
        actor = await asyncio.to_thread(start_nemo_gym_actor, config, tokenizer)
        actor_pid = await ray_get(actor.__ray_call__.remote(lambda _actor: os.getpid()))
        manager = RolloutManager(
            tokenizer=tokenizer,
            task_to_env={"nemo_gym": actor},
            num_generations_per_prompt=args.group_size,
            max_seq_len=4096,
            generation_config=SINGLE.generation_config,
            use_nemo_gym=True,
            timeouts=RolloutTimeouts(rollout_s=deadline_s),
            # One attempt each, and no failure stops the run: every failure is counted and named.
            retry_policy=RolloutRetryPolicy.single_attempt(
                max_skipped_prompts=args.groups, max_consecutive_dropped_prompts=args.groups
            ),
        )
        log.info(
            "actor pid %d, endpoint pid %d; deadline %.0fs per group and per /run", actor_pid, endpoint.pid, deadline_s
        )

        with open(workdir / "warmup.jsonl", "w") as out:
            warm = StreamingSink(out, args.group_size, 4, lambda _f: None)
            warm_data = [datum_from_gym_row(row, idx=i) for i, row in enumerate(SINGLE.templates(4))]
            await asyncio.gather(*(manager.collect(d, warm) for d in warm_data))
        if warm.rows != 4 * args.group_size:
            raise RuntimeError(f"the warm-up lost rows: {dict(warm.failures)} {warm.first_failure}")
        gc.collect()
        if args.gc_freeze:
            gc.freeze()  # what the eval runner does after start-up, and a training driver should

        sampler = Sampler({"driver": os.getpid(), "actor": actor_pid}, args.sample_s)
        report.rss_idle = sampler.now()
        report.tasks_idle = len(asyncio.all_tasks())
        gc_before = [s["collections"] for s in gc.get_stats()]
        data = [datum_from_gym_row(row, idx=i) for i, row in enumerate(SINGLE.templates(args.groups))]
        started = time.monotonic()

        def milestone(fraction: float) -> None:
            report.rss_milestones.append((fraction, time.monotonic() - started, sampler.now()))
            log.info("%3.0f %% of groups committed after %.1f s", 100 * fraction, time.monotonic() - started)

        results_path = workdir / "results.jsonl" if args.results is None else args.results
        lag = LoopLag()
        tasks_probe = asyncio.create_task(count_tasks(args.sample_s, report.tasks), name="task-count")
        stalls = StallSampler()
        stall_ticks = asyncio.create_task(stalls.ticks(), name="stall-ticks")
        stalls.start()
        with open(results_path, "w") as out:
            sink = StreamingSink(out, args.group_size, args.groups, milestone)
            sampler.start()
            try:
                async with lag:
                    outcomes = await asyncio.gather(*(manager.collect(d, sink) for d in data), return_exceptions=True)
            finally:
                sampler.stop()
                tasks_probe.cancel()
                stall_ticks.cancel()
                stalls.stop()
        report.stalls = stalls.where.most_common(5)
        report.wall_s = time.monotonic() - started
        del data
        gc.collect()
        report.rss_end = sampler.now()
        report.rss_peak = {name: sampler.peak(name) for name in sampler.procs}
        report.rss_samples = len(sampler.samples)
        report.gc_collections = [s["collections"] - b for s, b in zip(gc.get_stats(), gc_before, strict=True)]
        report.committed = sum(o is RolloutOutcome.COMMITTED for o in outcomes)
        report.skipped = sum(o is RolloutOutcome.SKIPPED for o in outcomes)
        report.raised = dict(Counter(type(o).__name__ for o in outcomes if isinstance(o, BaseException)))
        report.rows_written = sink.rows
        report.duplicates, report.wrong_size = sink.duplicates, sink.wrong_size
        report.failures, report.first_failure = dict(sink.failures), sink.first_failure
        report.lags_s, report.worst_tick, report.max_gc_pause_s = lag.lags_s, lag.worst, lag.max_gc_pause_s
        with open(results_path) as lines:
            report.lines_written = sum(1 for _ in lines)
        return report
    finally:
        if actor is not None:
            try:
                await asyncio.to_thread(stop_nemo_gym_actors, [actor])
            except Exception:
                log.exception("stopping the NemoGym actor failed")
        await asyncio.to_thread(endpoint.stop)
        import ray

        ray.shutdown()


# ---- the report -------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def _pct(values: list[float], q: float) -> float:
    return values[int(q * (len(values) - 1))] if values else float("nan")


def markdown(report: Report, args: argparse.Namespace) -> str:
    mem_gib = psutil.virtual_memory().total / 1024**3
    rows = report.groups * report.group_size
    lb, la = report.load_before, report.load_after
    lags_ms = sorted(1000 * x for x in report.lags_s)
    p50, p99, top = _pct(lags_ms, 0.5), _pct(lags_ms, 0.99), (lags_ms[-1] if lags_ms else float("nan"))
    growth = {name: max(0, report.rss_peak[name] - report.rss_idle[name]) for name in report.rss_idle}
    total_growth = sum(growth.values()) / 2**20
    accounted = (
        report.committed * report.group_size == report.rows_written
        and report.lines_written == report.committed
        and report.committed + report.skipped == report.groups
        and not report.duplicates
        and not report.wrong_size
        and not report.raised
    )
    peak_tasks = max((n for _, n in report.tasks), default=0)
    workers = f"num_workers: agent {args.agent_workers}, resources {args.resources_workers}" + (
        f", model {args.model_workers}" if args.model_server == "vllm_model" else ""
    )
    lines = [
        f"\n## Rows in flight at scale, {date.today()} ({os.cpu_count()} cores, {mem_gib:.0f} GiB, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {git_revision()})",
        "",
        f"{args.note + ' ' if args.note else ''}"
        f"Load average before {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}, after {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} "
        f"(1 / 5 / 15 min). `benchmarks/scale_rows.py --groups {report.groups} --group-size {report.group_size}`: "
        f"ONE NemoGym actor ({args.model_server} model server + equivalence_rule lc, single-turn rows, {workers}), "
        f"ONE RolloutManager(use_nemo_gym=True), all {report.groups} groups launched at once with "
        "`manager.collect(datum, sink)` into a sink that writes one JSON line per group and retains nothing; "
        f"our server with InstantGeneration ({ANSWER_TOKENS}-token answer, no model). Deadlines set for the run's "
        f"size: rollout_s = request_timeout_s = {report.deadline_s:.0f} s."
        + (" The driver's heap was `gc.freeze()`d after the warm-up." if args.gc_freeze else ""),
        "",
        "| rows | groups | wall s | rows/s | committed groups | rows written | skipped | failures by type "
        "| duplicates | every row accounted for |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {rows} | {report.groups} | {report.wall_s:.1f} | {rows / report.wall_s:.1f} | {report.committed} "
        f"| {report.rows_written} | {report.skipped} | {_failures(report)} | {len(report.duplicates)} "
        f"| {'yes' if accounted else 'NO'} |",
        "",
        f"**Resident memory** (psutil RSS, sampled every {1000 * args.sample_s:.0f} ms, {report.rss_samples} samples; "
        "idle after a 4-group warm-up, end after `gc.collect()`):",
        "",
        "| process | idle MiB | peak MiB | end MiB | growth (peak - idle) MiB | per row in flight KiB |",
        "|---|---|---|---|---|---|",
    ]
    for name in report.rss_idle:
        lines.append(
            f"| {name} | {_mib(report.rss_idle[name])} | {_mib(report.rss_peak[name])} | {_mib(report.rss_end[name])} "
            f"| {growth[name] / 2**20:.1f} | {growth[name] / 1024 / rows:.1f} |"
        )
    lines += [
        "",
        f"Driver + actor growth: **{total_growth:.0f} MiB** (target < {TARGET_GROWTH_MIB:g} MB: "
        f"{verdict(total_growth * 1.048576 < TARGET_GROWTH_MIB)}).",
        "",
        "Growth with the run's length (RSS when this share of the groups had committed; rows still in flight "
        "shrink as groups commit, so what the run itself retains shows as memory that does not come back down):",
        "",
        "| groups committed | s since launch | driver MiB | actor MiB |",
        "|---|---|---|---|",
        *(
            f"| {100 * f:.0f} % | {t:.1f} | {_mib(r['driver'])} | {_mib(r['actor'])} |"
            for f, t, r in report.rss_milestones
        ),
        f"| after (gc) | {report.wall_s:.1f} | {_mib(report.rss_end['driver'])} | {_mib(report.rss_end['actor'])} |",
        "",
        f"**Event-loop lag** (a 10 ms asyncio ticker on the driver's loop for the whole run, {len(lags_ms)} ticks):",
        "",
        "| p50 ms | p99 ms | max ms | worst tick: CPU ms of the loop's thread / of the process | longest GC pause ms "
        f"| GC collections gen0/1/2 | p99 < {TARGET_P99_MS:g} ms | max < {TARGET_MAX_MS:g} ms |",
        "|---|---|---|---|---|---|---|---|",
        f"| {p50:.1f} | {p99:.1f} | {top:.1f} | {1000 * report.worst_tick[1]:.1f} / {1000 * report.worst_tick[2]:.1f} "
        f"| {1000 * report.max_gc_pause_s:.1f} | {'/'.join(map(str, report.gc_collections))} "
        f"| {verdict(p99 < TARGET_P99_MS)} | {verdict(top < TARGET_MAX_MS)} |",
        "",
        f"**asyncio tasks on the driver's loop** (idle {report.tasks_idle}, peak {peak_tasks}; sampled every "
        f"{1000 * args.sample_s:.0f} ms): {_task_curve(report)}.",
        "",
        "Where the driver's loop was while stalled 50 ms or more (10 ms samples of its thread from another "
        "thread; innermost gym-bridge frame > innermost frame): "
        + ("; ".join(f"`{where}` {n}" for where, n in report.stalls) or "no stall")
        + ".",
    ]
    return "\n".join(lines) + "\n"


def _failures(report: Report) -> str:
    named = {**report.failures, **{f"raised {k}": v for k, v in report.raised.items()}}
    if not named:
        return "none"
    return "; ".join(f"{k}: {v} ({report.first_failure.get(k, '')[:120]})" for k, v in sorted(named.items()))


def _task_curve(report: Report) -> str:
    """The task count at ten points of the run."""
    if not report.tasks:
        return "no samples"
    step = max(1, len(report.tasks) // 10)
    points = report.tasks[::step] + ([report.tasks[-1]] if (len(report.tasks) - 1) % step else [])
    return ", ".join(f"{t:.0f} s: {n}" for t, n in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=1024, help="prompt groups launched at once (default 1024)")
    parser.add_argument("--group-size", type=int, default=16, help="rows per group (default 16)")
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="rollout_s and request_timeout_s (default 120 + rows / 10)"
    )
    parser.add_argument("--sample-s", type=float, default=0.2, help="RSS and task-count sampling interval")
    parser.add_argument("--agent-workers", type=int, default=1, help="the agent server's num_workers (uvicorn workers)")
    parser.add_argument("--resources-workers", type=int, default=1, help="the resources server's num_workers")
    parser.add_argument(
        "--model-workers", type=int, default=1, help="num_workers of Gym's vllm_model (with --model-server vllm_model)"
    )
    parser.add_argument(
        "--model-server", choices=["gym_bridge", "vllm_model"], default="gym_bridge",
        help="the model server of the actor's Gym: gym-bridge's own (default) or Gym's vllm_model",
    )  # fmt: skip
    parser.add_argument(
        "--no-gc-freeze", dest="gc_freeze", action="store_false", help="do not gc.freeze() after the warm-up"
    )
    parser.add_argument("--results", type=Path, default=None, help="keep the committed groups' JSON lines here")
    parser.add_argument(
        "--note", default="", help="a sentence put first in the section (e.g. how contended the machine was)"
    )
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not append to {HISTORY.name}/")
    args = parser.parse_args()
    if args.groups < 1 or args.group_size < 1:
        parser.error("--groups and --group-size must be >= 1")
    if args.model_workers > 1 and args.model_server != "vllm_model":
        parser.error("--model-workers applies to Gym's vllm_model: add --model-server vllm_model")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    log.info("logs: %s", workdir)
    report = asyncio.run(run_scale(args, workdir))
    report.load_after = os.getloadavg()
    text = markdown(report, args)
    publish(text, topic="rows-in-flight-at-scale", write=not args.no_write)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
