"""``gym-bridge report`` and ``gym-bridge compare`` on large and hostile run folders: wall time and peak memory of
the command as a user runs it (a fresh interpreter, imports included).

Three cases, each written into a temporary folder:

- ``report-1m``: one run of 10,000 prompts x 100 completions (10^6 completions) in a ~17 MB ``results.jsonl``:
  each completion only its reward, as a hand-made or compacted file holds it;
- ``report-sparse``: a ``results.jsonl`` that is a 1.9 GB sparse file of zeros (nothing on disk): it must be one
  error line naming the file and line, quickly, not an empty report;
- ``compare-20k``: two runs of 20,000 prompts x 4 completions shaped like ``gym-bridge eval``'s lines
  (:func:`gym_bridge.eval.records.completion_record`: texts, a token trace with logprobs, tool calls, Gym's
  result with the prompt and response), ~29 KB a line (~580 MB a file).

    uv run python benchmarks/report_scale.py [--cases report-1m report-sparse compare-20k] [--write]

Peak memory is the command's maximum resident set (``getrusage(RUSAGE_CHILDREN)`` of a probe process that runs
only the command). Targets: compare under 10 s and under 1 GiB; report under 1 GiB; the sparse file an error
(exit 2) in under a second of reading. Prints one Markdown section; ``--write`` appends it to
``benchmarks/history/<date>-report-and-compare-at-scale.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from results_file import git_revision, publish, verdict

from gym_bridge.eval.records import row_id

AGENTS = ("math_agent", "tool_agent", "judge_agent")
WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "at", "by",
         "this", "had", "not", "are", "but", "from", "or", "have", "an", "they"]  # fmt: skip
GIB = 1 << 30


def _run_json(folder: Path, name: str, prompts: int, n: int) -> None:
    run = {"fingerprint": {"dataset_sha256": "scale", "config_paths": ["a.yaml"], "gym_overrides": {},
                           "num_generations_per_prompt": n},
           "config": {"pass_threshold": 1.0, "config_paths": ["a.yaml"], "gym_overrides": {}},
           "model": name, "prompts_total": prompts,
           "sessions": [{"started": 0.0, "rollouts_started": 1.0, "ended": 100.0, "outcome": "finished"}]}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))


def write_million(folder: Path, prompts: int = 10_000, n: int = 100, seed: int = 0) -> Path:
    """One run of ``prompts`` x ``n`` completions, each only its reward (~17 bytes a completion)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    _run_json(folder, "one million completions", prompts, n)
    with (folder / "results.jsonl").open("w") as f:
        for i in range(prompts):
            row = {"responses_create_params": {"input": f"q{i}"}, "agent_ref": {"name": AGENTS[i % 3]}}
            rewards = [1.0 if rng.random() < 0.4 else 0.0 for _ in range(n)]
            line = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": AGENTS[i % 3],
                    "completions": [{"reward": r} for r in rewards]}  # fmt: skip
            f.write(json.dumps(line, separators=(",", ": ")) + "\n")
    return folder


def write_sparse(folder: Path, size: int = 1_900_000_000) -> Path:
    """A run whose ``results.jsonl`` is ``size`` bytes of zeros, sparse (takes no disk)."""
    folder.mkdir(parents=True)
    _run_json(folder, "a sparse file", 10, 4)
    with (folder / "results.jsonl").open("wb") as f:
        f.truncate(size)
    return folder


def _completion(rng: random.Random, i: int, prompt: dict, skill: float, target: int) -> dict:
    """One completion as ``completion_record`` writes it, about ``target`` bytes of JSON."""
    tokens: list[str] = []
    size = 0
    while size < target * 0.51:  # the trace (tokens, logprobs) and the texts that repeat it
        word = (" " if tokens else "") + rng.choice(WORDS)
        tokens.append(word)
        size += len(word) + 12
    right = rng.random() < skill
    answer = str(2 * i) if right else str(2 * i + 1)
    tokens += [" ", answer]
    text = "".join(tokens)
    tool = rng.random() < 0.3
    items = (
        [
            {
                "type": "function_call",
                "name": "calculator",
                "arguments": json.dumps({"expr": f"{i}+{i}"}),
                "call_id": "c1",
            },
            {"type": "function_call_output", "call_id": "c1", "output": json.dumps({"result": 2 * i})},
        ]
        if tool
        else []
    )
    items.append({"type": "message", "role": "assistant", "id": f"msg_{i}",
                  "content": [{"type": "output_text", "text": text, "annotations": []}]})  # fmt: skip
    reward = 1.0 if right else 0.0
    return {
        "reward": reward, "truncated": False, "termination": "stop", "text": text, "turn_texts": [text],
        "turns": 2 if tool else 1, "prompt_tokens": 60, "generated_tokens": len(tokens),
        "total_tokens": 60 + len(tokens), "masked": False, "failure_kind": None, "token_drift": False,
        "seed": rng.randrange(2**31),
        "trace": [{"role": "user", "text": f"<|im_start|>user\n{prompt['input'][0]['content']}<|im_end|>\n"},
                  {"role": "assistant", "tokens": tokens,
                   "logprobs": [round(-rng.expovariate(3.0), 3) for _ in tokens]}],
        "gym_result": {"responses_create_params": prompt, "response": {"id": f"resp_{i}", "output": items},
                       "reward": reward, "expected_answer": str(2 * i), "extracted_answer": answer},
    }  # fmt: skip


