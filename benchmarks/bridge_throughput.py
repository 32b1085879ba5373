"""Bridge throughput: gym-bridge's ``nemo_gym`` rollout path against raw NeMo-Gym on the same Gym servers.

What runs, all on 127.0.0.1:

- Ray (``init_ray``); the NemoGym actor starts ONE set of Gym servers
  (``vllm_model_for_training`` + ``equivalence_rule`` lc, single-turn rows);
- our OpenAI-compatible server with :class:`~gym_bridge.generation.instant.InstantGeneration`
  (a fixed 16-token answer, no model) in a subprocess: ``gym-bridge serve --policy instant``;
- the bridge: ``RolloutManager(use_nemo_gym=True)`` in this process, prompt groups of
  16 rows, 4 / 16 / 64 groups launched at once with ``asyncio.gather``;
- raw Gym: ``RolloutCollectionHelper().run_examples`` on the same rows, head server and
  endpoint, in ``raw_gym_worker.py`` (a subprocess: Gym's config and aiohttp session
  are process-wide);
- the bridge's Gym runs ``--model-server`` (default ``gym_bridge``: gym-bridge's own model
  server, :mod:`gym_bridge.gym_model`; ``vllm_model``: Gym's);
- unless ``--no-default-baseline``: a default install of the installed nemo-gym as Gym's docs set it up
  (a second set of Gym servers with ``vllm_model_for_training`` + the same resources
  server, ``run_examples`` in a second worker; from 0.6 through the agent's ``legacy_agent``
  relay, as Gym's own collection goes) on the same rows and endpoint.

Measured: rows/s of both (interleaved, median of ``--reps`` after a warm-up) with CPU
per row of every process; the CPU cost of conversion (``conversion_cost.py``); the
largest delay of a 10 ms ticker on this event loop and the resident memory of this
process and of the actor while 1,024 rows are in flight; and, for context, one group
against the tiny model (the endpoint restarted with ``--policy hf`` on the same port).
A dated section goes to ``benchmarks/history/<date>-bridge-throughput.md``. Everything started is stopped at
the end, and every wait is bounded.

Run: ``make bench-bridge`` (or ``uv run python benchmarks/bridge_throughput.py --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import conversion_cost
import psutil
import ray
from results_file import HISTORY, git_revision, publish, ray_get, verdict
from spy import RoleProfile, Spy, markdown_table
from transformers import AutoTokenizer

from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RolloutTimeouts
from gym_bridge.gym.protocol.rows import build_rows
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.gym_set import GymSet
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.servers.server_config import GymServersConfig
from gym_bridge.gym.servers.server_set import GymServers
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym_versions import installed_gym
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.ray_utils import init_ray
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.testing.gym_rows import equivalence_row
from gym_bridge.testing.process import ServiceProcess
from gym_bridge.types import GenerationSamplingParams

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RAW_WORKER = Path(__file__).with_name("raw_gym_worker.py")
MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
MODEL_NAME = "tiny"
GROUP = 16
ANSWER_TOKENS = 16
RUN_TIMEOUT_S = 300.0
TICK_S = 0.01

TARGET_RATIO = 0.95
TARGET_DEFAULT_RATIO = 1.5
TARGET_1024_S = 12.0
TARGET_CONVERSION_MS = 1.0
TARGET_LAG_MS = 50.0

log = logging.getLogger("bench-bridge")


@dataclass(frozen=True)
class Workload:
    """What the rows are: the resources server, its agent, the endpoint's policy and the answer length."""

    name: str
    resources_config: str
    agent: str
    policy: str
    """``gym-bridge serve --policy``: instant (a fixed answer) or scripted (a tool call, then an answer)."""
    max_new_tokens: int
    description: str
    make_row: Callable[[int, str], dict[str, Any]]
    """Group ``g``'s row for the agent ``agent``."""

    @property
    def gym_configs(self) -> list[str]:
        return [MODEL_CONFIG, self.resources_config]

    @property
    def generation_config(self) -> dict[str, Any]:
        return {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": self.max_new_tokens}

    def templates(self, groups: int) -> list[dict[str, Any]]:
        return [self.make_row(g, self.agent) for g in range(groups)]


WORKLOADS = {
    "single": Workload(
        "single", "resources_servers/equivalence_rule/configs/lc.yaml", "lc_equivalence_rule_simple_agent",
        "instant", ANSWER_TOKENS,
        f"equivalence_rule lc, single-turn rows; our server with InstantGeneration ({ANSWER_TOKENS}-token answer, "
        "no model)",
        lambda g, agent: equivalence_row(f"Q{g}: what is 2+2? Reply with exactly: 4", "4", agent),
    ),
    "tool": Workload(
        "tool", "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
        "example_single_tool_call_simple_agent", "scripted", 128,
        "example_single_tool_call, tool-call rows (two model calls and one tool call per row); our server with "
        "ScriptedGeneration (a Hermes tool call, then a short answer; no model)",
        lambda g, agent: weather_row(f"city{g}", agent),
    ),
}  # fmt: skip


def weather_row(city: str, agent: str) -> dict[str, Any]:
    """A tool-call row of example_single_tool_call as its wheel's examples are: get_weather, then an answer."""
    return {
        "responses_create_params": {
            "input": [
                {"role": "developer", "content": "You are a helpful personal assistant."},
                {"role": "user", "content": f"what's it like in {city}?"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "description": ""}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                    "strict": True,
                }
            ],
            "max_output_tokens": 128,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        "agent_ref": {"type": "responses_api_agents", "name": agent},
    }


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"


# ---- the processes this benchmark starts ----------------------------------------------------


class EndpointProcess(ServiceProcess):
    """``gym-bridge serve`` in a session of its own, on a fixed port so it can be restarted in place."""

    def __init__(self, port: int, log_path: Path) -> None:
        super().__init__("endpoint", port, log_path, ready_path="/v1/models")

    def start(self, policy: str, max_new_tokens: int = ANSWER_TOKENS, timeout_s: float = 120.0) -> None:
        self.spawn([
            sys.executable, "-m", "gym_bridge.cli", "serve", "--model", "tiny", "--policy", policy,
            "--port", str(self.port), "--served-model-name", MODEL_NAME,
            "--max-new-tokens", str(max_new_tokens), "--answer-tokens", str(ANSWER_TOKENS),
        ], timeout_s)  # fmt: skip


class RawGymWorker:
    """``raw_gym_worker.py``: raw ``run_examples`` in its own process, one JSON line per request."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, head_url: str, log_path: Path, timeout_s: float = 120.0) -> None:
        with open(log_path, "ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(RAW_WORKER), head_url,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                limit=1 << 20, start_new_session=True,
            )  # fmt: skip
        try:
            await self._answer(timeout_s, log_path)
        except BaseException:
            await self.stop()
            raise

    async def run(self, rows: list[dict[str, Any]], timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"rows": rows}).encode() + b"\n")
        await asyncio.wait_for(self.proc.stdin.drain(), timeout_s)
        return await self._answer(timeout_s)

    async def _answer(self, timeout_s: float, log_path: Path | None = None) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            detail = _tail(log_path) if log_path else ""
            raise RuntimeError(f"the raw Gym worker exited (code {self.proc.returncode}) {detail}")
        return json.loads(line)

    async def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.write(b"\n")
            await asyncio.wait_for(proc.stdin.drain(), 5.0)
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5.0)


# ---- probes -----------------------------------------------------------------------------------


def _cpu_s(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


class CpuMeter:
    """CPU seconds used by named groups of processes, and by the whole machine."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles: dict[str, list[psutil.Process]] = {}
        for role, pids in roles.items():
            procs = []
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(pid))
            self.roles[role] = procs

    def pids(self) -> dict[str, list[int]]:
        return {role: [p.pid for p in procs] for role, procs in self.roles.items()}

    def snapshot(self) -> dict[str, float]:
        taken = {role: sum(_cpu_s(p) for p in procs) for role, procs in self.roles.items()}
        machine = psutil.cpu_times()
        taken["_busy"] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return taken

    @staticmethod
    def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {key: after[key] - before[key] for key in before}


