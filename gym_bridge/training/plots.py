"""A training run's curves at a glance: ``training.png`` and ``training.html`` from its run folder.

One panel per quantity over the steps: reward, held-out accuracy (McNemar's exact test of the last validation
against the first, paired by problem and sample), loss, KL, policy movement, engine mismatch and async lag.
Series that coincide at every point share one line and one label (``accuracy = lenient accuracy``), so no line
hides under another; legends sit to the right of the panels, off the data.

A run folder is untrusted input (people send runs to each other): ``metrics.jsonl`` and ``val_results.jsonl``
are read as an eval run folder's files are (:func:`gym_bridge.training.metrics.iter_jsonl`: through the
boundary, regular files only, the same size caps, streamed line by line), each line typed, and a malformed line
is one :class:`~gym_bridge.boundary.UntrustedInputError` naming ``file:line`` and the field, never skipped (a torn
last line, a run killed mid-write, is skipped). Every text from the folder is escaped in the HTML (control characters as
well), and both files are written through :func:`~gym_bridge.boundary.files.write_atomic` (a link planted at
``training.png`` or ``training.html`` is replaced, never followed).
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import write_atomic
from gym_bridge.boundary.text import shown
from gym_bridge.stats import McNemarResult, mcnemar_exact
from gym_bridge.training.metrics import iter_jsonl

MAX_SETS = 16
PNG, HTML = "training.png", "training.html"
METRICS_FILE = "metrics.jsonl"
VAL_RESULTS_FILE = "val_results.jsonl"

type Series = dict[str, list[tuple[float, float]]]
"""label -> (step, value) points."""


TrainingRunError = UntrustedInputError
"""A training run folder cannot be read (missing, not regular, too large, malformed): the boundary's error, one
line naming the file, line and field (``gym-bridge report`` raises it as ``eval.runs.RunReadError``)."""


class _Line(BaseModel):
    """Strict, as the eval readers: a string is not a number, a number is not a bool."""

    model_config = ConfigDict(strict=True, extra="ignore")


MAX_STEP = 2**53
"""The largest step a metrics line may name: a count of steps, exact as a float."""


class _MetricsLine(_Line):
    """What the plots need of a ``metrics.jsonl`` line: its step (the rest is read as numbers by name)."""

    step: Annotated[float, Field(allow_inf_nan=False, ge=0, le=MAX_STEP)]
    kind: str | None = None


class _Verdict(_Line):
    """One ``val_results.jsonl`` line: a held-out answer of a set at a step."""

    set: str
    step: int
    problem: int
    sample: int
    correct: bool


@dataclass
class Panel:
    """One quantity: its title, y label and series."""

    title: str
    ylabel: str
    series: Series
    note: str = ""


@dataclass
class TrainingRun:
    """What the plots read from a run folder: training lines, validation lines and held-out verdicts."""

    steps: list[dict[str, float]] = field(default_factory=list)
    validations: list[dict[str, float]] = field(default_factory=list)
    verdicts: dict[tuple[str, float], dict[tuple[int, int], bool]] = field(default_factory=dict)
    """(set, step) -> (problem, sample) -> correct."""


@dataclass(frozen=True)
class TrainingPlots:
    """The files written, and each set's McNemar test of the last validation against the first."""

    png: Path
    html: Path
    mcnemar: dict[str, tuple[float, float, McNemarResult]]
    """set -> (first step, last step, result)."""


def _typed_lines[M: BaseModel](path: Path, model: type[M]) -> list[tuple[dict[str, object], M]]:
    """Each line of the JSONL file ``path`` as read and typed as ``model`` (none when the file is absent; blank
    lines and a torn last line skipped).

    Raises:
        UntrustedInputError: not a regular file, over the cap, or a line that is not a JSON object of ``model``'s
            fields (``file:line`` and the field named).
    """
    out = []
    for number, record in iter_jsonl(path):
        try:
            out.append((record, model.model_validate(record)))
        except ValidationError as exc:
            raise UntrustedInputError(f"{shown(path)}:{number}: {_field_problem(exc)}") from None
    return out


def _field_problem(exc: ValidationError) -> str:
    """The first problem pydantic found, in the words of the eval reader: ``field 'x' is missing`` or
    ``field 'x': should be ... (got ...)``."""
    error = exc.errors(include_url=False)[0]
    name = ".".join(str(part) for part in error["loc"])
    if error["type"] == "missing":
        return f"field {shown(name)!r} is missing"
    message = error["msg"].removeprefix("Input ")
    return f"field {shown(name)!r}: {message} (got {shown(repr(error['input'])[:60])})"


def _numbers(line: Mapping[str, object]) -> dict[str, float]:
    """The finite numbers of one metrics line (flags as 0/1); other values left out."""
    return {
        str(k): float(v)
        for k, v in line.items()
        if isinstance(v, (int, float)) and math.isfinite(float(v)) and isinstance(k, str)
    }


