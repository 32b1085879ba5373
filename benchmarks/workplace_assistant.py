"""An eval of Gym's own ``workplace_assistant`` example rows (27 tools, up to 6 steps) with SmolLM2 on CPU.

Gym's multi-step tool environment, as a user tries it: the wheel's example rows (5 prompts), 2 samples each,
SmolLM2-135M-Instruct served by gym-bridge's OpenAI server on ``HFGeneration`` (``max_seq_len`` 8192), through
``run_eval`` (what ``gym-bridge eval`` runs). Prints the wall time, the rows finished and failed, the engine's
generation time (seconds with at least one row decoding or queued, sampled from ``request_counts``) and work, the
client's admission back-offs and drains (``rollout/admission_*``, ``rollout/saturation_timeout_total``), the
server's prefix cache counters (``vllm:prefix_cache_queries`` / ``hits`` on ``/metrics``) and its request gauges
after the run (work left behind by abandoned rows would show there).

    uv run python benchmarks/workplace_assistant.py                     # prefix caching on (the engine's default)
    uv run python benchmarks/workplace_assistant.py --no-prefix-cache   # the same run computing every prefix
    uv run python benchmarks/workplace_assistant.py --base-url http://127.0.0.1:18011/v1   # a running server
    uv run python benchmarks/workplace_assistant.py --replicas 2                 # two servers, sessions kept on one
    uv run python benchmarks/workplace_assistant.py --replicas 2 --no-affinity   # each model call to the least loaded

With ``--base-url`` the rows go to a server already running SmolLM2 as ``smollm2`` (``benchmarks/engine_evals.py``
passes ours and vLLM's CPU build in turn); the engine's own counters are then not read. With ``--replicas N`` the
rows go through gym-bridge's Gym model server (``model_server: gym_bridge``) to N servers, each its own engine, and
the prefix cache counters are summed over them: with session affinity (the default) every model call of a rollout
goes to the replica that served its first call; ``--no-affinity`` sends each call to the least-loaded replica
(``session_affinity: false``), as a router without sessions does (Gym #2570).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

AGENT = "workplace_assistant_simple_agent"
ROWS_PATH = "resources_servers/workplace_assistant/data/example.jsonl"
CONFIG_PATHS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/workplace_assistant/configs/workplace_assistant.yaml",
]
SERVED_NAME = "smollm2"
PREFIX_METRICS = re.compile(
    r"^(vllm:prefix_cache_(?:queries|hits)|vllm:num_requests_(?:running|waiting))"
    r"(?:_total)?(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5, help="example rows evaluated (the wheel has 5)")
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0.0001: as good as greedy (two engines decode the same text)")
    parser.add_argument("--rollout-timeout-s", type=float, default=1800.0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--admission-limit", type=int, default=None, help="rows in flight at first (default: none)")
    parser.add_argument("--concurrency", type=int, default=None, help="groups in flight (default: --prompts)")
    parser.add_argument("--no-prefix-cache", action="store_true", help="the engine without prefix caching")
    parser.add_argument(
        "--no-seed", action="store_true", help="no per-request seeds (vLLM's CPU build crashes on them)"
    )
    parser.add_argument("--base-url", default=None, help="a running server's /v1 URL serving SmolLM2 as smollm2")
    parser.add_argument(
        "--replicas", type=int, default=1, help="servers, each its own engine (>1: gym-bridge's model server)"
    )
    parser.add_argument(
        "--no-affinity", action="store_true", help="with --replicas: each model call to the least loaded"
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="the run folder (default: a temp folder)")
    return parser.parse_args()


def example_rows(limit: int) -> list[dict[str, Any]]:
    """The wheel's ``workplace_assistant`` example rows, routed to its simple agent."""
    from gym_bridge.gym.servers.config_files import wheel_config_path

    text = wheel_config_path(ROWS_PATH).read_text()
    rows = [json.loads(line) for line in text.split("\n") if line.strip()][:limit]
    for row in rows:
        row["agent_ref"] = {"type": "responses_api_agents", "name": AGENT}
    return rows


