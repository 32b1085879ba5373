"""Standalone agent evaluation: ``gym-bridge eval CONFIG.yaml`` and ``gym-bridge report RUN_DIR``.

- :mod:`.config`   the validated eval config and its resume fingerprint
- :mod:`.dataset`  the JSONL dataset, every line checked before anything runs
- :mod:`.store`    the run folder: append-only, fsynced results and failures; resume
- :mod:`.records`  one prompt group / one failure as a JSON line
- :mod:`.passk`    the unbiased pass@k estimator
- :mod:`.runner`   the run loop (policy endpoint, Gym, bounded concurrency, SIGINT)
- :mod:`.report`   metrics.json, report.md and report.png from a run folder
"""

from gym_bridge.eval.config import EvalConfig, EvalConfigError, build_config, load_config
from gym_bridge.eval.dataset import DatasetError, DatasetRow, load_dataset
from gym_bridge.eval.passk import pass_at_k
from gym_bridge.eval.report import build_report, compute_metrics
from gym_bridge.eval.runner import EvalInterrupted, EvalOutcome, run_eval
from gym_bridge.eval.store import RunDirError, RunStore, read_jsonl

__all__ = [
    "DatasetError",
    "DatasetRow",
    "EvalConfig",
    "EvalConfigError",
    "EvalInterrupted",
    "EvalOutcome",
    "RunDirError",
    "RunStore",
    "build_config",
    "build_report",
    "compute_metrics",
    "load_config",
    "load_dataset",
    "pass_at_k",
    "read_jsonl",
    "run_eval",
]
