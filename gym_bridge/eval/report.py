"""``metrics.json``, ``report.md``, ``report.png`` and the trace viewer ``report.html`` of a run folder, from its
files alone, read through :func:`~gym_bridge.eval.gym_runs.load_eval_run` (a malformed or hostile folder is one error
line naming the file, line and field; the report of a run still being written, or killed mid-line, is built
from the lines finished so far).

The results are read once, streamed: each line's numbers go into per-agent tallies (:class:`_Tally`: arrays of
numbers, never the lines) and its page form into the trace viewer's bounded data
(:class:`~gym_bridge.eval.viewer.ViewerPage`) as it passes. Everything is rendered before anything is written,
and every file is written through :func:`~gym_bridge.boundary.files.write_atomic` (a link planted at a name is
replaced, never followed); ``metrics.json`` is strict JSON (:func:`~gym_bridge.boundary.json_io.dumps`: a number
that is not finite is ``null``). A mean is summed exactly and, when the sum would overflow (rewards near the float
limit), over the values divided by their count, so it is finite; a statistic that still is not (a median of two
values at the limit) is ``null`` in ``metrics.json`` and ``n/a`` in ``report.md``, which says so.
"""

from __future__ import annotations

import io
import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gym_bridge.eval.gym_runs import load_eval_run
from gym_bridge.eval.inert_text import json_out, markdown_text, plot_label
from gym_bridge.eval.output_files import write_files
from gym_bridge.eval.passk import default_ks, pass_at_k
from gym_bridge.eval.records import ResultLine
from gym_bridge.eval.runs import LoadedRun, RunGroup
from gym_bridge.eval.viewer import VIEWER_FILE, ViewerPage, page_bytes
from gym_bridge.json_types import JsonObject

METRICS_FILE = "metrics.json"
REPORT_FILE = "report.md"
PLOT_FILE = "report.png"
ALL = "all"


