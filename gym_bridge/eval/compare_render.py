"""``compare.md`` and ``compare.png`` rendered from a comparison's report (what ``compare.json`` holds): per
comparison a table of each metric of A and B with its interval and McNemar, the gate's verdict and the prompts that
flipped; every text from a run folder as inert Markdown (:func:`~gym_bridge.eval.inert_text.markdown_text`), a
number that is not finite as ``n/a``."""

from __future__ import annotations

import io
import math

from gym_bridge.eval.inert_text import markdown_text, plot_label
from gym_bridge.json_types import JsonObject
from gym_bridge.stats import EXPANDED, MIN_PAIRED_PROMPTS

COMPARE_MD = "compare.md"
COMPARE_JSON = "compare.json"
COMPARE_PNG = "compare.png"
ALL = "all"
GATED_METRICS = ("mean_reward", "pass@1")
MD_FLIPS = 200
"""Flipped prompts listed in ``compare.md`` per direction (``compare.json`` lists every one)."""


def fmt_interval(m: dict[str, float], claims: bool = True) -> str:
    """``diff [low, high]``, with ▲ / ▼ when the interval lies above / below 0 and the row may claim it (``n/a``
    for a number that is not finite)."""
    mark = " ▲" if claims and m["low"] > 0 else (" ▼" if claims and m["high"] < 0 else "")
    return f"{_num(m['diff'], '+.3f')} [{_num(m['low'], '+.3f')}, {_num(m['high'], '+.3f')}]{mark}"


def _num(value: float, spec: str = ".3f") -> str:
    """A number for a table cell; ``n/a`` when it is not finite (``compare.json`` holds null there)."""
    return format(value, spec) if math.isfinite(value) else "n/a"


def _rewards(values: list[float]) -> str:
    """A prompt's rewards for a table cell: checked numbers only."""
    return ", ".join(_num(float(r), ".2f") for r in values)


def render_markdown(report: JsonObject) -> str:
    """``compare.md``: the runs, how they are compared, then each comparison's table, gate and flips."""
    lines = _preamble(report)
    for comparison in report["comparisons"]:
        lines += _comparison_lines(comparison)
    return "\n".join(lines) + "\n"


def _preamble(report: JsonObject) -> list[str]:
    """The runs compared, the baseline, the prompts shared and what the intervals and verdicts mean."""
    level = report["level"]
    lines = ["# Comparison", ""]
    for run in report["runs"]:
        extra = f"; rescored from {markdown_text(run['rescored_from'])}" if run.get("rescored_from") else ""
        model = markdown_text(run.get("model") or "model unknown")
        lines.append(f"- **{markdown_text(run['label'])}**: {markdown_text(run['dir'])}: {model}{extra}")
    lines += [
        "",
        f"Baseline: **{markdown_text(report['baseline'])}**. {report['shared_prompts']} prompts finished in every run "
        "are compared (matched by row identity); "
        + ", ".join(
            f"{markdown_text(r['label'])} has {r['not_shared']} more" for r in report["runs"] if r["not_shared"]
        )
        + ("." if any(r["not_shared"] for r in report["runs"]) else "no run has others."),
        f"Differences are B - A with {level:.0%} paired percentile bootstrap intervals over prompts "
        f"({report['resamples']} resamples, seed {report['seed']}); ▲ / ▼: the interval lies above / below 0, "
        f"claimed only over at least {MIN_PAIRED_PROMPTS} paired prompts (below that no ▲ / ▼ and no gate "
        "decision: a bootstrap over a handful of prompts is not an interval). "
        f"A completion passes when its reward >= {report['pass_threshold']}; a prompt passes (McNemar, flips) when "
        "at least half of its completions pass. McNemar: exact two-sided binomial test on the prompts that flipped.",
        "",
        f"![differences with {level:.0%} intervals]({COMPARE_PNG})",
    ]
    if any(
        m.get("method") == EXPANDED
        for comparison in report["comparisons"]
        for row in comparison["agents"].values()
        for m in row["metrics"].values()
    ):
        lines[-2:-2] = [
            "Where the prompts' outcomes are mostly distinct at this scale (continuous rewards), an interval is the "
            "ideal bootstrap's, from the Cornish-Fisher expansion of the resampled mean (`method` in "
            f"{COMPARE_JSON}), not from resampling.",
        ]
    return lines


