"""``gym-bridge compare RUN_A RUN_B [RUN_C ...]``: is B better than A, and on which prompts.

Runs are matched prompt by prompt through each result line's ``row_id`` (the dataset row's identity,
:func:`~gym_bridge.eval.records.row_id`), never by position. Every run after the first is compared with
the first (the baseline), over the prompts all runs finished, per agent and overall:

- the difference (B - A) in mean reward and in pass@1 / pass@k, each with a paired percentile bootstrap
  interval over prompts (:func:`~gym_bridge.stats.paired_bootstrap`: seeded, at a stated level);
- McNemar's exact test on each prompt's verdict (a prompt passes when at least half of its completions
  pass, i.e. its pass@1 >= 0.5);
- the prompts whose verdict flipped either way, with their rewards.

Below :data:`~gym_bridge.stats.MIN_PAIRED_PROMPTS` paired prompts a row claims no difference (no ▲ / ▼) and
the gate makes no decision: a percentile bootstrap over a handful of prompts is not an interval. Every text a
run folder holds (folder, model and agent names, prompts) reaches ``compare.md`` as inert Markdown.

Runs with other rows (another dataset) or another grader config (``config_paths``, ``gym_overrides``,
``pass_threshold``) are refused, except a run that ``gym-bridge rescore`` made from the other: there the
grader change is the point, and the report states it. Everything is checked before anything is written.

Each run is streamed through the run-folder reader (:func:`~gym_bridge.eval.gym_runs.load_eval_run`), which keeps per
prompt only its numbers, its dataset line and a short prompt preview, never the line: two runs of 20,000 prompts
of 29 KB lines are read in bounded memory, and, past :data:`PARALLEL_BYTES` of results, the runs after the first
in processes of their own (one per other CPU) while this one reads the first: decoding the lines is most of the
time. The files are written through
:func:`~gym_bridge.boundary.files.write_atomic` (a planted link is replaced, never followed), ``compare.json`` as
strict JSON (a number that is not finite, e.g. a mean of rewards near the float limit, is ``null``; ``compare.md``
shows it as ``n/a``), and every text from a run folder reaches ``compare.md``, an error line or the terminal
with its control characters escaped (:func:`~gym_bridge.boundary.text.shown`).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import stat
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import make_dir
from gym_bridge.boundary.text import shown
from gym_bridge.eval.compare_render import (
    ALL,
    COMPARE_JSON,
    COMPARE_MD,
    COMPARE_PNG,
    GATED_METRICS,
    fmt_interval,
    render_markdown,
    render_plot,
)
from gym_bridge.eval.gym_runs import load_eval_run
from gym_bridge.eval.inert_text import json_out
from gym_bridge.eval.output_files import write_files
from gym_bridge.eval.passk import default_ks, pass_at_k
from gym_bridge.eval.report import safe_mean
from gym_bridge.eval.runs import RESULTS_FILE, LoadedRun, RunGroup
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject
from gym_bridge.stats import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    MIN_PAIRED_PROMPTS,
    mcnemar_exact,
    paired_bootstrap,
)

logger = logging.getLogger(__name__)

GRADER_KEYS = ("config_paths", "gym_overrides", "pass_threshold")
"""What decides a reward: a difference here makes two runs' rewards incomparable, and a rescore may change only
these (everything else made the stored responses)."""
PARALLEL_BYTES = 256 << 20
"""Runs whose ``results.jsonl`` files add up to more than this are read in parallel (the first here, the others in
a process each, one per other CPU at most); smaller ones here, where a process start would cost more than it
saves."""


class CompareError(GymBridgeError, ValueError):
    """The runs cannot be compared: other rows, another grader config, nothing shared, bad options."""


@dataclass
class CompareOutcome:
    report: JsonObject
    out_dir: Path
    worse: list[str]
    """One line per gated comparison in which B is worse than A by more than the margin (empty: none)."""
    undecided: list[str]
    """One line per gated comparison with too few paired prompts to decide (:data:`MIN_PAIRED_PROMPTS`)."""


def compare_runs(
    run_dirs: list[str | Path],
    out_dir: str | Path,
    *,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    fail_if_worse: float | None = None,
) -> CompareOutcome:
    """Compare every run with the first; write ``compare.md``, ``compare.json`` and ``compare.png`` to ``out_dir``.

    Raises:
        RunReadError: a run folder is missing, being written, or has a malformed line (nothing is written).
        CompareError: the runs have other rows or another grader config, share no prompt, or an option
            is out of range (nothing is written).
    """
    if len(run_dirs) < 2:
        raise CompareError("compare needs at least two run folders")
    if not 0.0 < level < 1.0:
        raise CompareError(f"--level must be in (0, 1), got {level}")
    if resamples < 100:
        raise CompareError(f"--resamples must be >= 100, got {resamples}")
    if fail_if_worse is not None and not (math.isfinite(fail_if_worse) and fail_if_worse >= 0):
        raise CompareError(f"--fail-if-worse must be a finite number >= 0, got {fail_if_worse}")
    runs = load_runs(run_dirs)
    labels = _labels(runs)
    base = runs[0]
    grader_changes = [_check_comparable(base, other) for other in runs[1:]]
    shared = [g.key for g in base.groups if all(g.key in r.by_key for r in runs[1:])]
    if not shared:
        raise CompareError(f"{shown(runs[1].dir)} and {shown(base.dir)} share no finished prompt")
    report: JsonObject = {
        "runs": [
            {
                "label": label,
                "dir": str(run.dir),
                "model": run.run.get("model"),
                "prompts_done": len(run.groups),
                "not_shared": len(run.groups) - len(shared),
                "rescored_from": (run.run.get("rescore") or {}).get("source"),
            }
            for label, run in zip(labels, runs, strict=True)
        ],
        "baseline": labels[0],
        "shared_prompts": len(shared),
        "level": level,
        "resamples": resamples,
        "seed": seed,
        "pass_threshold": base.pass_threshold,
        "prompt_passes_when": "pass@1 >= 0.5 (at least half of its completions pass)",
        "min_paired_prompts": MIN_PAIRED_PROMPTS,
        "comparisons": [],
    }
    worse: list[str] = []
    undecided: list[str] = []
    for label, other, change in zip(labels[1:], runs[1:], grader_changes, strict=True):
        comparison = _compare_pair(base, other, shared, level=level, resamples=resamples, seed=seed)
        comparison.update(a=labels[0], b=label, grader_change=change)
        if fail_if_worse is not None:
            comparison["gate"] = _gate(comparison, fail_if_worse, level)
            pair = f"{shown(label)} vs {shown(labels[0])}"
            worse += [f"{pair}: {line}" for line in comparison["gate"]["worse"]]
            if not comparison["gate"]["decided"]:
                undecided.append(f"{pair}: {comparison['gate']['reason']}")
                logger.warning("no gate decision for %s: %s", pair, comparison["gate"]["reason"])
        report["comparisons"].append(comparison)
    markdown, png = render_markdown(report), render_plot(report)
    out = Path(out_dir)
    try:
        make_dir(out)
    except UntrustedInputError as exc:
        raise CompareError(f"--out {exc}") from None
    write_files({out / COMPARE_JSON: json_out(report), out / COMPARE_MD: markdown, out / COMPARE_PNG: png})
    return CompareOutcome(report=report, out_dir=out, worse=worse, undecided=undecided)


def load_runs(run_dirs: list[str | Path]) -> list[LoadedRun]:
    """Each run folder read by :func:`~gym_bridge.eval.gym_runs.load_eval_run`, in order. When their results are larger
    than :data:`PARALLEL_BYTES` together, the first is read here while the others are read in fresh processes
    (one per other CPU at most). The first run's error in order is the one raised, as when they are read one
    after the other.

    Raises:
        RunReadError: a run folder cannot be read (named).
    """
    workers = min(len(run_dirs) - 1, (os.cpu_count() or 1) - 1)
    if workers < 1 or sum(_results_bytes(d) for d in run_dirs) <= PARALLEL_BYTES:
        return [load_eval_run(d) for d in run_dirs]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        others = [pool.submit(load_eval_run, d) for d in run_dirs[1:]]
        first = load_eval_run(run_dirs[0])
        return [first, *(future.result() for future in others)]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _results_bytes(run_dir: str | Path) -> int:
    """The size of a run folder's ``results.jsonl`` (0 when it is not a regular file: the reader names it)."""
    try:
        info = os.stat(Path(run_dir) / RESULTS_FILE)
    except (OSError, ValueError):
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def _labels(runs: list[LoadedRun]) -> list[str]:
    """Each run's folder name; letters when two folders share a name."""
    names = [run.dir.resolve().name for run in runs]
    if len(set(names)) == len(names):
        return names
    return [chr(ord("A") + i) if i < 26 else f"run{i}" for i in range(len(runs))]


