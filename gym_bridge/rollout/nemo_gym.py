"""AsyncNemoGymRolloutImpl: one prompt group through NeMo-Gym (registered as ``nemo_gym``).

For each prompt it builds N rows from the Gym row in ``extra_env_info`` and the
generation config, asks the :class:`~gym_bridge.gym.transport.client.GymClient` for them (which
picks the actor, streams, checks row indices, re-dispatches lost rows and holds one
deadline, ``timeouts.rollout_s``, over all of it), and turns the typed rows into the N
completions, in generation order, and the group's metrics. Multi-turn episodes happen
inside Gym, so ``max_rollout_turns`` must be 1. Each row carries Gym's rollout identity (the task's
``_ng_task_index``, else the prompt index; rollout ``repeat * N + i``), which the actor stamps on its result. With
a run ``seed`` every row carries its own sampling seed (:func:`~gym_bridge.gym.protocol.numbering.rollout_seed`, of the
run seed, the rollout index and the task's identity), stamped once per group, so a re-dispatched row is sent with the
seed it had.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from pydantic import StrictBool, StrictInt

from gym_bridge.boundary.files import make_dir, open_append
from gym_bridge.boundary.json_io import dumps
from gym_bridge.failures import RolloutRetryPolicy, RolloutStats, RolloutTimeouts, SettingError
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.gym.protocol.result_fields import scalar_fields
from gym_bridge.gym.protocol.rows import build_rows, row_seed, validate_row
from gym_bridge.gym.transport.admission import AdmissionSettings
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.metrics import calculate_single_metric, pct, summarize, token_counts
from gym_bridge.rollout.backend import BackendOptions, RolloutContext
from gym_bridge.rollout.reward_components import component_columns
from gym_bridge.rollout.truncation import gym_completion_truncated
from gym_bridge.types import (
    ActorHandle,
    Completion,
    DatumSpec,
    GenerationConfig,
    GenerationSamplingParams,
    PromptGroupRecord,
    Tokenizer,
)

logger = logging.getLogger(__name__)

NEMO_GYM_TASK = "nemo_gym"
TIMER_PREFIX = "timing/rollout"


class NemoGymOptions(BackendOptions):
    """The ``nemo_gym`` backend's own keywords (see :class:`AsyncNemoGymRolloutImpl`)."""

    nemo_gym_actor: Any = None
    greedy: StrictBool = False
    full_results_path: Path | None = None
    resend_env_infra_failures: StrictBool = True
    seed: StrictInt | None = None
    admission: AdmissionSettings | None = None


