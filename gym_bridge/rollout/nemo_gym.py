"""AsyncNemoGymRolloutImpl: one prompt group through NeMo-Gym (registered as ``nemo_gym``).

For each prompt it builds N rows from the Gym row in ``extra_env_info`` and the
generation config, streams them through the NemoGym actor, validates every row
index that comes back, re-dispatches only the rows that never arrived after an
infrastructure failure, and returns the N completions in generation order. One
deadline (``timeouts.rollout_s``) spans every attempt and the whole stream.
Multi-turn episodes happen inside Gym, so ``max_rollout_turns`` must be 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from gym_bridge.failures import (
    FailureClass,
    GymTransportError,
    RolloutDataFailure,
    RolloutFailure,
    RolloutRetryPolicy,
    RolloutStats,
    RolloutTimeouts,
    classify_rollout_failure,
    deadline,
)
from gym_bridge.gym.convert import with_tensors
from gym_bridge.gym.rows import ROW_INDEX_KEY, build_rows, validate_row
from gym_bridge.metrics import calculate_single_metric, pct, summarize
from gym_bridge.rollout.truncation import gym_completion_truncated
from gym_bridge.types import (
    Completion,
    DatumSpec,
    GenerationConfig,
    GenerationSamplingParams,
    LLMMessageLogType,
    PromptGroupRecord,
)

logger = logging.getLogger(__name__)

NEMO_GYM_TASK = "nemo_gym"
TIMER_PREFIX = "timing/rollout"
DEFAULT_GYM_ROW_ATTEMPTS = 3


class GymRowIndexError(GymTransportError):
    """The actor streamed back a row index that is not an int, out of range, not dispatched, or repeated."""


class AsyncNemoGymRolloutImpl:
    """The ``nemo_gym`` rollout backend.

    The NemoGym actor comes from ``nemo_gym_actor=`` or from ``task_to_env["nemo_gym"]``
    (where NeMo-RL keeps it); either may be a list of actors (each with its own Gym
    servers, same configs), and each attempt then goes to the one with the fewest rows
    in flight from this backend, avoiding actors that already failed this group.
    """

    def __init__(
        self,
        tokenizer: Any,
        task_to_env: Mapping[str, Any] | None,
        num_generations_per_prompt: int,
        max_seq_len: int,
        max_rollout_turns: int | None = 1,
        generation_config: GenerationConfig | None = None,
        mask_env_flagged_samples: bool = True,
        timeouts: RolloutTimeouts | None = None,
        retry_policy: RolloutRetryPolicy | None = None,
        stats: RolloutStats | None = None,
        *,
        nemo_gym_actor: Any = None,
        max_gym_row_attempts: int | None = None,
        greedy: bool = False,
        full_results_path: str | Path | None = None,
    ) -> None:
        """NeMo-RL's positional order. The row budget is ``max_gym_row_attempts`` when given, else
        ``retry_policy.max_gym_row_attempts``, else NeMo-RL's config default of 3."""
        if generation_config is None:
            raise ValueError("the nemo_gym rollout backend needs generation_config (temperature, top_p, max_new_tokens)")
        unsupported = [key for key in ("stop_strings", "stop_token_ids", "top_k") if generation_config.get(key)]
        if unsupported:
            raise ValueError(
                f"the nemo_gym backend cannot honour generation_config {', '.join(unsupported)}: "
                "NeMo-Gym's model server does not forward them; unset them"
            )
        if greedy:
            raise ValueError("the nemo_gym backend does not support greedy decoding; set temperature instead")
        if max_rollout_turns not in (None, 1):
            raise ValueError(
                f"the nemo_gym backend needs max_rollout_turns=1 or None (got {max_rollout_turns}): "
                "multi-turn episodes are driven by the Gym agent"
            )
        if max_gym_row_attempts is None:
            max_gym_row_attempts = (
                retry_policy.max_gym_row_attempts if retry_policy is not None else DEFAULT_GYM_ROW_ATTEMPTS
            )
        if max_gym_row_attempts < 1:
            raise ValueError(f"max_gym_row_attempts must be >= 1, got {max_gym_row_attempts}")
        actor = nemo_gym_actor if nemo_gym_actor is not None else (task_to_env or {}).get(NEMO_GYM_TASK)
        actors = list(actor) if isinstance(actor, (list, tuple)) else [actor]
        if not actors or any(a is None for a in actors):
            raise ValueError("the nemo_gym backend needs a NemoGym actor: pass nemo_gym_actor= or task_to_env['nemo_gym']")
        self.actors = actors
        self._in_flight = [0] * len(actors)
        self.tokenizer = tokenizer
        self.num_generations = num_generations_per_prompt
        self.max_seq_len = max_seq_len
        self.sampling = GenerationSamplingParams.from_generation_config(generation_config)
        self.max_new_tokens = generation_config.get("max_new_tokens")
        self.timeouts = timeouts or RolloutTimeouts()
        self.max_gym_row_attempts = max_gym_row_attempts
        self.mask_env_flagged_samples = mask_env_flagged_samples
        self.full_results_path = Path(full_results_path) if full_results_path is not None else None
        self.stats = stats or RolloutStats()
        self._known_agents: list[str] | None = None

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        t_total = time.perf_counter()
        prompt_idx = int(datum["idx"])
        template = datum.get("extra_env_info")
        validate_row(template, prompt_idx=prompt_idx, known_agents=await self._agents())
        rows = build_rows(template, self.num_generations, self.sampling, self.max_new_tokens)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # let the loop breathe between groups launched together (event-loop lag)

        t_run = time.perf_counter()
        async with deadline(self.timeouts.rollout_s, "NeMo-Gym prompt group"):
            results, actor_timing = await self._collect(rows, prompt_idx)
        run_s = time.perf_counter() - t_run

        t_metrics = time.perf_counter()
        completions = [self._completion(result, prompt_idx, i) for i, result in enumerate(results)]
        agent = rows[0]["agent_ref"]["name"]
        metrics = group_metrics(completions, agent)
        metrics.update(actor_timing)
        metrics[f"{TIMER_PREFIX}/run_rollouts"] = run_s
        metrics[f"{TIMER_PREFIX}/compute_metrics"] = time.perf_counter() - t_metrics
        if self.full_results_path is not None:
            self._append_full_results(prompt_idx, agent, completions)
        metrics[f"{TIMER_PREFIX}/total"] = time.perf_counter() - t_total
        return PromptGroupRecord(
            prompt_idx=prompt_idx,
            prompt=results[0]["input_message_log"],
            extra_env_info=template,
            metadata={"task_name": NEMO_GYM_TASK},
            completions=completions,
            rollout_metrics=metrics,
        )

    async def _agents(self) -> list[str] | None:
        if self._known_agents is None and hasattr(self.actors[0], "agent_names"):
            self._known_agents = list(await self.actors[0].agent_names.remote())
        return self._known_agents

    def _pick_actor(self, avoid: set[int]) -> int:
        """The actor with the fewest rows in flight, preferring those not in ``avoid``."""
        candidates = [i for i in range(len(self.actors)) if i not in avoid] or list(range(len(self.actors)))
        return min(candidates, key=lambda i: (self._in_flight[i], i))

    @property
    def in_flight_rows(self) -> list[int]:
        """Rows in flight per actor (for metrics and tests)."""
        return list(self._in_flight)

    async def _collect(self, rows: list[dict[str, Any]], prompt_idx: int) -> tuple[list[dict[str, Any]], dict]:
        """Stream the rows through the actor; re-dispatch only missing rows after an infrastructure failure."""
        n = len(rows)
        results: list[dict[str, Any] | None] = [None] * n
        timing: dict[str, Any] = {}
        last_error: BaseException | None = None
        failed_actors: set[int] = set()
        attempts = 0
        for attempts in range(1, self.max_gym_row_attempts + 1):
            pending = [row for row in rows if results[row[ROW_INDEX_KEY]] is None]
            if not pending:
                break
            if attempts > 1:
                self.stats.gym_row_redispatches += len(pending)
                logger.warning(
                    "prompt_idx=%d: re-dispatching %d of %d rows (attempt %d) after %s: %s",
                    prompt_idx, len(pending), n, attempts, type(last_error).__name__, last_error,
                )
            actor = self._pick_actor(failed_actors)
            try:
                timing = await self._stream(actor, pending, results, n) or timing
            except Exception as exc:
                last_error = exc
                failed_actors.add(actor)
                if classify_rollout_failure(exc) is not FailureClass.INFRA or attempts == self.max_gym_row_attempts:
                    raise
        missing = [i for i, result in enumerate(results) if result is None]
        if missing:
            raise GymTransportError(
                f"prompt_idx={prompt_idx}: stream ended before all rows arrived; missing rows {missing} "
                f"of {n} after {attempts} attempt(s)"
            ) from last_error
        return results, timing  # type: ignore[return-value]

    async def _stream(
        self, actor: int, pending: list[dict[str, Any]], results: list[Any], n: int
    ) -> dict[str, Any] | None:
        dispatched = {row[ROW_INDEX_KEY] for row in pending}
        seen: set[int] = set()
        timing = None
        self._in_flight[actor] += len(pending)
        stream = self.actors[actor].run_rollouts.options(num_returns="streaming").remote(pending, TIMER_PREFIX)
        try:
            async for ref in stream:
                batch, batch_timing = await _unwrapped(ref)
                for rowidx, result in batch:
                    self._accept(actor, rowidx, result, results, n, dispatched, seen)
                if batch_timing:
                    timing = batch_timing
        finally:
            self._in_flight[actor] -= len(pending) - len(seen)
            if len(seen) < len(dispatched):
                _cancel_quietly(stream)
        return timing

    def _accept(
        self, actor: int, rowidx: Any, result: dict[str, Any], results: list[Any], n: int,
        dispatched: set[int], seen: set[int],
    ) -> None:
        """Check one streamed row index and keep its result (tensors restored)."""
        if not isinstance(rowidx, int) or isinstance(rowidx, bool):
            raise GymRowIndexError(f"row index {rowidx!r} is not an int")
        if not 0 <= rowidx < n:
            raise GymRowIndexError(f"row index {rowidx} is outside the expected range [0, {n})")
        if rowidx not in dispatched:
            raise GymRowIndexError(f"row index {rowidx} came back, which was not dispatched in this attempt")
        if rowidx in seen:
            raise GymRowIndexError(f"duplicate row index {rowidx}")
        seen.add(rowidx)
        self._in_flight[actor] -= 1
        results[rowidx] = with_tensors(result)

    def _completion(self, result: dict[str, Any], prompt_idx: int, rowidx: int) -> Completion:
        full_result = result["full_result"]
        if "reward" not in full_result:
            raise RolloutDataFailure(f"prompt_idx={prompt_idx} row {rowidx}: the Gym result has no 'reward'")
        reward = float(full_result["reward"])
        if not math.isfinite(reward):
            raise RolloutDataFailure(f"prompt_idx={prompt_idx} row {rowidx}: the Gym reward is {reward}")
        if not self.mask_env_flagged_samples:
            (full_result.get("instance_config") or {}).pop("mask_sample", None)
        log: LLMMessageLogType = result["message_log"]
        total = sum(int(m["token_ids"].numel()) for m in log)
        drift = result.get("token_drift")
        if drift is not None:
            full_result["token_drift"] = drift
        return Completion(
            message_log=log,
            env_extras=full_result,
            truncated=gym_completion_truncated(total, self.max_seq_len),
            reward=reward,
            token_drift=drift is not None,
        )

    def _append_full_results(self, prompt_idx: int, agent: str, completions: list[Completion]) -> None:
        self.full_results_path.parent.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        with self.full_results_path.open("a") as f:  # type: ignore[union-attr]
            for i, c in enumerate(completions):
                line = {"prompt_idx": prompt_idx, "rowidx": i, "agent": agent, "full_result": c.env_extras}
                f.write(json.dumps(line, default=str) + "\n")


