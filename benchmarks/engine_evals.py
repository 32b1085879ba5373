"""Our CPU engine against vLLM's CPU build on whole evals through Gym: the arith eval and workplace_assistant 5 x 2.

Both engines serve SmolLM2 in float32 over HTTP (``gym-bridge serve`` and ``scripts/vllm_cpu.sh serve``, started by
``engine_compare.start_servers``; vLLM with ``--max-model-len 8192`` and, for workplace_assistant's tools,
``--enable-auto-tool-choice --tool-call-parser hermes``), and the same eval is pointed at each in turn with
``base_urls``:

- **arith**: ``gym-bridge eval examples/eval_arith_heldout.yaml concurrency=32 seed=null`` (128 prompts x 4, ~116-token
  prompts, 24 new tokens, math_with_judge); per engine the rollout phase (``run.json``: rollouts started to ended)
  and first to last result (``results.jsonl``'s ``finished_at``);
- **workplace**: ``benchmarks/workplace_assistant.py --base-url URL`` (Gym's workplace_assistant example rows, 5 x 2,
  ~4,580-token prompts sharing a 27-tool preamble, 256 new tokens, ``max_seq_len`` 8192) without per-request seeds
  (with them vLLM's CPU build crashes: "CPU Generator does not use offset"); its wall time, its rollouts' time (first
  group sent to the end) and the tokens its finished rows generated. At the benchmark's temperature 0.7 the two
  engines sample different texts (different lengths, different tool calls), so ``--workplace-temperature 0.0001`` runs
  the like-for-like comparison: both sample (an eval's temperature must be above 0) as good as greedily, the same text
  wherever float32 rounding leaves the most likely token alone.

The engines alternate within each repetition (ours first in even repetitions, vLLM first in odd ones), so a change in
the machine's load falls on both. With ``--start`` each run gets a server of its own, started for it and stopped after
it: the engine runs alone on the machine (vLLM's CPU build pins its worker to one core; with both servers up, ours
measured 64.9-75.8 s where it measured 48.3-63.3 s alone) and from a cold prefix cache, as a fresh eval does.

    uv run python benchmarks/engine_evals.py --start            # both servers started here, 1 repetition
    uv run python benchmarks/engine_evals.py --start --only arith --reps 2
    uv run python benchmarks/engine_evals.py --start --only workplace --reps 2 --workplace-temperature 0.0001
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import engine_compare

ROOT = Path(__file__).resolve().parent.parent
WALL = re.compile(r"^wall time: ([0-9.]+) s(?: \(([0-9.]+) s from the first group sent)?", re.MULTILINE)
GROUPS = re.compile(r"^groups finished: (\d+) of \d+ .*failed: (\d+)", re.MULTILINE)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", action="store_true", help="start both servers here")
    parser.add_argument("--ours", default=None, help="our server's /v1 URL (instead of --start)")
    parser.add_argument("--vllm", default=None, help="vLLM's /v1 URL (instead of --start)")
    parser.add_argument("--only", choices=["arith", "workplace"], default=None)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--vllm-first", action="store_true", help="vLLM first in even repetitions, ours in odd ones")
    parser.add_argument("--ours-port", type=int, default=18010)
    parser.add_argument("--vllm-port", type=int, default=18011)
    parser.add_argument(
        "--workplace-temperature",
        type=float,
        default=0.7,
        help="0.0001: as good as greedy, the same text from both engines",
    )
    parser.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "engine-evals-logs"))
    return parser.parse_args()


def arith(url: str, out: Path) -> dict[str, float]:
    """The arith eval at concurrency 32 without seeds against ``url``: its rollout phase and first-to-last result."""
    from gym_bridge.models.registry import resolve_model_path

    command = [
        Path(sys.executable).with_name("gym-bridge"), "eval", "examples/eval_arith_heldout.yaml",
        f"base_urls=[{url}]", "model_name=smollm2",
        f"tokenizer={resolve_model_path('smollm2')}", "concurrency=32", "seed=null", f"output_dir={out}",
    ]  # fmt: skip
    subprocess.run([str(part) for part in command], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run = json.loads((out / "run.json").read_text())
    session = run["sessions"][-1]
    with (out / "results.jsonl").open() as f:
        finished = [json.loads(line)["finished_at"] for line in f if line.strip()]
    return {
        "rollout phase s": session["ended"] - session["rollouts_started"],
        "first to last result s": max(finished) - min(finished),
        "groups": float(len(finished)),
    }


def workplace(url: str, out: Path, temperature: float) -> dict[str, float]:
    """``workplace_assistant.py`` against ``url``: its wall time, its rollouts' (first group sent to the end), the
    groups it finished and the tokens their rows generated (rows of a lost group are not in the results)."""
    script = ROOT / "benchmarks" / "workplace_assistant.py"
    done = subprocess.run(
        [sys.executable, str(script), "--base-url", url, "--output-dir", str(out), "--no-seed",
         "--temperature", str(temperature)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    match = WALL.search(done.stdout)
    groups = GROUPS.search(done.stdout)
    if match is None or groups is None:  # exit 1 with a wall time: some groups failed (counted, not hidden)
        raise RuntimeError(f"workplace_assistant.py failed ({done.returncode}): {(done.stdout + done.stderr)[-800:]}")
    with (out / "results.jsonl").open() as f:
        generated = sum(c["generated_tokens"] for line in f if line.strip() for c in json.loads(line)["completions"])
    return {
        "wall s": float(match.group(1)),
        "rollouts s": float(match.group(2) or "nan"),
        "generated tokens": float(generated),
        "groups": float(groups.group(1)),
        "failed": float(groups.group(2)),
    }


VLLM_FLAGS = ("--max-model-len", "8192", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def main() -> int:
    args = parse_args()
    start = argparse.Namespace(
        log_dir=args.log_dir, ours_port=args.ours_port, ours_threads=[], vllm_port=args.vllm_port,
        vllm_dtype=["float32"],
    )  # fmt: skip
    if args.start:
        urls = {name: "" for name in ("ours", "vLLM float32")}
    else:
        urls = {name: url for name, url in (("ours", args.ours), ("vLLM float32", args.vllm)) if url}
    work = Path(tempfile.mkdtemp(prefix="engine-evals-"))
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    workloads = [w for w in ("arith", "workplace") if args.only in (None, w)]
    for rep in range(args.reps):
        for workload in workloads:
            order = list(urls.items())
            for name, given in order if (rep + args.vllm_first) % 2 == 0 else order[::-1]:
                with ExitStack() as stack:
                    started = engine_compare.start_servers(stack, start, VLLM_FLAGS, only=name) if args.start else {}
                    if args.start and name not in started:
                        continue  # vLLM's CPU build is not installed: ours alone
                    url = started.get(name, given)
                    out = work / f"{workload}-{name.replace(' ', '_')}-{rep}"
                    load = os.getloadavg()[0]
                    began = time.monotonic()
                    if workload == "arith":
                        measured = arith(url, out)
                    else:
                        measured = workplace(url, out, args.workplace_temperature)
                measured["load"] = load
                results.setdefault((workload, name), []).append(measured)
                print(f"{rep} {workload} {name}: {measured} ({time.monotonic() - began:.0f} s)", flush=True)
    print()
    print("| workload | engine | " + " | ".join(["measure", "runs", "speed ours / vLLM (vLLM s / ours s)"]) + " |")
    print("|---|---|---|---|---|")
    for (workload, name), runs in results.items():
        for key in runs[0]:
            if key in ("groups", "failed", "load", "generated tokens"):
                continue
            values = [r[key] for r in runs]
            ours = results.get((workload, "ours"))
            ratio = ""
            if name != "ours" and ours:
                ratio = f"{sum(values) / sum(r[key] for r in ours):.2f}x"
            shown = ", ".join(
                f"{v:.1f} (load {r['load']:.1f}{f', {r["generated tokens"]:.0f} tokens' if 'generated tokens' in r else ''}"
                f"{f', {r["failed"]:.0f} failed' if r.get('failed') else ''})"
                for v, r in zip(values, runs, strict=True)
            )
            print(f"| {workload} | {name} | {key} | {shown} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
