"""Our loss and advantages equal NeMo-RL's own on the same tensors, each check run in a process of its own (NeMo-RL
is imported from a checkout as ``make check-nemo-rl`` imports it):

- ``scripts/nemo_rl_check/losses.py``: ``ClippedPGLossFn`` against our ClippedPGLoss: GRPO's token-level loss, the
  sequence-level loss and GSPO (sequence-level ratios and importance weights), each with the dual clip, truncated
  importance sampling and the reference KL, loss and gradient;
- ``scripts/nemo_rl_check/advantages.py``: ``GRPOAdvantageEstimator`` and ``GDPOAdvantageEstimator`` against our
  GRPO and GDPO advantages on the same reward components;
- ``scripts/nemo_rl_check/distillation.py``: ``DistillationLossFn`` (with its top-k logprob function) against our
  DistillationLoss, each KL type with and without ``zero_outside_topk``, loss and gradient.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NEMO_RL_SRC = os.environ.get("NEMO_RL_SRC")

pytestmark = pytest.mark.skipif(
    not NEMO_RL_SRC, reason="set NEMO_RL_SRC to a NeMo-RL checkout (github NVIDIA-NeMo/RL, 7ea279a) to compare"
)


def check(script: str) -> list[dict[str, Any]]:
    """The script's cases, after asserting it ran and found every case within its tolerance."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/nemo_rl_check" / script), "--nemo-rl-src", str(NEMO_RL_SRC)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode in (0, 1) and results, done.stderr[-3000:]
    return results


def test_our_losses_equal_nemo_rls_on_the_same_tensors() -> None:
    results = check("losses.py")
    names = {r["name"] for r in results}
    assert {"grpo", "sequence-level loss", "gspo", "gspo importance sampling tis", "gspo kl k3"} <= names
    worst = max(results, key=lambda r: max(r["loss_diff"], r["grad_max_diff"]))
    assert worst["loss_diff"] <= 1e-5 and worst["grad_max_diff"] <= 1e-5, worst


def test_our_advantages_equal_nemo_rls_on_the_same_rewards() -> None:
    results = check("advantages.py")
    assert {"grpo", "gdpo", "gdpo weighted", "gdpo not normalized"} <= {r["name"] for r in results}
    worst = max(results, key=lambda r: r["max_diff"])
    assert worst["max_diff"] <= 1e-5, worst


def test_our_distillation_loss_equals_nemo_rls_on_the_same_logits() -> None:
    results = check("distillation.py")
    assert {"forward", "reverse", "mixed", "reverse zero outside top-k"} <= {r["name"] for r in results}
    worst = max(results, key=lambda r: max(r["loss_diff"], r["grad_max_diff"]))
    assert worst["loss_diff"] <= 1e-5 and worst["grad_max_diff"] <= 1e-5, worst