async def _unwrapped(ref: Any) -> Any:
    """Await one streamed element; a typed failure raised in the actor comes back as itself.

    Ray wraps it in a ``RayTaskError(<type>)`` subclass; our failures are picklable and
    name their row, so the caller gets the original type (and counts it by its name).
    """
    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RolloutFailure):
            raise exc.cause from None
        raise


def _cancel_quietly(stream: Any) -> None:
    try:
        ray.cancel(stream)
    except Exception as exc:  # the stream may already be finished or its actor gone
        logger.debug("could not cancel a NeMo-Gym stream: %s", exc)


def _scalar_fields(full_result: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in full_result.items()
        if isinstance(value, (int, float, bool)) and not key.startswith("_")
    }


def group_metrics(completions: list[Completion], agent: str) -> dict[str, Any]:
    """NeMo-RL's Gym-path metric keys for one group, plus per-agent ``<agent>/<key>`` metrics.

    Turns are the user messages of a log (one per model call); per-agent metrics
    take every numeric or boolean field of the Gym results (means over the
    completions that have the field).
    """
    n = len(completions)
    turns = [sum(m["role"] == "user" for m in c.message_log) for c in completions]
    gen = [sum(int(m["token_ids"].numel()) for m in c.message_log if m["role"] == "assistant") for c in completions]
    totals = [sum(int(m["token_ids"].numel()) for m in c.message_log) for c in completions]
    max_turn_gen = [
        max((int(m["token_ids"].numel()) for m in c.message_log if m["role"] == "assistant"), default=0)
        for c in completions
    ]
    metrics: dict[str, Any] = {}
    metrics.update(calculate_single_metric([c.reward for c in completions], "total_reward"))
    metrics.update(summarize(turns, "turns_per_sample"))
    metrics.update(calculate_single_metric(totals, "total_tokens_per_sample"))
    metrics.update(calculate_single_metric(gen, "gen_tokens_per_sample"))
    metrics.update(calculate_single_metric(max_turn_gen, "max_gen_tokens_per_turn"))
    metrics["max_gen_tokens_per_turn/p95"] = pct(max_turn_gen, 95)
    metrics["truncation_rate"] = sum(c.truncated for c in completions) / n
    metrics["natural_termination_rate"] = 1.0 - metrics["truncation_rate"]
    metrics["token_drift_rate"] = sum(c.token_drift for c in completions) / n
    metrics["max_output_tokens_rate"] = (
        sum(_incomplete_reason(c.env_extras) == "max_output_tokens" for c in completions) / n
    )
    fields: dict[str, list[float]] = {}
    for c in completions:
        for key, value in _scalar_fields(c.env_extras or {}).items():
            fields.setdefault(key, []).append(value)
    for key, values in sorted(fields.items()):
        metrics.update(calculate_single_metric(values, f"{agent}/{key}"))
    metrics["mean_gen_tokens_per_sample"] = metrics["gen_tokens_per_sample/mean"]
    return metrics


def _incomplete_reason(full_result: Mapping[str, Any] | None) -> str | None:
    response = (full_result or {}).get("response") or {}
    details = response.get("incomplete_details") if isinstance(response, Mapping) else None
    return details.get("reason") if isinstance(details, Mapping) else None