def _is_rescore_of(run: LoadedRun, source: LoadedRun) -> bool:
    origin = (run.run.get("rescore") or {}).get("source")
    return origin is not None and Path(origin).resolve() == source.dir.resolve()


def _grader(run: LoadedRun) -> JsonObject:
    fingerprint, config = run.fingerprint, run.config
    return {
        "config_paths": fingerprint.get("config_paths", config.get("config_paths")),
        "gym_overrides": fingerprint.get("gym_overrides", config.get("gym_overrides")),
        "pass_threshold": run.pass_threshold,
    }


def _check_comparable(base: LoadedRun, other: LoadedRun) -> JsonObject | None:
    """The grader change between a rescored run and its source (None when the graders are equal).

    Raises:
        CompareError: another grader config (not a rescore pair), or rows the other run lacks and the
            datasets differ.
    """
    if base.run.get("gym_eval_run") or other.run.get("gym_eval_run"):
        return None  # Gym records neither its grader config nor a dataset hash: the tasks both hold are paired
    a, b = _grader(base), _grader(other)
    changed = {key: {"a": a[key], "b": b[key]} for key in GRADER_KEYS if a[key] != b[key]}
    if changed and not (_is_rescore_of(other, base) or _is_rescore_of(base, other)):
        key = next(iter(changed))
        raise CompareError(
            shown(
                f"{other.dir}: another grader config than {base.dir}: {key} "
                f"({changed[key]['b']!r} vs {changed[key]['a']!r})"
            )
        )
    same_dataset = base.fingerprint.get("dataset_sha256") == other.fingerprint.get("dataset_sha256")
    for this, that in ((other, base), (base, other)):
        extra = [g for g in this.groups if g.key not in that.by_key]
        if extra and not same_dataset:
            first = extra[0]
            raise CompareError(
                shown(
                    f"{this.dir}: other rows than {that.dir}: {len(extra)} of its {len(this.groups)} rows are not "
                    f"there (first: results.jsonl:{first.line}, row_id {first.key}) and the datasets differ "
                    f"(dataset_sha256)"
                )
            )
    return changed or None