def _comparison_lines(comparison: JsonObject) -> list[str]:
    """One comparison's section: the grader change of a rescore, the table, the gate, the flipped prompts."""
    a, b = markdown_text(comparison["a"]), markdown_text(comparison["b"])
    lines = ["", f"## {b} vs {a}", ""]
    if comparison.get("grader_change"):
        change = "; ".join(
            f"{markdown_text(k)}: {markdown_text(repr(v['a']))} -> {markdown_text(repr(v['b']))}"
            for k, v in comparison["grader_change"].items()
        )
        lines += [f"Same responses, another grader (a rescore): {change}.", ""]
    lines += _table_lines(comparison, a, b)
    gate = comparison.get("gate")
    if gate is not None:
        verdict = (
            f"no decision: {gate['reason']}"
            if not gate.get("decided", True)
            else "; ".join(gate["worse"])
            if gate["worse"]
            else f"not worse by more than {gate['delta']}"
        )
        lines += ["", f"Gate (--fail-if-worse {gate['delta']} on {', '.join(gate['metrics'])}): {verdict}."]
    if _non_finite(comparison["agents"]):
        note = f"n/a: a number that is not finite (rewards near the float limit); {COMPARE_JSON} holds null."
        lines += ["", note]
    return lines + _flip_lines(comparison["flips"], a, b)


def _table_lines(comparison: JsonObject, a: str, b: str) -> list[str]:
    """One row per agent (and all): each metric of A and B with the interval, then McNemar."""
    names = comparison["metrics"]
    header = ["agent", "prompts"]
    for name in names:
        header += [f"{name} {a}", f"{name} {b}", f"{name} diff"]
    header.append("McNemar fixed / broken (p)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for agent, row in comparison["agents"].items():
        cells = ["**all**" if agent == ALL else markdown_text(agent), str(row["prompts"])]
        for name in names:
            m = row["metrics"][name]
            cells += [_num(m["a"]), _num(m["b"]), fmt_interval(m, row.get("claims", True))]
        test = row["mcnemar"]
        cells.append(f"{test['fixed']} / {test['broken']} (p = {test['p_value']:.3g})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _flip_lines(flips: list[JsonObject], a: str, b: str) -> list[str]:
    """The prompts that flipped, the first :data:`MD_FLIPS` of each direction."""
    lines = ["", f"### Prompts that flipped ({len(flips)})", ""]
    if not flips:
        return [*lines, "None."]
    lines += [
        f"| flip | agent | row | prompt | rewards {a} | rewards {b} |",
        "|---|---|---|---|---|---|",
    ]
    listed = [f for f in flips if f["direction"] == "fixed"][:MD_FLIPS]
    listed += [f for f in flips if f["direction"] == "broken"][:MD_FLIPS]
    for f in listed:
        row = f"{markdown_text(f['row_id'])} (line {markdown_text(f['dataset_line'])})"
        lines.append(
            f"| {f['direction']} | {markdown_text(f['agent'])} | {row} | {markdown_text(f['prompt'])} | "
            f"{_rewards(f['rewards_a'])} | {_rewards(f['rewards_b'])} |"
        )
    if len(listed) < len(flips):
        lines += ["", f"The first {MD_FLIPS} of each direction; all {len(flips)} are in {COMPARE_JSON}."]
    return lines


def _non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def render_plot(report: JsonObject) -> bytes:
    """Per-agent differences (B - A) in mean reward and pass@1 with their intervals, one colour per comparison, as
    PNG bytes (a number that is not finite is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = report["comparisons"]
    agents = list(comparisons[0]["agents"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.2 + 0.45 * len(agents) * len(comparisons)), squeeze=False)
    for ax, name in zip(axes[0], GATED_METRICS, strict=True):
        for j, comparison in enumerate(comparisons):
            ys = [i + 0.8 * (j - (len(comparisons) - 1) / 2) / max(1, len(comparisons)) for i in range(len(agents))]
            ms = [_finite_interval(comparison["agents"][agent]["metrics"][name]) for agent in agents]
            diffs = [m["diff"] for m in ms]
            errors = [[m["diff"] - m["low"] for m in ms], [m["high"] - m["diff"] for m in ms]]
            label = plot_label(f"{comparison['b']} - {comparison['a']}")
            ax.errorbar(diffs, ys, xerr=errors, fmt="o", capsize=3, label=label)
        ax.axvline(0.0, color="grey", linewidth=0.8)
        ax.set_yticks(range(len(agents)), [plot_label(agent) for agent in agents], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name}: difference with {report['level']:.0%} interval")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = io.BytesIO()
    try:
        fig.savefig(out, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out.getvalue()


def _finite_interval(m: dict[str, float]) -> dict[str, float]:
    """``m`` for the plot: an interval with a number past the limit drawn as nan (left out), never an error."""
    values = (m["diff"], m["low"], m["high"])
    if all(math.isfinite(v) and abs(v) < 1e300 for v in values):
        return m
    return {"diff": math.nan, "low": math.nan, "high": math.nan}
