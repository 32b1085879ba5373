"""The train-demo's targets from its run folders: held-out gain and its McNemar test, lenient and
other-wording gains, the on-policy error, sync vs async, and TRL's 3-seed band.

    uv run python benchmarks/train_demo_report.py runs/train-demo-SYNC [--repeat runs/...] \\
        [--seeds runs/... [runs/...]] [--async-run runs/... [runs/...]] [--trl runs/bench-trl] \\
        [--wall-min 13.2] [--no-write]

Reads ``metrics.jsonl`` and ``val_results.jsonl`` of each run (``benchmarks/trl_grpo.py``'s JSON
for TRL) and appends one section to history/<date>-train-demo.md. The learning targets are judged on the first sync
run and the first async run. ``--repeat`` runs have SYNC's config and seed: their rollouts (a hash
of every step's token ids) and held-out answers must equal SYNC's. ``--seeds`` are sync runs with
other seeds: with SYNC, each must gain and sit in TRL's band; every async run must not collapse.
Every run gets a row of its own, so the spread between runs is on the page.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path
from typing import Any

from results_file import git_revision, publish, verdict

from gym_bridge.stats import mcnemar_exact
from gym_bridge.training.metrics import read_metrics


def load_run(folder: Path) -> dict[str, Any]:
    lines = read_metrics(folder / "metrics.jsonl")
    answers = [json.loads(line) for line in (folder / "val_results.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m.get("kind") == "train"]
    return {"steps": steps, "vals": [m for m in lines if m.get("kind") == "val"], "answers": answers}


def paired(answers: list[dict[str, Any]], step: int, key: str = "correct") -> list[bool]:
    """One verdict per problem of the main held-out set at ``step`` (first sample)."""
    rows = sorted((a["problem"], a[key]) for a in answers if a["step"] == step and a["set"] == "validation"
                  and a["sample"] == 0)
    return [bool(v) for _, v in rows]


def steps_per_minute(steps: list[dict[str, Any]]) -> float:
    """Training steps per minute of loop time (rollout, train, refit; validation excluded)."""
    return 60.0 * len(steps) / sum(m["time/step_s"] for m in steps)


def curve(vals: list[dict[str, Any]], key: str = "val/accuracy") -> str:
    return " -> ".join(f"{v[key]:.3f} (step {v['step']})" for v in vals)


def section(sync: dict[str, Any], async_run: dict[str, Any] | None, trl: list[dict[str, Any]],
            wall_min: float | None) -> str:
    first, last = sync["vals"][0], sync["vals"][-1]
    gain = last["val/accuracy"] - first["val/accuracy"]
    lenient_gain = last["val/lenient_accuracy"] - first["val/lenient_accuracy"]
    wording_gain = last["val/heldout_wording/accuracy"] - first["val/heldout_wording/accuracy"]
    test = mcnemar_exact(paired(sync["answers"], first["step"]), paired(sync["answers"], last["step"]))
    kl = statistics.median(m["on_policy/gen_kl_error"] for m in sync["steps"] if "on_policy/gen_kl_error" in m)
    out = [
        f"\n## Train demo: held-out learning through NeMo-Gym, {date.today()} "
        f"({platform.machine()}, Python {platform.python_version()}, {git_revision()})\n",
        "| target | measured | verdict |", "|---|---|---|",
    ]
    if wall_min is not None:
        out.append(f"| `make train-demo` <= 15 min incl. start-up | {wall_min:.1f} min | {verdict(wall_min <= 15)} |")
    out += [
        f"| held-out greedy accuracy >= +15 points | {first['val/accuracy']:.3f} -> {last['val/accuracy']:.3f} "
        f"({100 * gain:+.1f}) | {verdict(gain >= 0.15)} |",
        f"| McNemar p < 0.05 (same {test.n} problems) | {test.wrong_to_right} fixed, {test.right_to_wrong} broken, "
        f"p = {test.p_value:.2g} | {verdict(test.p_value < 0.05)} |",
        f"| gain holds under lenient extraction | {first['val/lenient_accuracy']:.3f} -> "
        f"{last['val/lenient_accuracy']:.3f} ({100 * lenient_gain:+.1f}) | {verdict(lenient_gain >= 0.15)} |",
        f"| other wording >= +8 points | {first['val/heldout_wording/accuracy']:.3f} -> "
        f"{last['val/heldout_wording/accuracy']:.3f} ({100 * wording_gain:+.1f}) | {verdict(wording_gain >= 0.08)} |",
        f"| sync median gen_kl_error < 1e-6 | {kl:.1e} | {verdict(kl < 1e-6)} |",
    ]
    sync_rate = steps_per_minute(sync["steps"])
    if async_run is not None:
        async_last = async_run["vals"][-1]["val/accuracy"]
        async_rate = steps_per_minute(async_run["steps"])
        out += [
            f"| sync and async final held-out within 5 points | sync {last['val/accuracy']:.3f}, async "
            f"{async_last:.3f} | {verdict(abs(async_last - last['val/accuracy']) <= 0.05)} |",
            f"| async steps/min >= sync's | async {async_rate:.2f}, sync {sync_rate:.2f} | "
            f"{verdict(async_rate >= sync_rate)} |",
        ]
    if trl:
        band = trl_band(trl)
        ours = {v["step"]: v["val/accuracy"] for v in sync["vals"]}
        inside = all(ours[s] >= lo for s, (lo, _) in band.items() if s in ours and s > 0)
        text = ", ".join(f"step {s}: ours {ours.get(s, float('nan')):.3f} vs {lo:.3f}-{hi:.3f}"
                         for s, (lo, hi) in band.items())
        out.append(f"| held-out curve inside or above TRL's {len(trl)}-seed band | {text} | {verdict(inside)} |")
    out += ["", f"Sync held-out: {curve(sync['vals'])}; other wording: "
            f"{curve(sync['vals'], 'val/heldout_wording/accuracy')}; format rate "
            f"{first['val/format_rate']:.3f} -> {last['val/format_rate']:.3f}.",
            f"Sync train reward per step: {' '.join(f'{m['train/mean_reward']:.2f}' for m in sync['steps'])}; "
            f"{sync_rate:.2f} steps/min, median step {median(sync['steps'], 'time/step_s'):.1f} s "
            f"(rollout {median(sync['steps'], 'time/rollout_s'):.1f} s, "
            f"train {median(sync['steps'], 'time/train_s'):.1f} s), "
            f"validation {median(sync['vals'], 'time/val_s'):.0f} s each."]
    if async_run is not None:
        out.append(f"Async held-out: {curve(async_run['vals'])}; dropped stale groups "
                   f"{async_run['steps'][-1]['staleness/dropped_total']}, median step "
                   f"{median(async_run['steps'], 'time/step_s'):.1f} s.")
    for result in trl:
        out.append(f"TRL seed {result['seed']}: held-out {curve(result['validations'])}; median step "
                   f"{statistics.median(result['step_s']):.1f} s; reward "
                   f"{' '.join(f'{r:.2f}' for r in result['train_reward'])}.")
    return "\n".join(out) + "\n"


def runs_table(runs: list[tuple[str, dict[str, Any]]], trl: list[dict[str, Any]]) -> list[str]:
    """One row per run: its held-out curve, gain and McNemar test, the other wording's gain, its pace, TRL's band."""
    band = trl_band(trl) if trl else {}
    out = ["", "| run | held-out by validation step | gain | McNemar fixed / broken, p | other wording gain "
           "| steps/min | vs TRL's band |", "|---|---|---|---|---|---|---|"]
    for name, run in runs:
        first, last = run["vals"][0], run["vals"][-1]
        test = mcnemar_exact(paired(run["answers"], first["step"]), paired(run["answers"], last["step"]))
        wording = last["val/heldout_wording/accuracy"] - first["val/heldout_wording/accuracy"]
        below = [v["step"] for v in run["vals"] if v["step"] in band and v["step"] > 0
                 and v["val/accuracy"] < band[v["step"]][0]]
        if not band:
            versus = "n/a"
        elif below:
            versus = "below at step " + ", ".join(map(str, below))
        else:
            versus = "inside or above"
        out.append(f"| {name} | {' -> '.join(f'{v['val/accuracy']:.3f}' for v in run['vals'])} "
                   f"| {100 * (last['val/accuracy'] - first['val/accuracy']):+.1f} "
                   f"| {test.wrong_to_right} / {test.right_to_wrong}, {test.p_value:.2g} | {100 * wording:+.1f} "
                   f"| {steps_per_minute(run['steps']):.2f} | {versus} |")
    return out


def repeat_check(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int, int, int]:
    """(steps whose rollout hash is equal, steps compared, validations whose answers are all equal, validations)."""
    hashes = [(x.get("train/rollout_sha256"), y.get("train/rollout_sha256")) for x, y in zip(a["steps"], b["steps"])]
    same_steps = sum(1 for x, y in hashes if x is not None and x == y)

    def answers(run: dict[str, Any]) -> dict[int, list[tuple[Any, ...]]]:
        by_step: dict[int, list[tuple[Any, ...]]] = {}
        for r in run["answers"]:
            by_step.setdefault(r["step"], []).append((r["set"], r["problem"], r["sample"], r["reply"]))
        return {step: sorted(rows) for step, rows in by_step.items()}

    ours, theirs = answers(a), answers(b)
    same_vals = sum(1 for step in ours if ours[step] == theirs.get(step))
    return same_steps, max(len(a["steps"]), len(b["steps"])), same_vals, max(len(ours), len(theirs))


def first_lagged_update(run: dict[str, Any]) -> dict[str, Any] | None:
    """The first step that trained on samples from an older policy version (its ``policy_lag`` is not zero)."""
    return next((m for m in run["steps"] if m.get("train/policy_lag_abs_diff_max", 0.0) > 0.0), None)


def repeat_section(sync: dict[str, Any], repeats: list[dict[str, Any]], seeds: list[dict[str, Any]],
                   asyncs: list[dict[str, Any]], trl: list[dict[str, Any]]) -> list[str]:
    """The targets of runs that repeat: equal rollouts and answers for one seed, every seed learning, async holding."""
    out: list[str] = []
    for i, other in enumerate(repeats, start=2):
        steps, n_steps, vals, n_vals = repeat_check(sync, other)
        out.append(f"| run 1 and run {i} of one config: identical rollout token ids at every step (hash per step) "
                   f"| {steps} of {n_steps} steps | {verdict(steps == n_steps > 0)} |")
        out.append(f"| run 1 and run {i}: identical held-out answers at every validation | {vals} of {n_vals} "
                   f"validations | {verdict(vals == n_vals > 0)} |")
    band = trl_band(trl) if trl else {}
    runs = [sync, *seeds]
    gains, in_band = [], []
    for run in runs:
        first, last = run["vals"][0], run["vals"][-1]
        test = mcnemar_exact(paired(run["answers"], first["step"]), paired(run["answers"], last["step"]))
        gain = last["val/accuracy"] - first["val/accuracy"]
        gains.append((gain, test.p_value))
        in_band.append(all(v["val/accuracy"] >= band[v["step"]][0] for v in run["vals"] if v["step"] in band))
    if seeds:
        text = ", ".join(f"{100 * g:+.1f} (p = {p:.2g})" for g, p in gains)
        out.append(f"| {len(runs)} seeds, sync: each >= +15 points held-out, McNemar p < 0.05 | {text} "
                   f"| {verdict(all(g >= 0.15 and p < 0.05 for g, p in gains))} |")
        if band:
            out.append(f"| {len(runs)} seeds, sync: each inside or above TRL's band at every validation "
                       f"| {sum(in_band)} of {len(runs)} | {verdict(all(in_band))} |")
    if asyncs:
        sync_mean = statistics.mean(r["vals"][-1]["val/accuracy"] for r in runs)
        lows = [min(v["val/accuracy"] for v in r["vals"]) - r["vals"][0]["val/accuracy"] for r in asyncs]
        finals = [r["vals"][-1]["val/accuracy"] for r in asyncs]
        out.append(f"| {len(asyncs)} seeds, async: held-out never below the start | lowest minus start: "
                   f"{', '.join(f'{100 * x:+.1f}' for x in lows)} points | {verdict(all(x >= 0 for x in lows))} |")
        out.append(f"| async final within 5 points of the sync mean ({sync_mean:.3f}) | "
                   f"{', '.join(f'{x:.3f}' for x in finals)} (mean {statistics.mean(finals):.3f}) | "
                   f"{verdict(all(abs(x - sync_mean) <= 0.05 for x in finals))} |")
        lagged = [first_lagged_update(r) for r in asyncs]
        seen = [m for m in lagged if m is not None]
        text = ", ".join(f"step {m['step']}: mean {m['train/policy_lag_abs_diff_mean']:.3f}, max "
                         f"{m['train/policy_lag_abs_diff_max']:.2f}" for m in seen) or "no lagged update"
        ok = bool(seen) and all(m["train/policy_lag_abs_diff_mean"] < 0.02 and m["train/policy_lag_abs_diff_max"] < 1.0
                                for m in seen)
        out.append(f"| async, first lagged update: mean abs logprob difference < 0.02 nats, max < 1 | {text} "
                   f"| {verdict(ok)} |")
        mismatch = [m["train/engine_mismatch_abs_diff_mean"] for r in asyncs for m in r["steps"]
                    if "train/engine_mismatch_abs_diff_mean" in m]
        sync_mismatch = [m["train/engine_mismatch_abs_diff_mean"] for r in runs for m in r["steps"]
                         if "train/engine_mismatch_abs_diff_mean" in m]
        if mismatch and sync_mismatch:
            out.append(f"| async engine mismatch at sync's noise floor (median mean abs difference) | async "
                       f"{statistics.median(mismatch):.1e}, sync {statistics.median(sync_mismatch):.1e} | "
                       f"{verdict(statistics.median(mismatch) <= 10 * statistics.median(sync_mismatch))} |")
    return ["", "| target (runs that repeat) | measured | verdict |", "|---|---|---|", *out] if out else []


def median(lines: list[dict[str, Any]], key: str) -> float:
    return statistics.median(m[key] for m in lines if key in m)


def trl_band(results: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Per validation step, the lowest and highest held-out accuracy over TRL's seeds."""
    steps = sorted({v["step"] for r in results for v in r["validations"]})
    return {
        s: (min(vals), max(vals))
        for s in steps
        if (vals := [v["val/accuracy"] for r in results for v in r["validations"] if v["step"] == s])
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sync_run", type=Path, help="the `make train-demo` run the targets are judged on")
    parser.add_argument("--repeat", type=Path, nargs="*", default=[], help="sync runs of the same config and seed")
    parser.add_argument("--seeds", type=Path, nargs="*", default=[], help="sync runs of the same config, other seeds")
    parser.add_argument("--async-run", type=Path, nargs="*", default=[], help="async runs; the first is judged")
    parser.add_argument("--trl", type=Path, help="benchmarks/trl_grpo.py's output folder")
    parser.add_argument("--wall-min", type=float, help="`make train-demo`'s wall time, start-up included")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    trl = [json.loads(p.read_text()) for p in sorted(args.trl.glob("trl_seed*.json"))] if args.trl else []
    sync, repeats = load_run(args.sync_run), [load_run(p) for p in args.repeat]
    seeds, asyncs = [load_run(p) for p in args.seeds], [load_run(p) for p in args.async_run]
    text = section(sync, asyncs[0] if asyncs else None, trl, args.wall_min)
    text += "\n".join(repeat_section(sync, repeats, seeds, asyncs, trl)) + "\n"
    named = [(f"sync {p.name}", r) for p, r in zip([args.sync_run, *args.repeat, *args.seeds], [sync, *repeats, *seeds])]
    named += [(f"async {p.name}", r) for p, r in zip(args.async_run, asyncs)]
    text += "\n".join(runs_table(named, trl)) + "\n"
    publish(text, topic="train-demo", write=not args.no_write)


if __name__ == "__main__":
    main()
