"""Several policies on one dataset: a config's ``policies`` in turn, one run folder each, then ``compare`` over them.

Ray starts once, then each policy runs as an ordinary single-policy run (:func:`gym_bridge.eval.runner.run_eval`: its
own embedded server or endpoints and its own Gym server set) into ``<output_dir>/<name>``, and
:func:`gym_bridge.eval.compare.compare_runs` writes ``<output_dir>/compare.*`` over them, the first policy the baseline.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gym_bridge.boundary.files import folder_under
from gym_bridge.eval.config import EvalConfig, EvalConfigError
from gym_bridge.eval.dataset import DatasetRow, load_dataset
from gym_bridge.eval.report import describe_model
from gym_bridge.eval.runner import EvalOutcome, run_eval
from gym_bridge.eval.runs import RUN_FILE, ReadLimits
from gym_bridge.eval.shutdown import sigint_deferred
from gym_bridge.eval.store import not_empty
from gym_bridge.preflight import PreflightError

logger = logging.getLogger(__name__)


@dataclass
class PoliciesOutcome:
    """What :func:`run_policies` did: one :class:`EvalOutcome` per policy, in config order, and the comparison."""

    output_dir: Path
    policies: dict[str, EvalOutcome]
    compare_dir: Path | None = None
    """Where ``compare.md`` / ``.json`` / ``.png`` were written (None: one policy, or compare refused)."""
    compare_error: str | None = None
    """Why compare wrote nothing (e.g. no prompt that every policy finished)."""
    ray_start_s: float | None = None
    """Seconds the one Ray start took (None: nothing had to run, or Ray was already running)."""
    seconds: float = 0.0


class _SharedRay:
    """Ray for several runs: started on first need (not at all when every run is finished), stopped at the
    end when started here. ``start_nemo_gym`` finds it running, so no run stops it."""

    def __init__(self) -> None:
        self.started = False
        self.start_s: float | None = None

    def ensure(self) -> None:
        import ray

        from gym_bridge.ray_utils import init_ray

        if ray.is_initialized():
            return
        t0 = time.perf_counter()
        init_ray(num_cpus=os.cpu_count() or 2)
        self.started, self.start_s = True, time.perf_counter() - t0

    def stop(self) -> None:
        if self.started:
            import ray

            with sigint_deferred("stopping Ray"):
                ray.shutdown()
            self.started = False


def run_policies(config: EvalConfig, *, resume: bool = False, progress: bool = True) -> PoliciesOutcome:
    """Run every policy of ``config.policies`` into ``<output_dir>/<name>``, then compare them with the first.

    Ray starts once; each policy brings up its own policy endpoint and Gym server set in turn (Gym's model
    server is configured with one policy endpoint when it starts, see docs/evaluation.md). Every run folder
    is checked before anything starts. With ``resume`` each policy resumes on its own: a finished one runs
    nothing, a partial one runs its pending groups, a missing one starts.

    Raises:
        RunDirError: ``output_dir`` is not empty without ``resume``, or a policy's config changed on resume.
        EvalInterrupted: SIGINT; the finished policies and groups are kept, ``--resume`` continues.
        PreflightError, DatasetError, RunConfigurationError: as :func:`run_eval`.
    """
    from gym_bridge.eval.store import RunDirError

    policies = config.policy_configs()
    if not policies:
        raise EvalConfigError("policies: not set; run a single-policy config with run_eval")
    out = config.output_dir
    if not resume and not_empty(out):
        raise RunDirError(
            f"the output folder {out} is not empty: pass --resume to continue those runs, or choose another output_dir"
        )
    for _, cfg in policies:  # a policy's run folder planted as a link in a received folder is refused, not followed
        if os.path.lexists(cfg.output_dir):
            with folder_under(out, cfg.output_dir):
                pass
    rows = load_dataset(config.dataset, limit=config.limit, routing=config.routing)
    _preflight_endpoints([cfg for _, cfg in policies if not cfg.embedded and not _finished(cfg, rows)], rows)
    started = time.perf_counter()
    ray = _SharedRay()
    outcomes: dict[str, EvalOutcome] = {}
    try:
        for name, cfg in policies:
            logger.info("policy %s: %s", name, describe_model(cfg.model_dump(mode="json")))
            outcomes[name] = run_eval(cfg, resume=resume, progress=progress, before_start=ray.ensure)
    finally:
        ray.stop()
    result = PoliciesOutcome(output_dir=out, policies=outcomes, ray_start_s=ray.start_s)
    if len(policies) > 1:
        from gym_bridge.eval.compare import CompareError, compare_runs
        from gym_bridge.eval.runs import RunReadError

        try:
            compare_runs([cfg.output_dir for _, cfg in policies], out)
            result.compare_dir = out
        except (CompareError, RunReadError) as exc:
            result.compare_error = str(exc)
            logger.warning("compare: %s", exc)
    result.seconds = time.perf_counter() - started
    return result


def _finished(config: EvalConfig, rows: list[DatasetRow]) -> bool:
    """Whether ``config``'s run folder already holds a result for every row (its resume runs nothing)."""
    from gym_bridge.eval.records import ResumeLine
    from gym_bridge.eval.runs import RESULTS_FILE, read_result_lines

    if not (config.output_dir / RUN_FILE).exists() or not (config.output_dir / RESULTS_FILE).exists():
        return False
    lines = read_result_lines(config.output_dir, ReadLimits.from_env(), ResumeLine, need_row_ids=False, finished=False)
    done = {result.prompt_idx for _, _, result in lines}
    return all(row.prompt_idx in done for row in rows)


def _preflight_endpoints(configs: list[EvalConfig], rows: list[DatasetRow]) -> None:
    """Check every endpoint policy that has work to do, before anything starts (embedded ones are checked
    when their server is up)."""
    from gym_bridge.preflight import rows_use_tools
    from gym_bridge.recipes.gym_pre_start import preflight

    tools = rows_use_tools([item.row for item in rows])
    for cfg in configs:
        try:
            preflight(
                cfg.base_urls,
                cfg.model_name,
                tools=tools,
                timeout_s=cfg.preflight_timeout_s,
                api_key=cfg.api_key(),
                label=cfg.output_dir.name,
            )
        except PreflightError:
            logger.error("policy %r: its endpoints failed preflight; nothing was started", cfg.output_dir.name)
            raise