def read_training_run(run_dir: str | Path) -> TrainingRun:
    """``metrics.jsonl`` and ``val_results.jsonl`` of a run folder, read by the run-folder reader and typed.

    Raises:
        UntrustedInputError: the folder is missing, a file is not regular or too large, a line is malformed
            (``file:line`` and the field named), or the folder has no training metrics.
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise UntrustedInputError(f"{shown(folder)}: no such run folder")
    run = TrainingRun()
    for record, line in _typed_lines(folder / METRICS_FILE, _MetricsLine):
        (run.validations if line.kind == "val" else run.steps).append(_numbers(record))
    if not run.steps and not run.validations:
        raise UntrustedInputError(f"{shown(folder / METRICS_FILE)}: no training metrics to plot")
    sets: set[str] = set()
    for _, verdict in _typed_lines(folder / VAL_RESULTS_FILE, _Verdict):
        name = verdict.set[:80]
        if name not in sets and len(sets) >= MAX_SETS:
            continue
        sets.add(name)
        run.verdicts.setdefault((name, float(verdict.step)), {})[(verdict.problem, verdict.sample)] = verdict.correct
    return run


def _series(lines: Sequence[Mapping[str, float]], keys: Mapping[str, str]) -> Series:
    """label -> points of each key present; series equal at every point merged into one ``a = b`` label."""
    raw = {label: [(m["step"], m[key]) for m in lines if key in m] for key, label in keys.items()}
    merged: Series = {}
    for label, points in raw.items():
        if not points:
            continue
        same = next((other for other, seen in merged.items() if seen == points), None)
        if same is None:
            merged[label] = points
        else:
            merged[f"{same} = {label}"] = merged.pop(same)
    return merged


def _without_zero(series: Series, label: str) -> Series:
    """``series`` without ``label`` when it is 0 at every point (a reference KL the loss does not have)."""
    return {k: v for k, v in series.items() if not (k == label and all(y == 0 for _, y in v))}


def _train_steps(lines: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """Training lines at the count of steps done (a validation's ``step`` counts steps done too)."""
    return [{**m, "step": m["step"] + 1} for m in lines]


def held_out_tests(run: TrainingRun) -> dict[str, tuple[float, float, McNemarResult]]:
    """Each validation set's McNemar test, last validation against the first, over the answers both have."""
    out: dict[str, tuple[float, float, McNemarResult]] = {}
    for name in sorted({s for s, _ in run.verdicts}):
        steps = sorted(step for s, step in run.verdicts if s == name)
        if len(steps) < 2:
            continue
        first, last = run.verdicts[(name, steps[0])], run.verdicts[(name, steps[-1])]
        shared = sorted(set(first) & set(last))
        if shared:
            out[name] = (steps[0], steps[-1], mcnemar_exact([first[k] for k in shared], [last[k] for k in shared]))
    return out


def panels(run: TrainingRun, tests: Mapping[str, tuple[float, float, McNemarResult]]) -> list[Panel]:
    """The seven panels of a run (the reward panel has each environment's reward when the run has several)."""
    steps = _train_steps(run.steps)
    accuracy_keys = {"val/accuracy": "accuracy", "val/lenient_accuracy": "lenient accuracy"}
    for key in sorted({k for v in run.validations for k in v if k.endswith("/accuracy") and k.count("/") == 2}):
        accuracy_keys[key] = key.removeprefix("val/").replace("/", " ")
    note = "; ".join(
        f"{name}: {t.wrong_to_right} fixed, {t.right_to_wrong} broken of {t.n}, McNemar p={t.p_value:.3g} "
        f"(step {first:g} vs {last:g})"
        for name, (first, last, t) in tests.items()
    )
    kl_keys = {"on_policy/gen_kl_error": "trainer vs engine (gen_kl_error)", "loss/reference_kl": "vs reference"}
    reward_keys = {"train/mean_reward": "mean reward", "train/pass_rate": "pass rate"}
    agent_rewards = sorted({k for v in steps for k in v if k.startswith("train/") and k.endswith("/reward/mean")})
    if len(agent_rewards) > 1:  # a run over several environments: each one's reward too
        reward_keys.update({key: key.split("/")[1] for key in agent_rewards})
    return [
        Panel("reward", "mean reward", _series(steps, reward_keys)),
        Panel("held-out accuracy", "accuracy", _series(run.validations, accuracy_keys), note),
        Panel("loss", "loss", _series(steps, {"train/loss": "loss"})),
        Panel(
            "KL",
            "KL",
            _without_zero(_series(steps, kl_keys), "vs reference"),
        ),
        Panel("policy movement", "mean |dlogp|", _series(steps, {"train/policy_step_abs_diff_mean": "one update"})),
        Panel(
            "engine mismatch",
            "mean |dlogp|",
            _series(steps, {"train/engine_mismatch_abs_diff_mean": "trainer vs engine"}),
        ),
        Panel(
            "async lag (trainer now vs at the sampling version; 0 in sync)",
            "mean |dlogp|",
            _series(steps, {"train/policy_lag_abs_diff_mean": "policy lag"}),
        ),
    ]


def _draw(run_panels: Sequence[Panel], title: str) -> bytes:
    """Each panel on its own axes, one column, legends to the right of the axes; PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(run_panels), 1, figsize=(9, 2.1 * len(run_panels)), sharex=True)
    markers = "osd^v<>"
    for ax, panel in zip(axes, run_panels, strict=True):
        for i, (label, points) in enumerate(panel.series.items()):
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle="-" if i == 0 else "--", label=_label(label))
        if not panel.series:
            ax.text(0.5, 0.5, "not logged in this run", transform=ax.transAxes, ha="center", va="center", alpha=0.6)
        ax.set_title(_label(panel.title), loc="left", fontsize=10)
        ax.set_ylabel(_label(panel.ylabel), fontsize=9)
        ax.grid(alpha=0.3)
        if panel.series:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        if panel.note:
            ax.text(
                1.01, 0.0, _label(panel.note.replace("; ", "\n"), 400), transform=ax.transAxes, fontsize=7, va="bottom"
            )
    axes[-1].set_xlabel("steps done")
    fig.suptitle(_label(title))
    out = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(out, format="png", dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out.getvalue()


def _label(value: object, limit: int = 80) -> str:
    """Text for matplotlib: one line per line (control characters escaped), short, ``$`` escaped (mathtext would
    parse it)."""
    text = "\n".join(shown(part) for part in str(value).split("\n"))
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("$", "\\$")


def _html(run_panels: Sequence[Panel], tests: Mapping[str, tuple[float, float, McNemarResult]], title: str) -> str:
    """A self-contained page: the image, each panel's last values and the held-out tests; every text escaped."""

    def esc(value: object) -> str:
        return html.escape(shown(value))

    rows = []
    for panel in run_panels:
        for label, points in panel.series.items():
            step, value = points[-1]
            rows.append(
                f"<tr><td>{esc(panel.title)}</td><td>{esc(label)}</td><td>{step:g}</td><td>{value:.4g}</td></tr>"
            )
    test_rows = [
        f"<tr><td>{esc(name)}</td><td>{first:g}</td><td>{last:g}</td><td>{t.n}</td><td>{t.wrong_to_right}</td>"
        f"<td>{t.right_to_wrong}</td><td>{t.p_value:.3g}</td></tr>"
        for name, (first, last, t) in tests.items()
    ]
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        "<meta http-equiv='Content-Security-Policy' "
        "content=\"default-src 'none'; img-src 'self'; style-src 'unsafe-inline'\">"
        f"<title>{esc(title)}</title><style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px}}</style>"
        f"</head><body><h1>{esc(title)}</h1><img src='{PNG}' alt='training curves'>"
        "<h2>last values</h2><table><tr><th>panel</th><th>series</th><th>step</th><th>value</th></tr>"
        + "".join(rows)
        + "</table><h2>held-out: last validation against the first (McNemar's exact test)</h2>"
        "<table><tr><th>set</th><th>first step</th><th>last step</th><th>answers</th><th>wrong to right</th>"
        "<th>right to wrong</th><th>p</th></tr>" + "".join(test_rows) + "</table></body></html>\n"
    )


def write_training_plots(run_dir: str | Path, title: str | None = None) -> TrainingPlots:
    """``training.png`` and ``training.html`` in ``run_dir`` from its ``metrics.jsonl`` and ``val_results.jsonl``,
    both rendered before either is written, each written atomically (a planted link is replaced).

    Raises:
        UntrustedInputError: see :func:`read_training_run`; nothing is written then.
    """
    folder = Path(run_dir)
    run = read_training_run(folder)
    tests = held_out_tests(run)
    run_panels = panels(run, tests)
    title = title or f"GRPO training: {folder.name}"
    png, page = folder / PNG, folder / HTML
    try:
        image = _draw(run_panels, title)
    except (ValueError, OverflowError) as exc:  # matplotlib's axis arithmetic on values near the float range
        raise UntrustedInputError(
            f"{shown(folder / METRICS_FILE)}: its values span more than a plot can draw ({exc})"
        ) from None
    text = _html(run_panels, tests, title)
    for path in (png, page):
        if path.is_dir() and not path.is_symlink():
            raise UntrustedInputError(f"{shown(path)}: a folder where gym-bridge writes a file; remove it")
    write_atomic(png, image)
    write_atomic(page, text)
    return TrainingPlots(png, page, tests)