def write_shaped(folder: Path, prompts: int, *, skill: float, line_bytes: int = 29_000, n: int = 4) -> Path:
    """A finished run of ``prompts`` x ``n`` completions shaped like an eval's, ~``line_bytes`` a line; the same
    rows (and row ids) for any ``skill``."""
    rng = random.Random(int(skill * 1000))
    folder.mkdir(parents=True)
    _run_json(folder, f"policy (skill {skill})", prompts, n)
    per_completion = line_bytes // n
    with (folder / "results.jsonl").open("w") as f:
        for i in range(prompts):
            agent = AGENTS[i % len(AGENTS)]
            prompt = {"input": [{"role": "system", "content": "Answer with a number."},
                                {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}  # fmt: skip
            row = {"responses_create_params": prompt, "agent_ref": {"name": agent}}
            line = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": agent,
                    "completions": [_completion(rng, i, prompt, skill, per_completion) for _ in range(n)],
                    "elapsed_s": 2.5, "finished_at": 1.0 + i}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return folder


def run_command(args: list[str], timeout_s: float = 900) -> tuple[float, int, int, str, float]:
    """Wall time, peak RSS (bytes), exit code, the last stderr line and the CPU seconds (user + system, the
    command and the processes it started) of ``gym-bridge ARGS`` in a fresh interpreter (a probe process runs it,
    so the peak is the command's alone)."""
    probe = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(wall, usage.ru_maxrss * 1024, done.returncode, usage.ru_utime + usage.ru_stime)\n"
        "sys.stderr.write(done.stderr)\n"
    )
    cmd = [sys.executable, "-m", "gym_bridge.cli", *args]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", probe, *cmd], capture_output=True, text=True, env=env, check=True, timeout=timeout_s
    )
    wall, peak, code, cpu = done.stdout.split()
    last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "")
    return float(wall), int(peak), int(code), last, float(cpu)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["report-1m", "report-sparse", "compare-20k"])
    parser.add_argument("--prompts", type=int, default=20_000, help="prompts per run of compare-20k")
    parser.add_argument("--label", default="", help="what code was measured (e.g. 'before')")
    parser.add_argument("--keep", type=Path, help="write the folders here and keep them (reused when present)")
    parser.add_argument("--write", action="store_true", help="append the section to history/<date>-...md")
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-report-scale-"))
    load = os.getloadavg()[0]
    rows = []
    try:
        if "report-1m" in args.cases:
            folder = root / "million"
            if not folder.exists():
                write_million(folder)
            size = (folder / "results.jsonl").stat().st_size
            wall, peak, code, last, cpu = run_command(["report", str(folder)])
            ok = code == 0 and peak < GIB
            rows.append(f"| `report`, 10^6 completions (10,000 x 100, {size / 1e6:.0f} MB) | {wall:.1f} s | "
                        f"{cpu:.1f} s | {_mib(peak)} | exit {code} | {verdict(ok)} (< 1 GiB) |")  # fmt: skip
        if "report-sparse" in args.cases:
            folder = root / "sparse"
            if not folder.exists():
                write_sparse(folder)
            wall, peak, code, last, cpu = run_command(["report", str(folder)])
            ok = code == 2 and wall < 10 and peak < GIB
            said = last[:160].replace("|", "/")
            rows.append(f"| `report`, a 1.9 GB sparse `results.jsonl` of zeros | {wall:.1f} s | {cpu:.1f} s | "
                        f"{_mib(peak)} | exit {code}: {said} | {verdict(ok)} (an error at file:line) |")  # fmt: skip
        if "compare-20k" in args.cases:
            a, b = root / f"a-{args.prompts}", root / f"b-{args.prompts}"
            if not a.exists():
                write_shaped(a, args.prompts, skill=0.5)
            if not b.exists():
                write_shaped(b, args.prompts, skill=0.6)
            size = (a / "results.jsonl").stat().st_size
            lines = args.prompts
            out = root / "compare-out"
            shutil.rmtree(out, ignore_errors=True)
            wall, peak, code, last, cpu = run_command(["compare", str(a), str(b), "--out", str(out)])
            ok = code == 0 and wall < 10 and peak < GIB
            rows.append(f"| `compare`, 2 runs x {args.prompts:,} prompts x 4 ({size / lines / 1e3:.0f} KB a line, "
                        f"{size / 1e6:,.0f} MB a file) | {wall:.1f} s | {cpu:.1f} s | {_mib(peak)} | "
                        f"exit {code} | {verdict(ok)} (< 10 s, < 1 GiB) |")  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    label = f" ({args.label})" if args.label else ""
    section = "\n".join(
        [
            f"\n## report and compare at scale{label}, {date.today()} ({platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {git_revision()})\n",
            "`benchmarks/report_scale.py`: the command in a fresh interpreter; CPU = user + system seconds of the "
            f"command and its processes; peak = the largest max RSS among them; load average at the start "
            f"{load:.1f}.",
            "",
            "| case | wall | CPU | peak memory | outcome | target |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    publish(section, topic="report-and-compare-at-scale", write=args.write)


if __name__ == "__main__":
    main()