class BusyClock:
    """Seconds an engine had a row decoding or queued, sampled every ``every_s`` from ``request_counts``."""

    def __init__(self, generations: list[Any], every_s: float = 0.2) -> None:
        self.generations = generations
        self.every_s = every_s
        self.busy_s = 0.0
        self.peak_running = self.peak_waiting = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-clock", daemon=True)

    def __enter__(self) -> BusyClock:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        if not self.generations:  # a server elsewhere: nothing to sample
            return
        last = time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            counts = [generation.request_counts() for generation in self.generations]
            running, waiting = sum(c.running for c in counts), sum(c.waiting for c in counts)
            self.peak_running = max(self.peak_running, running)
            self.peak_waiting = max(self.peak_waiting, waiting)
            if running or waiting:
                self.busy_s += now - last
            last = now


def prefix_cache_counters(root_urls: list[str]) -> dict[str, float]:
    """``vllm:prefix_cache_queries`` / ``hits`` and the request gauges from each server's ``/metrics``, summed (empty
    when they have none)."""
    counters: dict[str, float] = {}
    for root_url in root_urls:
        with urllib.request.urlopen(f"{root_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for name, value in PREFIX_METRICS.findall(text):
            counters[name] = counters.get(name, 0.0) + float(value)
    return counters


def main() -> int:
    args = parse_args()
    from gym_bridge.eval.config import EvalConfig
    from gym_bridge.eval.runner import run_eval
    from gym_bridge.generation.hf import HFGeneration
    from gym_bridge.generation.hf_config import HFGenerationConfig
    from gym_bridge.gym.transport.admission import AdmissionSettings
    from gym_bridge.models.registry import resolve_model_path
    from gym_bridge.serving import OpenAIServer

    model = resolve_model_path("smollm2")
    work = Path(tempfile.mkdtemp(prefix="workplace-assistant-"))
    output_dir = args.output_dir or work / "run"
    dataset = work / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in example_rows(args.prompts)))
    engine_options: dict[str, Any] = {"model": str(model), "max_new_tokens": args.max_new_tokens, "seed": 0}
    if "enable_prefix_caching" in HFGenerationConfig.model_fields:
        engine_options["enable_prefix_caching"] = not args.no_prefix_cache
    elif args.no_prefix_cache:
        print("this engine has no prefix caching: --no-prefix-cache changes nothing", file=sys.stderr)
    engines = 0 if args.base_url else args.replicas
    generations = [HFGeneration(HFGenerationConfig(**engine_options)) for _ in range(engines)]
    servers = []
    for generation in generations:
        server = OpenAIServer(generation, generation.tokenizer, served_model_name=SERVED_NAME, model_path=str(model))
        server.start_in_thread()
        servers.append(server)
    try:
        base_urls = [args.base_url] if args.base_url else [server.base_url for server in servers]
        root_urls = [url.removesuffix("/").removesuffix("/v1") for url in base_urls]
        gym_model = {"session_affinity": not args.no_affinity}
        overrides = {"policy_model": {"responses_api_models": {"gym_bridge_model": gym_model}}}
        config = EvalConfig(
            dataset=dataset,
            config_paths=CONFIG_PATHS,
            output_dir=output_dir,
            base_urls=base_urls,
            model_name=SERVED_NAME,
            model_server="gym_bridge" if args.replicas > 1 else "vllm_model",
            gym_overrides=overrides if args.replicas > 1 else {},
            tokenizer=str(model),
            num_generations_per_prompt=args.samples,
            concurrency=args.concurrency or args.prompts,
            max_new_tokens=args.max_new_tokens,
            max_seq_len=args.max_seq_len,
            rollout_timeout_s=args.rollout_timeout_s,
            request_timeout_s=args.request_timeout_s,
            preflight_timeout_s=120.0,  # the preflight's chats run on the same CPUs as everything else
            temperature=args.temperature,
            top_p=0.95,
            seed=None if args.no_seed else 0,
            admission=AdmissionSettings(initial_limit=args.admission_limit),
        )
        before = prefix_cache_counters(root_urls)
        t0 = time.monotonic()
        with BusyClock(generations) as busy:
            outcome = run_eval(config, progress=False)
        elapsed = time.monotonic() - t0
        ended = time.time()
        after = prefix_cache_counters(root_urls)
        works = [generation.get_logger_metrics() for generation in generations]
    finally:
        for server in servers:
            server.stop_thread()
        for generation in generations:
            generation.shutdown()
    sending_s = ended - outcome.rollouts_started if outcome.rollouts_started else None
    report(args, outcome, elapsed, sending_s, before, after)
    if not works:
        return 0 if outcome.failed_now == 0 else 1
    counts = ("rows_generated", "tokens_generated", "forward_passes")
    total = {f"hf_generation/{key}": sum(work[f"hf_generation/{key}"] for work in works) for key in counts}
    print(
        f"generation time: {busy.busy_s:.1f} s with a row decoding or queued (peak {busy.peak_running} running, "
        f"{busy.peak_waiting} waiting); {total['hf_generation/rows_generated']} rows, "
        f"{total['hf_generation/tokens_generated']} tokens, {total['hf_generation/forward_passes']} forward passes"
    )
    if len(works) > 1:
        print("rows per replica: " + ", ".join(str(work["hf_generation/rows_generated"]) for work in works))
    return 0 if outcome.failed_now == 0 else 1


