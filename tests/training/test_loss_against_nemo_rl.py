"""Our ClippedPGLoss equals NeMo-RL's own ``ClippedPGLossFn`` on the same tensors: GRPO's token-level loss, the
sequence-level loss and GSPO (sequence-level ratios and importance weights), each with the dual clip, truncated
importance sampling and the reference KL, loss and gradient (``scripts/nemo_rl_check/losses.py``, in a process of
its own: NeMo-RL is imported from a checkout as ``make check-nemo-rl`` imports it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NEMO_RL_SRC = os.environ.get("NEMO_RL_SRC")


@pytest.mark.skipif(
    not NEMO_RL_SRC, reason="set NEMO_RL_SRC to a NeMo-RL checkout (github NVIDIA-NeMo/RL, 7ea279a) to compare losses"
)
def test_our_losses_equal_nemo_rls_on_the_same_tensors() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/nemo_rl_check/losses.py"), "--nemo-rl-src", str(NEMO_RL_SRC)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode in (0, 1) and results, done.stderr[-3000:]
    names = {r["name"] for r in results}
    assert {"grpo", "sequence-level loss", "gspo", "gspo importance sampling tis", "gspo kl k3"} <= names
    worst = max(results, key=lambda r: max(r["loss_diff"], r["grad_max_diff"]))
    assert worst["loss_diff"] <= 1e-5 and worst["grad_max_diff"] <= 1e-5, worst
    assert done.returncode == 0