class AsyncNemoGymRolloutImpl:
    """The ``nemo_gym`` rollout backend.

    The NemoGym actor comes from ``nemo_gym_actor=`` or from ``task_to_env["nemo_gym"]``
    (where NeMo-RL keeps it); either may be a list of actors (each with its own Gym
    servers, same configs), and each attempt then goes to the one with the fewest rows
    in flight from this backend, avoiding actors that already failed this group.

    The constructor is NeMo-RL's (``policy_generation`` is accepted and unused: Gym's model server calls the
    endpoint); any other keyword is a ``TypeError``, so a misspelt option is never silently dropped. The manager
    builds it with :meth:`from_context`, its own keywords validated by :class:`NemoGymOptions` first.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
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
        greedy: bool = False,
        full_results_path: str | Path | None = None,
        resend_env_infra_failures: bool = True,
        policy_generation: Any = None,
        seed: int | None = None,
        admission: AdmissionSettings | None = None,
    ) -> None:
        """NeMo-RL's positional order. The row budget is ``retry_policy.max_gym_row_attempts`` (one attempt without
        a policy: NeMo-RL's ``single_attempt()``).

        ``resend_env_infra_failures`` (ours; NeMo-RL's behaviour is False): a row the environment masked
        for an infrastructure ``failure_kind`` is re-sent within the row budget instead of entering the
        group masked. It applies only with ``mask_env_flagged_samples``; without masking such rows are kept.

        ``seed`` (ours): the run seed every row's sampling seed is derived from, with the prompt's identity and the
        sample index; the endpoint takes it as its per-request ``seed``. None sends rows unseeded (as NeMo-RL).

        ``admission`` (ours): how the client's rows in flight adapt to a saturated endpoint (None: the default,
        adaptive; :class:`~gym_bridge.gym.transport.admission.AdmissionSettings`)."""
        if generation_config is None:
            raise SettingError(
                "the nemo_gym rollout backend needs generation_config (temperature, top_p, max_new_tokens)"
            )
        unsupported = [key for key in ("stop_strings", "stop_token_ids", "top_k") if generation_config.get(key)]
        if unsupported:
            raise SettingError(
                f"the nemo_gym backend cannot honour generation_config {', '.join(unsupported)}: "
                "NeMo-Gym's model server does not forward them; unset them"
            )
        if greedy:
            raise SettingError("the nemo_gym backend does not support greedy decoding; set temperature instead")
        if max_rollout_turns not in (None, 1):
            raise SettingError(
                f"the nemo_gym backend needs max_rollout_turns=1 or None (got {max_rollout_turns}): "
                "multi-turn episodes are driven by the Gym agent"
            )
        max_gym_row_attempts = (retry_policy or RolloutRetryPolicy.single_attempt()).max_gym_row_attempts
        actors = nemo_gym_actors(task_to_env, nemo_gym_actor)
        self.actors = actors
        self.tokenizer = tokenizer
        self.num_generations = num_generations_per_prompt
        self.max_seq_len = max_seq_len
        self.sampling = GenerationSamplingParams.from_generation_config(generation_config)
        self.max_new_tokens = generation_config.get("max_new_tokens")
        self.timeouts = timeouts or RolloutTimeouts()
        self.max_gym_row_attempts = max_gym_row_attempts
        self.mask_env_flagged_samples = mask_env_flagged_samples
        self.full_results_path = Path(full_results_path) if full_results_path is not None else None
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self.stats = stats or RolloutStats()
        self.client = GymClient(
            actors,
            max_gym_row_attempts=max_gym_row_attempts,
            stats=self.stats,
            timer_prefix=TIMER_PREFIX,
            resend_env_infra_failures=resend_env_infra_failures and mask_env_flagged_samples,
            admission=admission,
        )

    Options = NemoGymOptions

    @classmethod
    def from_context(cls, context: RolloutContext, options: NemoGymOptions) -> Self:
        """The backend from the manager's context and its validated options."""
        return cls(
            context.tokenizer,
            context.task_to_env,
            context.num_generations_per_prompt,
            context.max_seq_len,
            context.max_rollout_turns,
            context.generation_config,
            context.mask_env_flagged_samples,
            context.timeouts,
            context.retry_policy,
            context.stats,
            policy_generation=context.policy_generation,
            **dict(options),
        )

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        t_total = time.perf_counter()
        prompt_idx = int(datum["idx"])
        # The agent name is checked by the client, under the deadline; a ValidGymRow is not validated again.
        template = validate_row(datum.get("extra_env_info"), prompt_idx=prompt_idx)
        async with self.client.loop_turn():  # groups launched together build their rows in turn
            rows = build_rows(
                template,
                self.num_generations,
                self.sampling,
                self.max_new_tokens,
                run_seed=self.seed,
                task_index=prompt_idx,
            )

        t_run = time.perf_counter()
        group = await self.client.run_group(rows, prompt_idx=prompt_idx, deadline_s=self.timeouts.rollout_s)
        run_s = time.perf_counter() - t_run

        t_metrics = time.perf_counter()
        agent = group.agent
        completions = [
            gym_completion(
                row,
                max_seq_len=self.max_seq_len,
                mask_env_flagged_samples=self.mask_env_flagged_samples,
                seed=row_seed(rows[row.row_index]),
                agent=agent,
            )
            for row in group.rows
        ]
        agent = agent or "(unknown)"
        # The datum's row came from gym-bridge's readers (mark_repeats numbers repeats): identity is no verifier field.
        metrics = group_metrics(completions, [agent] * len(completions), fields=[row.metrics for row in group.rows])
        metrics[f"{agent}/full_result"] = full_result_table([c.env_extras for c in completions])
        metrics.update(group.timing)
        metrics[f"{TIMER_PREFIX}/run_rollouts"] = run_s
        metrics[f"{TIMER_PREFIX}/compute_metrics"] = time.perf_counter() - t_metrics
        if self.full_results_path is not None:
            self._append_full_results(self.full_results_path, prompt_idx, agent, completions)
        metrics[f"{TIMER_PREFIX}/total"] = time.perf_counter() - t_total
        return PromptGroupRecord(
            prompt_idx=prompt_idx,
            prompt=group.rows[0].input_message_log,
            extra_env_info=template,
            metadata={"task_name": NEMO_GYM_TASK},
            completions=completions,
            rollout_metrics=metrics,
        )

    @property
    def in_flight_rows(self) -> list[int]:
        """Rows in flight per actor (for metrics and tests)."""
        return self.client.in_flight_rows

    def _append_full_results(self, path: Path, prompt_idx: int, agent: str, completions: list[Completion]) -> None:
        """One line per completion appended to ``path`` (through the boundary: a link or a second hard link planted
        there is refused, never appended to); strict JSON, a non-finite number written as null."""
        lines = [
            dumps({"prompt_idx": prompt_idx, "rowidx": i, "agent": agent, "full_result": c.env_extras}) + b"\n"
            for i, c in enumerate(completions)
        ]
        with open_append(path, root=make_dir(path.parent)) as f:
            f.write(b"".join(lines))