def report(
    args: argparse.Namespace,
    outcome: Any,
    elapsed: float,
    sending_s: float | None,
    before: dict[str, float],
    after: dict[str, float],
) -> None:
    """What the run did, one fact a line."""
    run = json.loads((outcome.run_dir / "run.json").read_text())
    stats = run.get("rollout_stats") or {}
    rows_done = outcome.done_now * args.samples
    print(
        f"workplace_assistant: {args.prompts} prompts x {args.samples} samples, SmolLM2, max_seq_len {args.max_seq_len}"
    )
    if args.base_url:
        print(f"engine: the server at {args.base_url}")
    elif args.replicas > 1:
        affinity = "off: each model call to the least-loaded replica" if args.no_affinity else "on"
        print(f"replicas: {args.replicas} behind gym-bridge's Gym model server; session affinity {affinity}")
    else:
        print(f"prefix caching: {'off' if args.no_prefix_cache else 'on (engine default)'}")
    sending = f" ({sending_s:.1f} s from the first group sent to the end)" if sending_s is not None else ""
    print(f"wall time: {elapsed:.1f} s{sending}")
    done, total, failed = outcome.done_now, outcome.prompts_total, outcome.failed_now
    print(f"groups finished: {done} of {total} ({rows_done} rows); failed: {failed}")
    for key in sorted(stats):
        if key.startswith(
            ("rollout/admission", "rollout/saturation", "rollout/redispatch", "rollout/infra_drops", "rollout/gym_row")
        ):
            print(f"{key}: {stats[key]:g}")
    if after:
        queries = after.get("vllm:prefix_cache_queries", 0.0) - before.get("vllm:prefix_cache_queries", 0.0)
        hits = after.get("vllm:prefix_cache_hits", 0.0) - before.get("vllm:prefix_cache_hits", 0.0)
        rate = f"{hits / queries:.1%}" if queries else "n/a"
        print(f"prefix cache: {queries:g} queries, {hits:g} hits ({rate})")
    else:
        print("prefix cache: the server reports no vllm:prefix_cache_* counters")
    running, waiting = after.get("vllm:num_requests_running"), after.get("vllm:num_requests_waiting")
    if running is not None and waiting is not None:
        print(f"endpoint after the run: {running:g} requests running, {waiting:g} waiting")
    print(f"run folder: {outcome.run_dir}")


if __name__ == "__main__":
    sys.exit(main())