def _prompt_metrics(group: RunGroup, threshold: float, ks: list[int]) -> list[float]:
    """Mean reward, then pass@k for each k, of one prompt group."""
    n = len(group.rewards)
    c = sum(r >= threshold for r in group.rewards)
    return [safe_mean(group.rewards), *(pass_at_k(n, c, k) for k in ks)]


def _compare_pair(
    base: LoadedRun, other: LoadedRun, shared: list[str], *, level: float, resamples: int, seed: int
) -> JsonObject:
    """Every metric of both runs per agent and overall, with intervals and McNemar, and the flipped prompts.

    Each prompt's metrics are computed once (metrics x prompts arrays in ``shared`` order); an agent's rows are
    a column selection of them."""
    threshold = base.pass_threshold
    ks = default_ks(min(min(len(r.by_key[k].rewards) for k in shared) for r in (base, other)))
    names = ["mean_reward", *(f"pass@{k}" for k in ks)]
    all_a = np.array([_prompt_metrics(base.by_key[k], threshold, ks) for k in shared]).T
    all_b = np.array([_prompt_metrics(other.by_key[k], threshold, ks) for k in shared]).T
    by_agent: dict[str, list[int]] = {}
    for i, key in enumerate(shared):
        by_agent.setdefault(base.by_key[key].agent, []).append(i)
    groups = {**dict(sorted(by_agent.items())), ALL: list(range(len(shared)))}
    agents = {
        agent: _agent_row(all_a[:, columns], all_b[:, columns], names, level=level, resamples=resamples, seed=seed)
        for agent, columns in groups.items()
    }
    passed_a, passed_b = all_a[1] >= 0.5, all_b[1] >= 0.5
    flips = [
        _flip(base.by_key[shared[i]], other.by_key[shared[i]], "fixed" if passed_b[i] else "broken")
        for i in np.flatnonzero(passed_a != passed_b).tolist()
    ]
    flips.sort(key=lambda f: (f["direction"] != "fixed", f["prompt_idx"]))
    return {"metrics": names, "agents": agents, "flips": flips}


