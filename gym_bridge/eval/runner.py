"""The eval run: check the dataset, open the run folder, start the policy and Gym, roll out
every pending prompt group with bounded concurrency, write each as it finishes, stop cleanly.

Order matters: the dataset is read and validated, the tokenizer named, and the run folder opened (refusing a
changed config on resume; on resume, a link or a second hard link among its files or in ``gym-logs``), before any
server starts. A new run that its input stops before any group is sent (the endpoint, the tokenizer, a file) leaves
no run folder behind. On SIGINT the in-flight groups are
cancelled, finished results stay on disk, Gym and the embedded server are stopped, and
:class:`EvalInterrupted` is raised (the CLI turns it into exit code 130).

A config with ``policies`` runs through :func:`gym_bridge.eval.policies.run_policies`, each policy as an ordinary
single-policy run.
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
from gym_bridge.eval.config import EvalConfig, EvalConfigError
from gym_bridge.eval.dataset import DatasetError, DatasetRow, file_sha256, load_dataset
from gym_bridge.eval.gym_launch import check_agents, launch_spec, preflight_policy, routed
from gym_bridge.eval.policy_endpoint import policy_endpoint
from gym_bridge.eval.report import build_report, describe_model
from gym_bridge.eval.runs import RUN_FILE, ReadLimits, recorded_total
from gym_bridge.eval.shutdown import sigint_deferred
from gym_bridge.eval.sink import RunStoreSink
from gym_bridge.eval.store import RunStore
from gym_bridge.failures import RunConfigurationError
from gym_bridge.gym.servers.log_folder import check_gym_logs
from gym_bridge.json_types import JsonObject
from gym_bridge.models.registry import ModelNotFoundError, check_model_reference
from gym_bridge.preflight import PreflightError

if TYPE_CHECKING:
    from gym_bridge.rollout.manager import RolloutManager
    from gym_bridge.types import ActorHandle, Tokenizer

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
    (:func:`~gym_bridge.eval.policies.run_policies` starts its shared Ray there, so a run that stops none is left
    running).

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
            interrupted = _run_pending(config, pending, store, outcome, progress=progress, checked=fresh, every=rows)
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


def _run_pending(
    config: EvalConfig,
    pending: list[DatasetRow],
    store: RunStore,
    outcome: EvalOutcome,
    *,
    progress: bool,
    checked: bool = False,
    every: list[DatasetRow] | None = None,
) -> bool:
    """Start everything (the policy endpoint, Ray, Gym: :func:`gym_bridge.recipes.launch.start_nemo_gym`), run the
    pending groups, stop everything; True when SIGINT stopped it. Configured endpoints are checked before their
    tokenizer loads (a bad one stops the run in seconds, before torch is imported), unless ``checked`` (a new run's
    were checked before its folder was made); the embedded server once it is up. Then, Gym still up, the folder's Gym
    eval-run files over ``every`` row of the dataset (default: ``pending``)."""
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
                interrupted = asyncio.run(
                    _dispatch_all(config, pending, store, rollouts.manager, tokenizer, state, outcome)
                )
            finally:
                bar.close()
                store.update_run(rollout_stats=rollouts.manager.stats.as_metrics())
            _write_gym_files(config.output_dir, rollouts.actor, {r.prompt_idx: r.row for r in every or pending})
            return interrupted
        finally:
            with sigint_deferred("stopping NeMo-Gym"):
                rollouts.shutdown(timeout_s=config.startup_timeout_s)
            if rollouts.started_ray:
                import ray

                with sigint_deferred("stopping Ray"):
                    ray.shutdown()


def _write_gym_files(run_dir: Path, actor: ActorHandle, rows: dict[int, JsonObject]) -> None:
    """The folder's Gym eval-run files (:mod:`gym_bridge.eval.gym_run_files`), while Gym is up; a file that cannot
    be written is one warning: the eval's own files are complete without it."""
    from gym_bridge.eval.gym_run_files import write_gym_run_files

    try:
        files = write_gym_run_files(run_dir, actor, rows)
    except UntrustedInputError as exc:
        logger.warning("Gym's eval-run files not written: %s", exc)
        return
    logger.info("Gym eval-run files: %s (%d rollouts), %s", files.rollouts, files.rollouts_written,
                files.aggregate_metrics or "no aggregate metrics")  # fmt: skip


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