def full_result_table(full_results: Sequence[Any]) -> Any:
    """NeMo-RL's ``{agent}/full_result`` table, one compact JSON per row: a ``wandb.Table`` when wandb is
    installed, else a plain ``{"columns": ["Full result"], "data": [[json], ...]}``."""
    data = [[dumps(r).decode("utf-8")] for r in full_results]
    table = _wandb_table()
    if table is None:
        return {"columns": ["Full result"], "data": data}
    return table(data=data, columns=["Full result"])


@functools.cache
def _wandb_table() -> Any:
    """``wandb.Table``, or None without wandb; looked up once (a failed import searches ``sys.path`` each time,
    ~3 ms, and every group builds a table)."""
    try:
        from wandb import Table
    except ImportError:
        return None
    return Table


def nemo_gym_actors(task_to_env: Mapping[str, Any] | None, explicit: Any = None) -> list[ActorHandle]:
    """The NemoGym actor(s): ``explicit`` when given, else ``task_to_env["nemo_gym"]`` (where NeMo-RL keeps it);
    one handle or a list of them (each with its own Gym servers). ``ValueError`` when there is none."""
    actor = explicit if explicit is not None else (task_to_env or {}).get(NEMO_GYM_TASK)
    given = list(actor) if isinstance(actor, (list, tuple)) else [actor]
    actors: list[ActorHandle] = [a for a in given if a is not None]
    if not actors or len(actors) != len(given):
        raise SettingError(
            "the nemo_gym backend needs a NemoGym actor: pass nemo_gym_actor= or task_to_env['nemo_gym'] "
            "(spinup_nemo_gym_actor makes one)"
        )
    return actors


def gym_completion(
    row: GymRowResult,
    *,
    max_seq_len: int | None,
    mask_env_flagged_samples: bool,
    seed: int | None = None,
    agent: str | None = None,
) -> Completion:
    """One Gym row as a :class:`Completion`: NeMo-RL's length rule for ``truncated``, the environment's mask
    honoured only when ``mask_env_flagged_samples``. Gym's result is kept as it came (``env_extras``), plus
    ``token_drift`` details when the log was cut at a drift. ``seed``: the seed the row was sent with; None
    reads it from the ``responses_create_params`` Gym's result echoes (None when the row had none). ``agent``:
    the agent the row was routed to."""
    full_result = row.full_result
    if row.token_drift is not None:
        full_result = {**full_result, "token_drift": row.token_drift}
    total = token_counts(row.message_log).total
    return Completion(
        message_log=row.message_log,
        env_extras=full_result,
        truncated=gym_completion_truncated(total, max_seq_len),
        reward=row.reward,
        token_drift=row.token_drift is not None,
        masked=row.mask_sample and mask_env_flagged_samples,
        failure_kind=row.failure_kind,
        incomplete_reason=row.incomplete_reason,
        seed=seed if seed is not None else row_seed(row.full_result),
        agent=agent,
        reward_components=row.reward_components,
    )