def _agent_row(
    a: np.ndarray, b: np.ndarray, names: list[str], *, level: float, resamples: int, seed: int
) -> JsonObject:
    """One table row: each metric of A and B (metrics x prompts) with the paired interval, and McNemar.

    Rewards near the float limit (their differences or sums would overflow) are resampled scaled down by
    :data:`_SCALE`, a power of two (exact), and the results scaled back: a result past the limit is infinite,
    written as null."""
    test = mcnemar_exact(a[1] >= 0.5, b[1] >= 0.5)
    scales = np.ones(len(names))
    if max(np.abs(a).max(), np.abs(b).max()) > _LARGE:
        scales = np.where(np.maximum(np.abs(a).max(axis=1), np.abs(b).max(axis=1)) > _LARGE, _SCALE, 1.0)
        a, b = a / scales[:, None], b / scales[:, None]
    intervals = paired_bootstrap(b - a, level=level, resamples=resamples, seed=seed)
    with np.errstate(over="ignore"):
        metrics = {
            name: {
                "a": float(a[i].mean() * scales[i]),
                "b": float(b[i].mean() * scales[i]),
                "diff": float(intervals[i].estimate * scales[i]),
                "low": float(intervals[i].low * scales[i]),
                "high": float(intervals[i].high * scales[i]),
                "method": intervals[i].method,
            }
            for i, name in enumerate(names)
        }
    return {
        "prompts": a.shape[1],
        "claims": a.shape[1] >= MIN_PAIRED_PROMPTS,
        "metrics": metrics,
        "mcnemar": {
            "prompts": test.n,
            "fixed": test.wrong_to_right,
            "broken": test.right_to_wrong,
            "p_value": test.p_value,
        },
    }


_LARGE = 2.0**1000
"""Past this, a mean or a difference of per-prompt values may overflow: they are scaled by :data:`_SCALE`."""
_SCALE = 2.0**64


def _flip(a: RunGroup, b: RunGroup, direction: str) -> JsonObject:
    return {
        "direction": direction,
        "row_id": a.key,
        "agent": a.agent,
        "prompt_idx": a.prompt_idx,
        "dataset_line": a.dataset_line,
        "prompt": a.prompt,
        "rewards_a": a.rewards,
        "rewards_b": b.rewards,
    }


def _gate(comparison: JsonObject, delta: float, level: float) -> JsonObject:
    """B is worse than A by more than ``delta`` when the upper end of the overall interval lies below ``-delta``;
    no decision either way below :data:`MIN_PAIRED_PROMPTS` paired prompts."""
    prompts = comparison["agents"][ALL]["prompts"]
    if prompts < MIN_PAIRED_PROMPTS:
        reason = f"{prompts} paired prompts, fewer than the {MIN_PAIRED_PROMPTS} an interval needs"
        return {"delta": delta, "metrics": list(GATED_METRICS), "worse": [], "decided": False, "reason": reason}
    lines = []
    for name in GATED_METRICS:
        m = comparison["agents"][ALL]["metrics"][name]
        if m["high"] < -delta:
            lines.append(f"{name} {fmt_interval(m)} at {level:.0%}: worse by more than {delta}")
    return {"delta": delta, "metrics": list(GATED_METRICS), "worse": lines, "decided": True, "reason": None}