class PeakRss:
    """Samples the resident memory of some processes on a thread while entered; keeps each one's peak."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.05) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.peaks: dict[str, int] = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> dict[str, int]:
        return {name: proc.memory_info().rss for name, proc in self.procs.items()}

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, rss in self.now().items():
                self.peaks[name] = max(self.peaks[name], rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


class LoopLag:
    """A 10 ms ticker on the running loop; records how late each tick fired, and the longest GC pause.

    Any thread's garbage collection holds the GIL, so a long pause shows up as lag. For
    the worst tick it keeps the CPU time this thread and the whole process used
    meanwhile: CPU on this thread means a long callback on the loop, CPU on other
    threads (Ray's) means they held the GIL, little of either means the process was
    not scheduled.
    """

    def __init__(self, interval_s: float = TICK_S) -> None:
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self.worst: tuple[float, float, float] = (0.0, 0.0, 0.0)
        """(lag, CPU of the loop's thread, CPU of the process) of the worst tick so far, in seconds."""
        self.max_gc_pause_s = 0.0
        self._gc_started: float | None = None
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.max_gc_pause_s = max(self.max_gc_pause_s, time.perf_counter() - self._gc_started)
            self._gc_started = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - expected)
            self.lags_s.append(lag)
            if lag > self.worst[0]:
                self.worst = (lag, time.thread_time() - thread_cpu, time.process_time() - process_cpu)

    async def __aenter__(self) -> LoopLag:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._tick(), name="loop-lag")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        gc.callbacks.remove(self._on_gc)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ---- one measured run -------------------------------------------------------------------------


