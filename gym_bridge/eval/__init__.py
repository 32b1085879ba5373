"""Standalone agent evaluation: ``gym-bridge eval``, ``report``, ``compare`` and ``rescore``.

- :mod:`.config`   the validated eval config and its resume fingerprint
- :mod:`.dataset`  the JSONL dataset, every line checked before anything runs
- :mod:`.store`    the run folder: append-only, fsynced results and failures; resume; the writer's lock
- :mod:`.records`  one prompt group / one failure as a JSON line, with each completion's trace
- :mod:`.passk`    the unbiased pass@k estimator
- :mod:`.runner`   the run loop (policy endpoint, Gym, bounded concurrency, SIGINT)
- :mod:`.policy_endpoint`  the run's policy endpoint: the configured one, or an embedded server
- :mod:`.gym_launch`  the Gym a run starts: its launch spec, the endpoints' preflight, rows routed
- :mod:`.shutdown`  one bounded shutdown step that a SIGINT does not cut short
- :mod:`.report`   metrics.json, report.md, report.png and report.html from a run folder
- :mod:`.viewer`   report.html: the self-contained trace viewer
- :mod:`.runs`     a finished run folder read strictly (folder, line and field named on any problem)
- :mod:`.compare`  runs compared over the prompts they share: intervals, McNemar, flips, a release gate
- :mod:`.rescore`  stored completions graded again by Gym's ``/verify`` into a new run folder
- :mod:`.rescore_trust`  what a rescore takes from a run folder: grader settings as data, never code or paths

Names resolve on first use (module ``__getattr__``), so ``gym-bridge compare`` and ``report`` do not
import torch or Ray, which only the run loop needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gym_bridge.eval.config import (
        EvalConfig as EvalConfig,
        EvalConfigError as EvalConfigError,
        build_config as build_config,
        load_config as load_config,
    )
    from gym_bridge.eval.dataset import (
        DatasetError as DatasetError,
        DatasetRow as DatasetRow,
        load_dataset as load_dataset,
    )
    from gym_bridge.eval.passk import pass_at_k as pass_at_k
    from gym_bridge.eval.report import build_report as build_report, compute_metrics as compute_metrics
    from gym_bridge.eval.runner import (
        EvalInterrupted as EvalInterrupted,
        EvalOutcome as EvalOutcome,
        run_eval as run_eval,
    )
    from gym_bridge.eval.store import RunDirError as RunDirError, RunStore as RunStore, read_jsonl as read_jsonl

_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("EvalConfig", "EvalConfigError", "build_config", "load_config"),
    "dataset": ("DatasetError", "DatasetRow", "load_dataset"),
    "passk": ("pass_at_k",),
    "report": ("build_report", "compute_metrics"),
    "runner": ("EvalInterrupted", "EvalOutcome", "run_eval"),
    "store": ("RunDirError", "RunStore", "read_jsonl"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    """An exported name, imported from its module on first use."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'gym_bridge.eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gym_bridge.eval.{module}"), name)
    globals()[name] = value
    return value
