"""Per-step training metrics: one JSON line per step, and the reward curve as a PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from gym_bridge.json_types import JsonMapping, JsonObject

type MetricsLine = JsonObject
"""One line of ``metrics.jsonl``: a training step's or a validation's values by name (``kind``, ``step``,
``train/*``, ``val/*``, ...), each a number, a flag, a string or a list of numbers."""


def append_metrics(path: Path, metrics: JsonMapping) -> None:
    """Append one step's metrics to ``path`` (``metrics.jsonl``) and flush."""
    with path.open("a") as f:
        f.write(json.dumps(dict(metrics), sort_keys=True) + "\n")
        f.flush()


def read_metrics(path: Path) -> list[MetricsLine]:
    """Every line of a ``metrics.jsonl``; none when the file does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(
    steps: Sequence[JsonMapping],
    png: Path,
    title: str = "GRPO through NeMo-Gym",
    validations: Sequence[JsonMapping] = (),
) -> Path:
    """Mean reward and pass rate per step, and every ``val/*accuracy`` of ``validations`` against the steps
    done, into ``png`` (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [m["step"] for m in steps]
    ax.plot(x, [m["train/mean_reward"] for m in steps], marker="o", label="mean reward")
    ax.plot(x, [m["train/pass_rate"] for m in steps], marker=".", alpha=0.6, label="pass rate")
    keys = sorted({k for v in validations for k in v if k.startswith("val/") and k.endswith("accuracy")})
    for key in keys:
        points = [(v["step"], v[key]) for v in validations if key in v]
        ax.plot(*zip(*points, strict=True), marker="s", linestyle="--", label=f"held-out {key.removeprefix('val/')}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
