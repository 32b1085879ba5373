"""The eval run: check the dataset, open the run folder, start the policy and Gym, roll out
every pending prompt group with bounded concurrency, write each as it finishes, stop cleanly.

Order matters: the dataset is read and validated, the tokenizer named, and the run folder opened (refusing a
changed config on resume; on resume, a link or a second hard link among its files or in ``gym-logs``), before any
server starts. A new run that its input stops before any group is sent (the endpoint, the tokenizer, a file) leaves
no run folder behind. On SIGINT the in-flight groups are
cancelled, finished results stay on disk, Gym and the embedded server are stopped, and
:class:`EvalInterrupted` is raised (the CLI turns it into exit code 130).

A config with ``policies`` runs through :func:`run_policies`: Ray starts once, then each policy in
turn runs as an ordinary single-policy run (its own embedded server or endpoints and its own Gym
server set) into ``<output_dir>/<name>``, and :func:`gym_bridge.eval.compare.compare_runs` writes
``<output_dir>/compare.*`` over them, the first policy the baseline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import folder_under
from gym_bridge.eval.config import EvalConfig, EvalConfigError
from gym_bridge.eval.dataset import DatasetError, DatasetRow, file_sha256, load_dataset
from gym_bridge.eval.gym_launch import check_agents, launch_spec, preflight_policy, routed
from gym_bridge.eval.policy_endpoint import policy_endpoint
from gym_bridge.eval.report import build_report, describe_model
from gym_bridge.eval.runs import RUN_FILE, ReadLimits, recorded_total
from gym_bridge.eval.shutdown import sigint_deferred
from gym_bridge.eval.sink import RunStoreSink
from gym_bridge.eval.store import RunStore, not_empty
from gym_bridge.failures import RunConfigurationError
from gym_bridge.gym.servers.log_folder import check_gym_logs
from gym_bridge.json_types import JsonObject
from gym_bridge.models.registry import ModelNotFoundError, check_model_reference
from gym_bridge.preflight import PreflightError

if TYPE_CHECKING:
    from gym_bridge.rollout.manager import RolloutManager
    from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)

_DRAIN_TIMEOUT_S = 30.0
_BAD_INPUT = (PreflightError, EvalConfigError, DatasetError, ModelNotFoundError, UntrustedInputError)
"""What a run's input (an endpoint, the tokenizer, a file, the rows) raises: a new run stopped by one before any
group was sent removes the folder it made."""


class EvalInterrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT; finished groups are on disk and ``--resume`` continues."""


@dataclass
class EvalOutcome:
    run_dir: Path
    prompts_total: int
    done_before: int
    done_now: int = 0
    failed_now: int = 0
    rollouts_started: float | None = None
    """Wall-clock time when the policy and Gym were up and the first group was sent."""
    metrics: JsonObject = field(default_factory=dict)


@dataclass
class _Progress:
    bar: tqdm
    reward_sum: float = 0.0
    reward_count: int = 0
    failures: int = 0
    completions_now: int = 0
    started: float = field(default_factory=time.perf_counter)

    def result(self, rewards: list[float]) -> None:
        self.reward_sum += math.fsum(rewards)
        self.reward_count += len(rewards)
        self.completions_now += len(rewards)
        self._refresh()

    def failure(self) -> None:
        self.failures += 1
        self._refresh()

    def _refresh(self) -> None:
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix(
            rows_s=f"{self.completions_now / elapsed:.2f}" if elapsed > 0 else "-",
            mean_reward=f"{self.reward_sum / self.reward_count:.3f}" if self.reward_count else "-",
            failures=self.failures,
            refresh=False,
        )
        self.bar.update(1)


def run_eval(
    config: EvalConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    before_start: Callable[[], None] | None = None,
) -> EvalOutcome:
    """Run (or continue) the evaluation described by ``config``; write the report at the end.

    ``before_start`` is called once pending groups are known to exist, before anything starts
    (:func:`run_policies` starts its shared Ray there, so a run that stops none is left running).

    Raises:
        DatasetError: a dataset line is malformed (nothing was started).
        RunDirError: the output folder is not empty without ``resume``, or the config changed.
        EvalInterrupted: SIGINT; finished groups are kept.
        RunConfigurationError: the first groups all failed with the same configuration error
            (the model endpoint's 4xx); finished groups are kept.
    """
    if config.policies is not None:
        raise EvalConfigError("policies: a config with several policies runs through run_policies")
    rows = load_dataset(config.dataset, limit=config.limit, routing=config.routing)
    check_agents(config, rows)
    check_model_reference(config.tokenizer)  # a tokenizer that names nothing: one line, before any folder is made
    fresh = not (resume and (config.output_dir / RUN_FILE).exists())
    if not fresh:
        check_gym_logs(config.output_dir)
    if fresh and not config.embedded:  # a new run's endpoint is checked before its folder is made: none is left
        preflight_policy(config, list(config.base_urls), rows)
    store = RunStore(config.output_dir)
    made_here = not (config.output_dir.exists() or config.output_dir.is_symlink())
    recorded = None if fresh else recorded_total(config.output_dir, ReadLimits.from_env())
    done = store.open(
        config.fingerprint(file_sha256(config.dataset)),
        resume=resume,
        meta={
            "config": config.model_dump(mode="json"),
            "prompts_total": max(len(rows), recorded or 0),  # a resume with a smaller limit keeps the groups it ran
            "model": describe_model(config.model_dump(mode="json")),
        },
    )
    pending = [row for row in rows if row.prompt_idx not in done]
    outcome = EvalOutcome(run_dir=config.output_dir, prompts_total=len(rows), done_before=len(rows) - len(pending))
    logger.info("%d prompt groups to run, %d already done, in %s", len(pending), outcome.done_before, store.dir)
    started = time.time()
    status = "crashed"
    try:
        if pending:
            if before_start is not None:
                before_start()
            interrupted = _run_pending(config, pending, store, outcome, progress=progress, checked=fresh)
            status = "interrupted" if interrupted else "finished"
            if interrupted:
                raise EvalInterrupted(f"interrupted; {len(store.done)} of {len(rows)} prompt groups are in {store.dir}")
        else:
            status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except RunConfigurationError:
        status = "stopped: configuration error"
        raise
    except _BAD_INPUT:  # the embedded server's check, the tokenizer, the rows: a new run's folder holds nothing yet
        store.close()
        if fresh and outcome.rollouts_started is None and not store.done:
            _discard_new_folder(config.output_dir, made_here)
            status = "removed"
        raise
    finally:
        store.close()
        if status != "removed":
            store.record_session(started, outcome=status, rollouts_started=outcome.rollouts_started)
    outcome.metrics = build_report(config.output_dir)
    return outcome


