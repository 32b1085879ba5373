"""``metrics.json``, ``report.md``, ``report.png`` and the trace viewer ``report.html`` of a run folder, from its
files alone, read through :func:`~gym_bridge.eval.runs.load_run` (a malformed or hostile folder is one error
line naming the file, line and field; the report of a run still being written, or killed mid-line, is built
from the lines finished so far)."""

from __future__ import annotations

import html
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from gym_bridge.eval.passk import default_ks, pass_at_k
from gym_bridge.eval.records import FailureLine
from gym_bridge.eval.runs import LoadedRun, RunGroup, load_run
from gym_bridge.eval.viewer import VIEWER_FILE, build_viewer
from gym_bridge.json_types import JsonObject
from gym_bridge.metrics import pct

METRICS_FILE = "metrics.json"
REPORT_FILE = "report.md"
PLOT_FILE = "report.png"
ALL = "all"


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "mean": math.fsum(values) / len(values),
        "median": float(statistics.median(values)),
        "p95": pct(values, 95),
        "min": min(values),
        "max": max(values),
    }


def _group_metrics(groups: list[RunGroup], threshold: float) -> JsonObject:
    completions = [c for g in groups for c in g.result.completions]
    rewards = [c.reward for c in completions]
    n = min(len(g.rewards) for g in groups)
    pass_k = {}
    for k in default_ks(n):
        values = [pass_at_k(len(g.rewards), sum(r >= threshold for r in g.rewards), k) for g in groups]
        pass_k[f"pass@{k}"] = math.fsum(values) / len(values)
    return {
        "prompts": len(groups),
        "completions": len(completions),
        "mean_reward": math.fsum(rewards) / len(rewards),
        "reward": _stats(rewards),
        "pass_at_k": pass_k,
        "generated_tokens": _stats([c.generated_tokens for c in completions if c.generated_tokens is not None]),
        "total_tokens": _stats([c.total_tokens for c in completions if c.total_tokens is not None]),
        "turns": _stats([c.turns for c in completions if c.turns is not None]),
        "truncation_rate": sum(c.truncated for c in completions) / len(completions),
        "termination": dict(Counter(c.termination or "unknown" for c in completions)),
        "group_seconds": _stats([g.result.elapsed_s or 0.0 for g in groups]),
    }


def describe_model(config: JsonObject) -> str:
    """What model a run evaluated, in words, from its config (``run.json``'s ``config``)."""
    if config.get("base_urls"):
        return f"{config.get('model_name')!r} served at {', '.join(config['base_urls'])}"
    policy = config.get("embedded_policy", "tiny")
    if policy == "scripted":
        return f"the scripted rule-based policy (not a language model; tokenizer {config.get('tokenizer')!r}), embedded"
    known = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "random-initialised tiny model"}
    return (
        f"{policy} ({known.get(str(policy), 'a local model folder')}), "
        f"embedded: gym-bridge's OpenAI-compatible server over HFGeneration, served as {config.get('model_name')!r}"
    )


def read_for_report(run_dir: str | Path) -> LoadedRun:
    """The run folder as the report reads it: results and failures, old lines without ``row_id`` accepted, a
    torn last line skipped.

    Raises:
        RunReadError: the folder or a file in it is missing, not regular, too large or malformed (named).
    """
    return load_run(run_dir, need_row_ids=False, finished=False, failures=True)


def compute_metrics(run_dir: str | Path) -> JsonObject:
    """Metrics of the finished groups of a run folder (failures later resolved by a resume are not counted).

    Raises:
        RunReadError: see :func:`read_for_report`.
    """
    return run_metrics(read_for_report(run_dir))


def run_metrics(run: LoadedRun) -> JsonObject:
    """Metrics of a run folder already read."""
    threshold = run.pass_threshold
    results = run.groups
    done = {g.prompt_idx for g in results}
    latest_failure: dict[int, FailureLine] = {f.prompt_idx: f for f in run.failures if f.prompt_idx not in done}
    by_agent: dict[str, list[RunGroup]] = defaultdict(list)
    for g in results:
        by_agent[g.agent].append(g)
    agents = {agent: _group_metrics(groups, threshold) for agent, groups in sorted(by_agent.items())}
    if results:
        agents[ALL] = _group_metrics(results, threshold)
    sessions = run.meta.sessions
    finished = [g.result.finished_at for g in results if g.result.finished_at is not None]
    busy_s = math.fsum(s.ended - s.started for s in sessions)
    rollout_s = math.fsum(s.ended - s.rollouts_started for s in sessions if s.rollouts_started)
    completions = sum(len(g.rewards) for g in results)
    return {
        "run_dir": str(run.dir),
        "model": run.meta.model or describe_model(run.config),
        "pass_threshold": threshold,
        "num_generations_per_prompt": run.meta.fingerprint.num_generations_per_prompt,
        "prompts_total": run.meta.prompts_total,
        "prompts_done": len(results),
        "prompts_failed": len(latest_failure),
        "failures": {
            "by_error": dict(Counter(f.error for f in latest_failure.values())),
            "by_class": dict(Counter(f.failure_class for f in latest_failure.values())),
            "example_message": {f.error: f.message for f in latest_failure.values()},
        },
        "agents": agents,
        "timing": {
            "sessions": len(sessions),
            "run_seconds": busy_s,
            "startup_seconds": busy_s - rollout_s,
            "rollout_seconds": rollout_s,
            "first_to_last_result_s": (max(finished) - min(finished)) if finished else 0.0,
            "prompts_per_s": len(results) / rollout_s if rollout_s > 0 else None,
            "rows_per_s": completions / rollout_s if rollout_s > 0 else None,
        },
    }