def group_metrics(
    completions: Sequence[Completion], agents: Sequence[str], fields: Sequence[Mapping[str, float]] | None = None
) -> dict[str, Any]:
    """NeMo-RL's Gym-path metric keys for a group, plus per-agent ``<agent>/<key>`` metrics.

    ``agents`` names each completion's agent (a group may mix agents when a whole batch is one group).
    ``masked_rate`` (and ``<agent>/masked_rate``) counts the samples the environment masked, and
    ``<agent>/failure_kind/<kind>`` how many named each failure kind. Turns are the user messages of a
    log (one per model call). Per-agent metrics take every numeric or boolean field of the Gym results,
    summed over that agent's completions and divided by their count (NeMo-RL's rule): ``fields`` per
    completion when the caller has them (:attr:`GymRowResult.metrics`), else read from ``env_extras``; and
    each reward component of the agent's multi-reward results as ``<agent>/reward/<name>/*`` (0.0 where a result
    lacks the name, as NeMo-RL's columns fill it).
    """
    n = len(completions)
    if len(agents) != n:
        raise SettingError(f"group_metrics got {len(agents)} agent names for {n} completions")
    turns = [sum(m["role"] == "user" for m in c.message_log) for c in completions]
    counts = [token_counts(c.message_log) for c in completions]
    gen, totals = [c.generated for c in counts], [c.total for c in counts]
    max_turn_gen = [
        max((int(m["token_ids"].numel()) for m in c.message_log if m["role"] == "assistant"), default=0)
        for c in completions
    ]
    metrics: dict[str, Any] = {}
    metrics.update(calculate_single_metric([c.reward for c in completions], n, "total_reward"))
    metrics.update(summarize(turns, "turns_per_sample"))
    metrics.update(calculate_single_metric(totals, n, "total_tokens_per_sample"))
    metrics.update(calculate_single_metric(gen, n, "gen_tokens_per_sample"))
    metrics.update(calculate_single_metric(max_turn_gen, n, "max_gen_tokens_per_turn"))
    metrics["max_gen_tokens_per_turn/p95"] = pct(max_turn_gen, 95)
    metrics["truncation_rate"] = sum(c.truncated for c in completions) / n
    metrics["natural_termination_rate"] = 1.0 - metrics["truncation_rate"]
    metrics["token_drift_rate"] = sum(c.token_drift for c in completions) / n
    metrics["max_output_tokens_rate"] = sum(c.incomplete_reason == "max_output_tokens" for c in completions) / n
    metrics["masked_rate"] = sum(c.masked for c in completions) / n
    rows = fields if fields is not None else [scalar_fields(c.env_extras or {}) for c in completions]
    for agent in sorted(set(agents)):
        mine = [i for i, name in enumerate(agents) if name == agent]
        metrics[f"{agent}/masked_rate"] = sum(completions[i].masked for i in mine) / len(mine)
        for kind in sorted({k for i in mine if (k := completions[i].failure_kind)}):
            metrics[f"{agent}/failure_kind/{kind}"] = float(sum(completions[i].failure_kind == kind for i in mine))
        by_key: dict[str, list[float]] = {}
        for i in mine:
            for key, value in rows[i].items():
                by_key.setdefault(key, []).append(value)
        by_key.update(component_columns([completions[i].reward_components for i in mine]))
        for key, values in sorted(by_key.items()):
            metrics.update(calculate_single_metric(values, len(mine), f"{agent}/{key}"))
    metrics["mean_gen_tokens_per_sample"] = metrics["gen_tokens_per_sample/mean"]
    return metrics