def _discard_new_folder(folder: Path, made_here: bool) -> None:
    """Remove what a new run wrote: the folder when this run made it, else what it put in the empty folder it was
    given (``run.json``, ``run.lock``)."""
    if made_here:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


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


def _run_pending(
    config: EvalConfig,
    pending: list[DatasetRow],
    store: RunStore,
    outcome: EvalOutcome,
    *,
    progress: bool,
    checked: bool = False,
) -> bool:
    """Start everything (the policy endpoint, Ray, Gym: :func:`gym_bridge.recipes.launch.start_nemo_gym`), run the
    pending groups, stop everything; True when SIGINT stopped it. Configured endpoints are checked before their
    tokenizer loads (a bad one stops the run in seconds, before torch is imported), unless ``checked`` (a new run's
    were checked before its folder was made); the embedded server once it is up."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not config.embedded and not checked:
        preflight_policy(config, list(config.base_urls), pending)
    with policy_endpoint(config) as (base_urls, tokenizer):
        if config.embedded:
            preflight_policy(config, base_urls, pending)
        from gym_bridge.recipes.launch import start_nemo_gym

        spec = launch_spec(config, base_urls, pending)
        rollouts = start_nemo_gym(spec, tokenizer)
        try:
            pending = routed(pending, rollouts.actor)
            bar = tqdm(
                total=outcome.prompts_total,
                initial=outcome.done_before,
                unit="group",
                desc="eval",
                disable=not progress,
                mininterval=0.5,
            )
            state = _Progress(bar=bar)
            state.reward_sum = math.fsum(store.resumed_rewards)  # the earlier sessions' results, read once on open
            state.reward_count = len(store.resumed_rewards)
            outcome.rollouts_started = time.time()
            gc.freeze()  # start-up's objects leave the collector's view: no long full-GC pauses mid-run
            try:
                return asyncio.run(_dispatch_all(config, pending, store, rollouts.manager, tokenizer, state, outcome))
            finally:
                bar.close()
                store.update_run(rollout_stats=rollouts.manager.stats.as_metrics())
        finally:
            with sigint_deferred("stopping NeMo-Gym"):
                rollouts.shutdown(timeout_s=config.startup_timeout_s)
            if rollouts.started_ray:
                import ray

                with sigint_deferred("stopping Ray"):
                    ray.shutdown()


async def _dispatch_all(
    config: EvalConfig,
    pending: list[DatasetRow],
    store: RunStore,
    manager: RolloutManager,
    tokenizer: Tokenizer,
    state: _Progress,
    outcome: EvalOutcome,
) -> bool:
    """``concurrency`` workers take pending rows in order; True when SIGINT cancelled them.

    Each group goes through ``manager.collect`` (the config's retry policy) into a
    :class:`RunStoreSink`: a committed group is a result line, a skipped one a failure
    line. A run-stopping error (too many groups dropped in a row, a ``RunConfigurationError`` such as Gym's
    ``token_id_capture.max_mask_fraction`` abort) is recorded, then raised.
    """
    from gym_bridge.data import datum_from_gym_row
    from gym_bridge.rollout.manager import RolloutOutcome

    queue = iter(pending)
    interrupted = False
    sink = RunStoreSink(store, pending, tokenizer)

    async def run_group(item: DatasetRow) -> None:
        try:
            result = await manager.collect(datum_from_gym_row(item.row, idx=item.prompt_idx), sink)
        except Exception as exc:
            sink.record_skip(item.prompt_idx, exc)
            outcome.failed_now += 1
            state.failure()
            raise
        if result is RolloutOutcome.SKIPPED:
            sink.record_skip(item.prompt_idx)
            outcome.failed_now += 1
            state.failure()
        else:
            outcome.done_now += 1
            state.result(sink.rewards.pop(item.prompt_idx))

    async def worker() -> None:
        for item in queue:
            await run_group(item)

    workers = [asyncio.create_task(worker(), name=f"eval-worker-{i}") for i in range(config.concurrency)]

    def on_sigint() -> None:
        nonlocal interrupted
        if not interrupted:
            logger.warning("SIGINT: cancelling the groups in flight; finished groups are kept")
        interrupted = True
        for task in workers:
            task.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure
    finally:
        for task in workers:
            task.cancel()
        await asyncio.wait(workers, timeout=_DRAIN_TIMEOUT_S)
        loop.remove_signal_handler(signal.SIGINT)
    return interrupted