_MARKDOWN_ACTIVE = re.compile(r"([\\`*_\[\]()#!|~$])")
"""ASCII punctuation that CommonMark or GFM may read as markup (links, emphasis, tables, code); escaped by a
backslash, which CommonMark allows before any ASCII punctuation."""


def markdown_text(value: object, limit: int = 400) -> str:
    """``value`` as inert Markdown text on one line: HTML escaped, markup characters escaped, cut to ``limit``.

    Why: agent names, model names and error messages come from run folders (model output, other people's
    files); a ``|`` or newline must not break a table and ``<img onerror>`` or ``[x](javascript:)`` must not
    become markup in a Markdown viewer.
    """
    text = " ".join(str(value).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return html.escape(_MARKDOWN_ACTIVE.sub(r"\\\1", text), quote=True)


def plot_label(value: object, limit: int = 60) -> str:
    """``value`` as a matplotlib label: one line, short, ``$`` escaped (mathtext would parse it, and may fail)."""
    text = " ".join(str(value).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("$", "\\$").lstrip("_")


def _fmt(value: object) -> str:
    """A table cell: a finite float to three places, a non-finite one as ``nan`` / ``inf``, anything else as text."""
    if isinstance(value, float):
        return f"{value:.3f}" if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return str(value)
    return markdown_text(value)


def render_markdown(metrics: JsonObject) -> str:
    agents = metrics["agents"]
    ks = sorted({k for m in agents.values() for k in m["pass_at_k"]}, key=lambda s: int(s.split("@")[1]))
    lines = [
        "# Evaluation report",
        "",
        f"Run folder: {markdown_text(metrics['run_dir'])}  ",
        f"Model: {markdown_text(metrics.get('model', 'unknown'))}  ",
        f"Prompts: {metrics['prompts_done']} done, {metrics['prompts_failed']} failed"
        + (f", {metrics['prompts_total']} in the dataset" if metrics.get("prompts_total") else "")
        + f"; {metrics['num_generations_per_prompt']} completions per prompt; "
        f"a completion passes when reward >= {metrics['pass_threshold']}.",
        "",
        f"![rewards and pass@k]({PLOT_FILE})",
        "",
        f"Every prompt group and completion, turn by turn: [{VIEWER_FILE}]({VIEWER_FILE}) (open it in a browser).",
        "",
        "| agent | prompts | mean reward | " + " | ".join(ks) + " | gen tokens (mean) | turns (mean) | truncated |",
        "|---|---|---|" + "---|" * len(ks) + "---|---|---|",
    ]
    for agent, m in agents.items():
        cells: list[object] = [markdown_text(agent) if agent != ALL else "**all**", m["prompts"], m["mean_reward"]]
        cells += [m["pass_at_k"].get(k, "") for k in ks]
        cells += [m["generated_tokens"].get("mean", ""), m["turns"].get("mean", ""), m["truncation_rate"]]
        lines.append("| " + " | ".join(c if isinstance(c, str) else _fmt(c) for c in cells) + " |")
    failures = metrics["failures"]
    if failures["by_error"]:
        examples = failures.get("example_message", {})
        lines += [
            "",
            "## Failures (see failures.jsonl)",
            "",
            "| error | prompts | message (one of them) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {markdown_text(name)} | {count} | {markdown_text(examples.get(name, ''))} |"
            for name, count in sorted(failures["by_error"].items())
        ]
    timing = metrics["timing"]
    lines += [
        "",
        "## Timing",
        "",
        f"- run time: {timing['run_seconds']:.1f} s over {timing['sessions']} recorded session(s): "
        f"{timing['startup_seconds']:.1f} s starting the policy and Gym, {timing['rollout_seconds']:.1f} s rolling out",
        f"- prompt groups per second: {_fmt(timing['prompts_per_s'])}; rows (completions) per second: "
        f"{_fmt(timing['rows_per_s'])}",
    ]
    if ALL in agents:
        lines.append(f"- seconds per prompt group (mean): {agents[ALL]['group_seconds'].get('mean', 0.0):.2f}")
    return "\n".join(lines) + "\n"


def render_plot(metrics: JsonObject, rewards: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    agents = [a for a in metrics["agents"] if a != ALL]
    if rewards:
        left.hist([rewards[a] for a in agents], bins=10, label=[plot_label(a) for a in agents], stacked=True)
        left.legend(fontsize=7)
    left.set_title("Reward distribution (all completions)")
    left.set_xlabel("reward")
    left.set_ylabel("completions")
    for agent in agents + ([ALL] if ALL in metrics["agents"] else []):
        passk = metrics["agents"][agent]["pass_at_k"]
        ks = [int(k.split("@")[1]) for k in passk]
        right.plot(
            ks, list(passk.values()), marker="o", label=plot_label(agent), linestyle="--" if agent == ALL else "-"
        )
        right.set_xticks(ks)
    right.set_title("pass@k per agent")
    right.set_xlabel("k")
    right.set_ylabel("pass@k")
    right.set_ylim(-0.02, 1.02)
    if metrics["agents"]:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_report(run_dir: str | Path) -> JsonObject:
    """Write ``metrics.json``, ``report.md``, ``report.png`` and ``report.html`` into ``run_dir``; return the
    metrics.

    Raises:
        RunReadError: see :func:`read_for_report`; nothing is written then.
    """
    run_dir = Path(run_dir)
    run = read_for_report(run_dir)
    metrics = run_metrics(run)
    rewards: dict[str, list[float]] = defaultdict(list)
    for g in run.groups:
        rewards[g.agent] += g.rewards
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n")
    (run_dir / REPORT_FILE).write_text(render_markdown(metrics))
    render_plot(metrics, rewards, run_dir / PLOT_FILE)
    build_viewer(run_dir)
    return metrics