def safe_mean(values: Sequence[float]) -> float:
    """The mean of ``values`` (not empty), summed exactly (``math.fsum``); when that sum overflows (values near
    the float limit), the exact sum of each value divided by the count, which cannot."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        n = len(values)
        return math.fsum(v / n for v in values)


def _stats(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, p95 (the sorted value at ``min(int(n * 0.95), n - 1)``), min and max."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)
    middle = ordered[n // 2] if n % 2 else ordered[n // 2 - 1] / 2 + ordered[n // 2] / 2
    return {
        "mean": safe_mean(ordered),
        "median": float(middle),
        "p95": float(ordered[min(int(n * 95 / 100), n - 1)]),
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
    }


@dataclass
class _Tally:
    """One agent's numbers as the lines stream by: per completion (tokens, turns, flags) and per group (seconds),
    in arrays of doubles; the rewards stay with the groups."""

    generated: array[float] = field(default_factory=lambda: array("d"))
    total: array[float] = field(default_factory=lambda: array("d"))
    turns: array[float] = field(default_factory=lambda: array("d"))
    seconds: array[float] = field(default_factory=lambda: array("d"))
    truncated: int = 0
    termination: Counter[str] = field(default_factory=Counter)

    def add(self, result: ResultLine) -> None:
        self.seconds.append(result.elapsed_s or 0.0)
        for c in result.completions:
            if c.generated_tokens is not None:
                self.generated.append(c.generated_tokens)
            if c.total_tokens is not None:
                self.total.append(c.total_tokens)
            if c.turns is not None:
                self.turns.append(c.turns)
            self.truncated += c.truncated
            self.termination[c.termination or "unknown"] += 1

    def merge(self, other: _Tally) -> None:
        for name in ("generated", "total", "turns", "seconds"):
            getattr(self, name).extend(getattr(other, name))
        self.truncated += other.truncated
        self.termination.update(other.termination)


@dataclass
class _Tallies:
    """Every agent's :class:`_Tally`, and the first and last ``finished_at``, filled by :meth:`visit`."""

    agents: defaultdict[str, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    first_finished: float | None = None
    last_finished: float | None = None

    def visit(self, group: RunGroup, record: JsonObject, result: ResultLine) -> None:
        self.agents[group.agent].add(result)
        if result.finished_at is not None:
            at = result.finished_at
            self.first_finished = at if self.first_finished is None else min(self.first_finished, at)
            self.last_finished = at if self.last_finished is None else max(self.last_finished, at)


def _group_metrics(groups: Sequence[RunGroup], tally: _Tally, threshold: float) -> JsonObject:
    rewards = [r for g in groups for r in g.rewards]
    n = min(len(g.rewards) for g in groups)
    counts = [(len(g.rewards), sum(r >= threshold for r in g.rewards)) for g in groups]
    pass_k = {f"pass@{k}": safe_mean([pass_at_k(size, c, k) for size, c in counts]) for k in default_ks(n)}
    return {
        "prompts": len(groups),
        "completions": len(rewards),
        "mean_reward": safe_mean(rewards),
        "reward": _stats(rewards),
        "pass_at_k": pass_k,
        "generated_tokens": _stats(tally.generated),
        "total_tokens": _stats(tally.total),
        "turns": _stats(tally.turns),
        "truncation_rate": tally.truncated / len(rewards),
        "termination": dict(tally.termination),
        "group_seconds": _stats(tally.seconds),
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


def read_for_report(run_dir: str | Path, tallies: _Tallies | None = None, page: ViewerPage | None = None) -> LoadedRun:
    """The run folder as the report reads it: results and failures, old lines without ``row_id`` accepted, a
    torn last line skipped; each line's numbers into ``tallies`` and its page form into ``page`` as it passes.

    Raises:
        RunReadError: the folder or a file in it is missing, not regular, too large or malformed (named).
    """

    def visit(group: RunGroup, record: JsonObject, result: ResultLine) -> None:
        if tallies is not None:
            tallies.visit(group, record, result)
        if page is not None:
            page.add_group(record, group.line)

    run = load_eval_run(run_dir, need_row_ids=False, finished=False, failures=True, visit=visit)
    if page is not None:
        for failure in run.failures:
            page.add_failure(failure.model_dump(by_alias=True))
    return run


def compute_metrics(run_dir: str | Path) -> JsonObject:
    """Metrics of the finished groups of a run folder (failures later resolved by a resume are not counted).

    Raises:
        RunReadError: see :func:`read_for_report`.
    """
    tallies = _Tallies()
    return run_metrics(read_for_report(run_dir, tallies), tallies)


def run_metrics(run: LoadedRun, tallies: _Tallies) -> JsonObject:
    """Metrics of a run folder read with ``tallies`` filled (:func:`read_for_report`)."""
    threshold = run.pass_threshold
    results = run.groups
    done = {g.prompt_idx for g in results}
    latest_failure = {f.prompt_idx: f for f in run.failures if f.prompt_idx not in done}
    by_agent: dict[str, list[RunGroup]] = defaultdict(list)
    for g in results:
        by_agent[g.agent].append(g)
    agents = {
        agent: _group_metrics(groups, tallies.agents[agent], threshold) for agent, groups in sorted(by_agent.items())
    }
    if results:
        everything = _Tally()
        for agent in sorted(by_agent):
            everything.merge(tallies.agents[agent])
        agents[ALL] = _group_metrics(results, everything, threshold)
    sessions = run.meta.sessions
    busy_s = _finite_sum(s.ended - s.started for s in sessions)
    rollout_s = _finite_sum(s.ended - s.rollouts_started for s in sessions if s.rollouts_started)
    completions = sum(len(g.rewards) for g in results)
    first, last = tallies.first_finished, tallies.last_finished
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
            "first_to_last_result_s": (last - first) if first is not None and last is not None else 0.0,
            "prompts_per_s": len(results) / rollout_s if rollout_s > 0 else None,
            "rows_per_s": completions / rollout_s if rollout_s > 0 else None,
        },
    }


def _finite_sum(values: Iterable[float]) -> float:
    """The exact sum of ``values``; infinity (written as null) when it overflows."""
    items = list(values)
    try:
        return math.fsum(items)
    except OverflowError:
        return math.inf


def _fmt(value: object) -> str:
    """A table cell: a finite float to three places, a non-finite one (or null) as ``n/a``, anything else as
    text."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if math.isfinite(value) else "n/a"
    if isinstance(value, int):
        return str(value)
    return markdown_text(value)


def _non_finite(value: object) -> bool:
    """Whether ``value`` holds a number that is not finite (or a null where a number was), anywhere inside."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(v) for v in value)
    return False