@dataclass
class Run:
    """One measured run of ``rows`` rows, all in flight at once."""

    mode: str
    rows: int
    wall_s: float
    cpu_s: dict[str, float]
    actor_convert_s: float = 0.0
    """Bridge only: the actor's ``timing/rollout/postprocess_results`` summed over the groups (wall time)."""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s

    def cpu_ms_per_row(self, role: str) -> float:
        return 1000.0 * self.cpu_s.get(role, 0.0) / self.rows

    @property
    def busy(self) -> float:
        return self.cpu_s["_busy"] / (self.wall_s * (os.cpu_count() or 1))


@dataclass
class Bench:
    """The running pieces, and everything measured."""

    workload: Workload
    manager: Any
    raw: RawGymWorker
    meter: CpuMeter
    default: RawGymWorker | None = None
    """``run_examples`` against the default nemo-gym set-up (its own Gym servers, Gym's vllm_model)."""

    async def bridge(self, groups: list[dict[str, Any]]) -> tuple[float, float]:
        """Wall seconds, and the actor's conversion seconds summed over the groups."""
        data = [datum_from_gym_row(row, idx=i) for i, row in enumerate(groups)]
        started = time.perf_counter()
        records = await asyncio.wait_for(
            asyncio.gather(*(self.manager.run_rollout(datum) for datum in data)), RUN_TIMEOUT_S
        )
        wall = time.perf_counter() - started
        if sum(len(r.completions) for r in records) != GROUP * len(groups):
            raise RuntimeError("the bridge returned incomplete groups")
        convert_s = sum(r.rollout_metrics.get("timing/rollout/postprocess_results", 0.0) for r in records)
        return wall, convert_s

    async def raw_gym(self, groups: list[dict[str, Any]], worker: RawGymWorker) -> tuple[float, float]:
        config = self.workload.generation_config
        sampling = GenerationSamplingParams.from_generation_config(config)  # type: ignore[arg-type]
        rows = [row for t in groups for row in build_rows(t, GROUP, sampling, self.workload.max_new_tokens)]
        answer = await worker.run(rows)
        if answer["errors"] or answer["ok"] != len(rows):
            raise RuntimeError(f"raw Gym: {answer['errors']} of {len(rows)} rows failed: {answer['first_error']}")
        return float(answer["wall_s"]), 0.0

    async def measure(self, mode: str, rows: int) -> Run:
        groups = self.workload.templates(rows // GROUP)
        before = self.meter.snapshot()
        if mode == "bridge":
            wall, convert_s = await self.bridge(groups)
        else:
            worker = self.default if mode == "default" else self.raw
            assert worker is not None, "no default nemo-gym set-up was started"
            wall, convert_s = await self.raw_gym(groups, worker)
        run = Run(mode, rows, wall, CpuMeter.used(before, self.meter.snapshot()), convert_s)
        log.info("%-6s %5d rows: %6.2f s, %5.1f rows/s, busy %3.0f%%", mode, rows, wall, run.rows_per_s, 100 * run.busy)
        return run


# ---- the whole benchmark ----------------------------------------------------------------------


@dataclass
class Report:
    conversion: list[conversion_cost.ConversionCost]
    runs: list[Run]
    lags_s: list[float]
    worst_tick: tuple[float, float, float]
    max_gc_pause_s: float
    rss_idle: dict[str, int]
    rss_peak: dict[str, int]
    peak_rows: int
    hf_runs: list[Run]
    load_before: tuple[float, float, float]
    profiles: dict[str, list[RoleProfile]] = field(default_factory=dict)
    """``--profile``: mode -> py-spy's view of every process during one more run at the peak."""
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


def gym_config(base_url: str, log_dir: Path, workload: Workload, model_server: str = "gym_bridge") -> NemoGymConfig:
    return NemoGymConfig(
        model_server=model_server,
        model_name=MODEL_NAME,
        base_urls=[base_url],
        config_paths=[str(wheel_config_path(p)) for p in workload.gym_configs],
        log_dir=log_dir,
        startup_timeout_s=180,
        shutdown_timeout_s=15,
        request_timeout_s=120,
        actor_options={"num_cpus": 0},
    )


def default_gym(base_url: str, log_dir: Path, workload: Workload) -> GymSet:
    """A default nemo-gym set-up: Gym's vllm_model_for_training + the same resources server and agent (and relay)."""
    return GymServers(
        GymServersConfig(
            config_paths=[str(wheel_config_path(p)) for p in workload.gym_configs],
            policy_base_urls=[base_url],
            policy_model_name=MODEL_NAME,
            log_dir=log_dir,
            startup_timeout_s=300,
            shutdown_timeout_s=15,
        )
    )


async def run_benchmark(args: argparse.Namespace, workdir: Path) -> Report:
    load_before = os.getloadavg()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    log.info("conversion cost (%d iterations per case)", args.conversion_iterations)
    conversion = conversion_cost.measure_all(tokenizer, args.conversion_iterations)

    init_ray(num_cpus=2)  # on the main thread: Ray installs signal handlers
    endpoint = EndpointProcess(free_port("127.0.0.1"), workdir / "endpoint.log")
    raw = RawGymWorker()
    default_raw = RawGymWorker() if args.default_baseline else None
    default_servers: GymSet | None = None
    actor = None
    try:
        workload = WORKLOADS[args.workload]
        await asyncio.to_thread(endpoint.start, workload.policy, workload.max_new_tokens)
        config = gym_config(endpoint.base_url, workdir / "gym-logs", workload, args.model_server)
        actor = await asyncio.to_thread(start_nemo_gym_actor, config, tokenizer)
        if default_raw is not None:
            default_servers = default_gym(endpoint.base_url, workdir / "default-gym-logs", workload)
            default_head = await asyncio.to_thread(default_servers.start)
            await default_raw.start(default_head.url, workdir / "default_raw_worker.log")
        info = await ray_get(actor.server_info.remote())
        # A lambda travels by value, so the actor needs nothing from this script's module.
        actor_pid = await ray_get(actor.__ray_call__.remote(lambda _actor: os.getpid()))
        log.info("Gym head %s, actor pid %d, endpoint pid %d", info["head"], actor_pid, endpoint.pid)
        await raw.start(info["head"], workdir / "raw_worker.log")
        manager = RolloutManager(
            tokenizer=tokenizer,
            task_to_env={"nemo_gym": actor},
            num_generations_per_prompt=GROUP,
            max_seq_len=4096,
            generation_config=workload.generation_config,
            use_nemo_gym=True,
            timeouts=RolloutTimeouts(rollout_s=RUN_TIMEOUT_S - 30),
        )
        meter = CpuMeter(
            {
                "driver": [os.getpid()],
                "actor": [actor_pid],
                "raw": [raw.pid],
                "gym": list(info["pids"]),
                "endpoint": [endpoint.pid],
                "default_raw": [default_raw.pid] if default_raw is not None else [],
                "default_gym": list(default_servers.pids()) if default_servers is not None else [],
            }
        )
        bench = Bench(workload, manager, raw, meter, default_raw)
        modes = ("bridge", "raw", "default") if default_raw is not None else ("bridge", "raw")
        if args.gc_freeze:
            gc.freeze()  # what a training driver can do once after start-up: full collections skip this heap
        log.info("warm-up")
        for rows in sorted({min(64, max(args.concurrency)), min(256, max(args.concurrency))}):
            for mode in modes:
                await bench.measure(mode, rows)

        peak_rows = max(args.concurrency)
        rss = PeakRss({"driver": os.getpid(), "actor": actor_pid})
        rss_idle = rss.now()
        lag = LoopLag()
        runs: list[Run] = []
        for rep in range(args.reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for rows in args.concurrency:
                for mode in order:
                    if mode == "bridge" and rows == peak_rows:
                        with rss:
                            async with lag:
                                runs.append(await bench.measure(mode, rows))
                    else:
                        runs.append(await bench.measure(mode, rows))

        profiles: dict[str, list[RoleProfile]] = {}
        if args.profile:
            for mode in modes:
                log.info("profiling every process of one %s run of %d rows", mode, peak_rows)
                gym_roles = {"gym": _by_server_type("Gym", info["server_pids"], info["server_types"], info["pids"])}
                if default_servers is not None:
                    gym_roles["default_gym"] = _by_server_type(
                        "default Gym", default_servers.server_pids, default_servers.server_types, default_servers.pids()
                    )
                roles: dict[str, list[int]] = {}
                for role, pids in meter.pids().items():
                    if pids and _in_path(role, mode):
                        roles.update(gym_roles.get(role, {role: pids}))
                with Spy(roles, workdir / f"profile-{mode}") as spy:
                    await bench.measure(mode, peak_rows)
                profiles[mode] = spy.profiles()

        hf_runs: list[Run] = []
        if not args.skip_hf and workload.name == "single":
            log.info("context: the tiny model behind the same Gym servers")
            await asyncio.to_thread(endpoint.stop)
            await asyncio.to_thread(endpoint.start, "hf")
            bench.meter = CpuMeter({"driver": [os.getpid()], "actor": [actor_pid], "raw": [raw.pid]})
            await bench.measure("raw", GROUP)
            hf_runs = [await bench.measure("bridge", GROUP), await bench.measure("raw", GROUP)]
        return Report(
            conversion, runs, lag.lags_s, lag.worst, lag.max_gc_pause_s, rss_idle, rss.peaks, peak_rows, hf_runs,
            load_before, profiles,
        )
    finally:
        await raw.stop()
        if default_raw is not None:
            await default_raw.stop()
        if default_servers is not None:
            await asyncio.to_thread(default_servers.stop)
        if actor is not None:
            try:
                await asyncio.to_thread(stop_nemo_gym_actors, [actor])
            except Exception:
                log.exception("stopping the NemoGym actor failed")
        await asyncio.to_thread(endpoint.stop)
        ray.shutdown()


_PATHS = {"bridge": {"driver", "actor", "gym", "endpoint"}, "raw": {"raw", "gym", "endpoint"},
          "default": {"default_raw", "default_gym", "endpoint"}}  # fmt: skip


_SERVER_KINDS = {"responses_api_agents": "agent", "resources_servers": "resources", "responses_api_models": "model"}


def _by_server_type(
    prefix: str, server_pids: dict[str, int], server_types: dict[str, str | None], all_pids: Any
) -> dict[str, list[int]]:
    """A set of Gym servers' processes by role: agent, resources, model; the head and launcher are the rest."""
    roles: dict[str, list[int]] = {}
    for name, pid in server_pids.items():
        kind = _SERVER_KINDS.get(server_types.get(name) or "", "head")
        roles.setdefault(f"{prefix} {kind}", []).append(pid)
    named = set(server_pids.values())
    roles.setdefault(f"{prefix} head", []).extend(pid for pid in sorted(all_pids) if pid not in named)
    return roles


def _in_path(role: str, mode: str) -> bool:
    """Whether a role's processes carry the rows of a mode's runs."""
    return role in _PATHS[mode]


# ---- the report -------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _runs(report: Report, mode: str, rows: int) -> list[Run]:
    return [r for r in report.runs if r.mode == mode and r.rows == rows]


def _throughput_tables(report: Report, concurrency: list[int]) -> Iterator[str]:
    yield (
        f"| rows in flight | groups of {GROUP} | bridge rows/s (min–max) | raw Gym rows/s (min–max) | bridge / raw "
        f"| target ≥ {TARGET_RATIO} | bridge wall s | raw wall s | actor conversion ms/row |"
    )
    yield "|---|---|---|---|---|---|---|---|---|"
    for rows in concurrency:
        bridge, raw = _runs(report, "bridge", rows), _runs(report, "raw", rows)
        b, g = [r.rows_per_s for r in bridge], [r.rows_per_s for r in raw]
        ratio = _median(b) / _median(g)
        convert_ms = _median([1000 * r.actor_convert_s / r.rows for r in bridge])
        yield (
            f"| {rows} | {rows // GROUP} | {_median(b):.1f} ({min(b):.1f}–{max(b):.1f}) | "
            f"{_median(g):.1f} ({min(g):.1f}–{max(g):.1f}) | {ratio:.2f} | {verdict(ratio >= TARGET_RATIO)} | "
            f"{_median([r.wall_s for r in bridge]):.2f} | {_median([r.wall_s for r in raw]):.2f} | {convert_ms:.2f} |"
        )
    if any(r.mode == "default" for r in report.runs):
        yield ""
        yield (
            f"| rows in flight | bridge rows/s (min–max) | default nemo-gym rows/s (min–max) | bridge / default "
            f"| target ≥ {TARGET_DEFAULT_RATIO} | default wall s |"
        )
        yield "|---|---|---|---|---|---|"
        for rows in concurrency:
            b = [r.rows_per_s for r in _runs(report, "bridge", rows)]
            d = [r.rows_per_s for r in _runs(report, "default", rows)]
            ratio = _median(b) / _median(d)
            yield (
                f"| {rows} | {_median(b):.1f} ({min(b):.1f}–{max(b):.1f}) | {_median(d):.1f} ({min(d):.1f}–{max(d):.1f}) "
                f"| {ratio:.2f} | {verdict(ratio >= TARGET_DEFAULT_RATIO)} "
                f"| {_median([r.wall_s for r in _runs(report, 'default', rows)]):.2f} |"
            )
    yield ""
    yield (
        "Actor conversion: the actor's own `timing/rollout/postprocess_results` per row (wall time on its one "
        "conversion thread, queueing and GIL waits included)."
    )
    yield ""
    yield (
        'CPU per row (ms, median over the runs; "other" is the machine\'s busy time outside these processes: '
        "Ray's own processes, the kernel, anything else running on the machine):"
    )
    yield ""
    yield (
        "| rows in flight | path | driver | NemoGym actor | raw Gym worker | Gym servers | endpoint "
        "| default raw worker | default Gym servers | other | busy |"
    )
    yield "|---|---|---|---|---|---|---|---|---|---|---|"
    roles = ("driver", "actor", "raw", "gym", "endpoint", "default_raw", "default_gym")
    for rows in concurrency:
        for mode in ("bridge", "raw", "default"):
            runs = _runs(report, mode, rows)
            if not runs:
                continue
            cells = [_median([r.cpu_ms_per_row(role) for r in runs]) for role in roles]
            other = _median([r.cpu_ms_per_row("_busy") - sum(r.cpu_ms_per_row(x) for x in roles) for r in runs])
            busy = _median([r.busy for r in runs])
            row = " | ".join(f"{c:.2f}" for c in (*cells, other))
            yield f"| {rows} | {mode} | {row} | {100 * busy:.0f}% |"


def markdown(report: Report, args: argparse.Namespace) -> str:
    mem_gib = psutil.virtual_memory().total / 1024**3
    lb, la = report.load_before, report.load_after
    peak = report.peak_rows
    bridge_peak = [r.wall_s for r in _runs(report, "bridge", peak)]
    lags_ms = sorted(1000 * x for x in report.lags_s)
    max_lag = lags_ms[-1] if lags_ms else float("nan")
    p99_lag = lags_ms[int(0.99 * (len(lags_ms) - 1))] if lags_ms else float("nan")
    worst = report.worst_tick
    lines = [
        f"\n## Bridge throughput, {date.today()} ({os.cpu_count()} cores, {mem_gib:.0f} GiB, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {git_revision()})",
        "",
        f"Load average before {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}, after {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} "
        f"(1 / 5 / 15 min). Workload `{args.workload}`: {WORKLOADS[args.workload].description}, in its own "
        f"process. One set of Gym servers for the bridge ({args.model_server} + the resources server). "
        f"Bridge: RolloutManager(use_nemo_gym=True) through the NemoGym actor, groups of {GROUP} rows "
        "launched at once. "
        "Raw: RolloutCollectionHelper.run_examples in a separate process, same rows, servers and endpoint. "
        + (
            f"Default: a second set of Gym servers as a default {installed_gym().label} install runs them (Gym's "
            "vllm_model_for_training + the same resources server), run_examples in its own process (through Gym's "
            "relays where the version has them), same rows and endpoint. "
            if args.default_baseline
            else ""
        )
        +
        f"Median of {args.reps} interleaved runs after a warm-up."
        + (" The driver's heap was `gc.freeze()`d after start-up." if args.gc_freeze else ""),
        "",
        *_throughput_tables(report, args.concurrency),
        "",
        f"**{peak} rows through the bridge:** {_median(bridge_peak):.2f} s median "
        f"(target < {TARGET_1024_S:g} s: {verdict(_median(bridge_peak) < TARGET_1024_S)}).",
        "",
        "**Conversion cost** (CPU per row with the garbage collector off, synthetic 2,000-token results, "
        "tiny tokenizer; `benchmarks/conversion_cost.py`):",
        "",
        conversion_cost.markdown(report.conversion, TARGET_CONVERSION_MS),
        f"**Event-loop lag** (a {1000 * TICK_S:g} ms asyncio ticker on the driver's loop "
        f"during the {peak}-row bridge runs):",
        "",
        "| ticks | max lag ms | p99 lag ms | worst tick: CPU ms of the loop's thread / of the process "
        f"| longest GC pause ms | target < {TARGET_LAG_MS:g} ms |",
        "|---|---|---|---|---|---|",
        f"| {len(lags_ms)} | {max_lag:.1f} | {p99_lag:.1f} | {1000 * worst[1]:.1f} / {1000 * worst[2]:.1f} "
        f"| {1000 * report.max_gc_pause_s:.1f} | {verdict(max_lag < TARGET_LAG_MS)} |",
        "",
        f"**Resident memory** (psutil RSS; idle after the warm-up, peak sampled every 50 ms "
        f"during the {peak}-row bridge runs):",
        "",
        "| process | idle MiB | peak MiB | growth MiB | per in-flight row KiB |",
        "|---|---|---|---|---|",
    ]
    for name in ("driver", "actor"):
        idle, top = report.rss_idle[name], report.rss_peak[name]
        growth = max(0, top - idle)
        lines.append(
            f"| {name} | {idle / 2**20:.0f} | {top / 2**20:.0f} | {growth / 2**20:.1f} | {growth / 1024 / peak:.1f} |"
        )
    if report.hf_runs:
        lines += [
            "",
            f"**Context: the tiny model** (HFGeneration on CPU behind the same server and Gym servers, "
            f"one group of {GROUP}):",
            "",
            "| path | rows | wall s | rows/s |",
            "|---|---|---|---|",
            *(f"| {r.mode} | {r.rows} | {r.wall_s:.2f} | {r.rows_per_s:.1f} |" for r in report.hf_runs),
        ]
    for mode, profiles in report.profiles.items():
        title = (
            f"**Where the CPU goes, {mode} path** (py-spy at 50 Hz on every process during one more run of "
            f"{report.peak_rows} rows; a sample is a stack seen running, shares are by the leaf frame):"
        )
        lines += ["", *markdown_table(title, profiles)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="measured runs per point (default 3)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024], help="rows in flight")
    parser.add_argument("--conversion-iterations", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true", help="skip the tiny-model context run")
    parser.add_argument(
        "--no-gc-freeze", dest="gc_freeze", action="store_false",
        help="do not gc.freeze() the driver's heap after start-up (the eval runner does; a training driver should)",
    )
    parser.add_argument(
        "--model-server", choices=["gym_bridge", "vllm_model"], default="gym_bridge",
        help="the model server of the bridge's Gym: gym-bridge's own (default) or Gym's vllm_model",
    )  # fmt: skip
    parser.add_argument(
        "--no-default-baseline", dest="default_baseline", action="store_false",
        help="skip the default nemo-gym set-up (its own Gym servers with vllm_model, run_examples)",
    )  # fmt: skip
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="single",
        help="single: single-turn equivalence rows, instant answers; tool: tool-call rows, scripted tool calls",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="after the measured runs, one more run per path at the peak with py-spy on every process",
    )  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not append to {HISTORY.name}/")
    args = parser.parse_args()
    if any(c % GROUP for c in args.concurrency):
        parser.error(f"every --concurrency value must be a multiple of {GROUP}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    workdir = Path(tempfile.mkdtemp(prefix="bench-bridge-"))
    log.info("logs: %s", workdir)
    report = asyncio.run(run_benchmark(args, workdir))
    report.load_after = os.getloadavg()
    text = markdown(report, args)
    publish(text, topic="bridge-throughput", write=not args.no_write)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