def render_markdown(metrics: JsonObject, viewer_note: str = "") -> str:
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
        f"a completion passes when reward >= {_fmt(metrics['pass_threshold'])}.",
        "",
        f"![rewards and pass@k]({PLOT_FILE})",
        "",
        f"Every prompt group and completion, turn by turn: [{VIEWER_FILE}]({VIEWER_FILE}) (open it in a browser)."
        + (f" {markdown_text(viewer_note, 1000)}." if viewer_note else ""),
        "",
        "| agent | prompts | mean reward | " + " | ".join(ks) + " | gen tokens (mean) | turns (mean) | truncated |",
        "|---|---|---|" + "---|" * len(ks) + "---|---|---|",
    ]
    for agent, m in agents.items():
        cells: list[object] = [markdown_text(agent) if agent != ALL else "**all**", m["prompts"], m["mean_reward"]]
        cells += [m["pass_at_k"].get(k, "") for k in ks]
        cells += [m["generated_tokens"].get("mean", ""), m["turns"].get("mean", ""), m["truncation_rate"]]
        lines.append("| " + " | ".join(c if isinstance(c, str) else _fmt(c) for c in cells) + " |")
    if _non_finite(agents):
        lines += [
            "",
            "n/a: a statistic that is not a finite number (rewards or counts near the float limit); "
            f"{METRICS_FILE} holds null there.",
        ]
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
        f"- run time: {_seconds(timing['run_seconds'])} over {timing['sessions']} recorded session(s): "
        f"{_seconds(timing['startup_seconds'])} starting the policy and Gym, {_seconds(timing['rollout_seconds'])} "
        "rolling out",
        f"- prompt groups per second: {_fmt(timing['prompts_per_s'])}; rows (completions) per second: "
        f"{_fmt(timing['rows_per_s'])}",
    ]
    if ALL in agents:
        lines.append(f"- seconds per prompt group (mean): {_seconds(agents[ALL]['group_seconds'].get('mean', 0.0))}")
    return "\n".join(lines) + "\n"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if math.isfinite(value) else "n/a"


def reward_bins(values: list[float], count: int = 10) -> list[float]:
    """Ten equal bins over the rewards; a span too narrow for float bins (one value, denormals) gets a unit-wide one."""
    low, high = min(values), max(values)
    if high - low < 1e-9 * max(1.0, abs(low), abs(high)):
        low, high = low - 0.5, high + 0.5
    step = (high - low) / count
    return [low + step * i for i in range(count)] + [high]


def render_plot(metrics: JsonObject, rewards: dict[str, list[float]]) -> bytes:
    """``report.png``: the reward histogram per agent and pass@k per agent, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        agents = [a for a in metrics["agents"] if a != ALL]
        finite = {a: [r for r in rewards.get(a, []) if abs(r) < 1e300] for a in agents}
        if any(finite.values()):
            bins = reward_bins([r for a in agents for r in finite[a]])
            left.hist([finite[a] for a in agents], bins=bins, label=[plot_label(a) for a in agents], stacked=True)
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
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out.getvalue()


def build_report(run_dir: str | Path) -> JsonObject:
    """Write ``metrics.json``, ``report.md``, ``report.png`` and ``report.html`` into ``run_dir``; return the
    metrics. Everything is read and rendered first; then each file is written atomically (a link planted at
    the name is replaced, never followed).

    Raises:
        RunReadError: see :func:`read_for_report`; nothing is written then.
    """
    run_dir = Path(run_dir)
    tallies, page = _Tallies(), ViewerPage()
    run = read_for_report(run_dir, tallies, page)
    metrics = run_metrics(run, tallies)
    rewards: dict[str, list[float]] = defaultdict(list)
    for g in run.groups:
        rewards[g.agent] += g.rewards
    markdown = render_markdown(metrics, page.summary)
    png = render_plot(metrics, rewards)
    del rewards
    html_page = page_bytes(page.payload(run.run, run_dir))
    outputs: dict[Path, bytes | str] = {
        run_dir / METRICS_FILE: json_out(metrics),
        run_dir / REPORT_FILE: markdown,
        run_dir / PLOT_FILE: png,
        run_dir / VIEWER_FILE: html_page,
    }
    write_files(outputs)
    return metrics
