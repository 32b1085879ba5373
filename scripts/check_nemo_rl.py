"""NeMo-RL's own rollout code, imported unmodified from a checkout, run against gym-bridge on real Gym servers.

    make check-nemo-rl NEMO_RL_SRC=/path/to/NeMo-RL
    uv run python scripts/check_nemo_rl.py --nemo-rl-src /path/to/NeMo-RL [--only a_async,b_manager]

What starts: a local Ray (``gym_bridge.init_ray``), our OpenAI-compatible server over the scripted policy (real
token ids of the embedded tiny tokenizer), and one of our NemoGym actors on real NeMo-Gym servers (the
wheel's ``vllm_model``, ``example_single_tool_call`` and ``equivalence_rule``), started through
``gym_bridge.spinup_nemo_gym_actor`` (NeMo-RL's signature). Every check uses two prompts (one per agent) and
two generations per prompt.

The checks (``CHECKS``; each passes or fails on its own and names NeMo-RL's file:line when it fails there):

a_async     NeMo-RL's ``run_async_nemo_gym_rollout`` with our actor in ``task_to_env["nemo_gym"]``
a_sync      NeMo-RL's ``run_nemo_gym_rollout_sync`` with our actor
b_manager   NeMo-RL's ``RolloutManager(use_nemo_gym=True)`` (its ``AsyncNemoGymRolloutImpl``) with our actor
c_grpo      our ``run_nemo_gym_rollout_sync`` through grpo.py's post-processing, function by function
c_collector our ``run_async_nemo_gym_rollout`` through NeMo-RL's trajectory collector (``_iter_rollout_groups``)
d_impl      our ``AsyncNemoGymRolloutImpl`` built by NeMo-RL's ``RolloutManager`` with its own keywords
e_same      NeMo-RL's batch functions and impl against ours on the same batches and actor: the same final_batch
            keys, dtypes, token ids, rewards, records and metric values (the scripted policy is deterministic)

Batches are built by NeMo-RL's data path (``nemo_gym_data_processor``, ``rl_collate_fn``,
``repeat_interleave``); the config is NeMo-RL's default Gym recipe loaded by NeMo-RL's loader. The generation
object NeMo-RL's Gym functions take is read only for ``.cfg`` on that path (Gym's model server calls our
endpoint), so it is a holder of ``policy.generation``. Exit status: 0 when every check passed, 1 otherwise,
2 when the harness could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nemo_rl_check import imports  # noqa: E402

from gym_bridge.gym_versions import ROLLOUT_IDENTITY_KEYS  # noqa: E402  (light: package metadata only)

if TYPE_CHECKING:
    import torch
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.data.interfaces import DatumSpec as NemoRLDatum
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict as NemoRLBatch
    from wandb import Table

    from gym_bridge.json_types import JsonMapping, JsonObject
    from gym_bridge.types import ActorHandle, Tokenizer

    type Found = Any
    """A value the checks compare between NeMo-RL's objects and ours: either system's result, record or column."""

RECIPE = "examples/nemo_gym/grpo_workplace_assistant_nemotron_nano_v2_9b.yaml"
"""NeMo-RL's default Gym recipe (the one examples/nemo_gym/run_grpo_nemo_gym.py loads without --config)."""
NUM_PROMPTS = 2
NUM_GENERATIONS = 2
MAX_SEQ_LEN = 4096
RECIPE_OVERRIDES = [
    f"grpo.num_prompts_per_step={NUM_PROMPTS}",
    f"grpo.num_generations_per_prompt={NUM_GENERATIONS}",
    f"policy.max_total_sequence_length={MAX_SEQ_LEN}",
    "policy.generation.max_new_tokens=64",
    # The recipe leaves this key out and NeMo-RL's own MasterConfig requires it (7ea279a).
    "++policy.megatron_cfg.moe_per_layer_logging=false",
    # grpo.py's optional post-processing, switched on so that the checks run it.
    "grpo.use_dynamic_sampling=true",
    "grpo.overlong_filtering=true",
    "grpo.reward_scaling.enabled=true",
    "grpo.reward_scaling.target_min=-1.0",
    "grpo.reward_scaling.target_max=1.0",
    "grpo.advantage_clip_low=-3.0",
    "grpo.advantage_clip_high=3.0",
    "grpo.invalid_tool_call_advantage=-5.0",
    "grpo.malformed_thinking_advantage=-5.0",
]
CHECK_TIMEOUT_S = 240.0
STARTUP_TIMEOUT_S = 300.0


# ---- reporting ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    title: str
    ok: bool
    seconds: float
    error: str = ""
    where: str = ""
    notes: list[str] = field(default_factory=list)


class CheckFailed(AssertionError):
    """An expectation of a check, with the values that broke it."""


_unmet: list[str] = []
"""The current check's unmet expectations: a check goes on after one, so a run reports all of them."""


def expect(condition: object, message: str) -> None:
    if not condition:
        _unmet.append(message)


def locate(error: BaseException, nemo_rl_root: Path) -> str:
    """``NeMo-RL file:line`` of the innermost NeMo-RL frame, then the innermost frame, of ``error``'s traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    where = []
    nemo = [f for f in frames if str(nemo_rl_root) in f.filename]
    if nemo:
        f = nemo[-1]
        where.append(f"NeMo-RL {Path(f.filename).relative_to(nemo_rl_root)}:{f.lineno} ({f.line})")
    if frames and (not nemo or frames[-1] is not nemo[-1]):
        f = frames[-1]
        try:
            shown = str(Path(f.filename).relative_to(Path.cwd()))
        except ValueError:
            shown = f.filename
        where.append(f"innermost {shown}:{f.lineno} ({f.line})")
    return "; ".join(where)


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    lines = [line for line in text.splitlines() if line.strip()]
    # A Ray task error carries the remote traceback; its last line is the remote exception.
    if len(lines) > 6:
        lines = lines[:2] + ["..."] + lines[-3:]
    return "\n".join(lines)


# ---- NeMo-RL side: config, data, the generation holder ---------------------------------------------------


class GenerationConfigHolder:
    """What NeMo-RL's Gym path reads from ``policy_generation``: ``.cfg`` (``vllm_cfg.max_model_len``) only."""

    def __init__(self, cfg: JsonObject) -> None:
        self.cfg = cfg


def load_master_config(root: Path) -> MasterConfig:
    from omegaconf import OmegaConf

    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers

    register_omegaconf_resolvers()
    cfg = parse_hydra_overrides(load_config(root / RECIPE), RECIPE_OVERRIDES)
    return MasterConfig(**OmegaConf.to_container(cfg, resolve=True))


def gym_rows() -> list[JsonObject]:
    """One equivalence row the scripted policy answers right, one tool-call row (two agents)."""
    from gym_bridge.testing.gym_rows import equivalence_row, tool_call_rows

    return [equivalence_row("Reply with exactly: 42", "42"), tool_call_rows()[0]]


def nemo_rl_datums(tokenizer: Tokenizer) -> list[NemoRLDatum]:
    """NeMo-RL's DatumSpecs for :func:`gym_rows`, made by its own ``nemo_gym_data_processor``."""
    from nemo_rl.data.processors import nemo_gym_data_processor

    return [
        nemo_gym_data_processor(
            {"extra_env_info": json.dumps(row), "task_name": "nemo_gym"}, None, tokenizer, MAX_SEQ_LEN, idx
        )
        for idx, row in enumerate(gym_rows())
    ]


def nemo_rl_repeated_batch(tokenizer: Tokenizer, collector_self: object = None) -> NemoRLBatch:
    """grpo.py's ``repeated_batch``: ``rl_collate_fn`` then ``repeat_interleave``; with ``collector_self`` the
    async collector's ``_stamp_nemo_gym_task_indices`` first (``_ng_task_index`` per prompt)."""
    from nemo_rl.data.collate_fn import rl_collate_fn

    batch = rl_collate_fn(nemo_rl_datums(tokenizer))
    if collector_self is not None:
        collector_class()._stamp_nemo_gym_task_indices(collector_self, batch)
    return batch.repeat_interleave(NUM_GENERATIONS)


def collector_class() -> type:
    from nemo_rl.algorithms.async_utils.trajectory_collector import AsyncTrajectoryCollector

    return AsyncTrajectoryCollector.__ray_metadata__.modified_class


def generation_config(mc: MasterConfig) -> JsonObject:
    """grpo.py's ``generation_config`` for the Gym path (stop criteria cleared, grpo.py ~2939)."""
    return {**mc.policy["generation"], "stop_token_ids": None, "stop_strings": None}


# ---- shared assertions ----------------------------------------------------------------------------------


def table_rows(table: Table) -> list[JsonObject]:
    return [json.loads(row[0]) for row in table.data]


def check_message_logs(message_logs: Sequence[Sequence[JsonMapping]], where: str, notes: list[str]) -> None:
    """Token ids int64, assistant logprobs float and as long as the tokens, as NeMo-RL's training code needs."""
    import torch

    for i, log in enumerate(message_logs):
        expect(log and log[0]["role"] == "user", f"{where}: row {i} does not start with a user message")
        expect(any(m["role"] == "assistant" for m in log), f"{where}: row {i} has no assistant message")
        for j, message in enumerate(log):
            ids = message["token_ids"]
            expect(isinstance(ids, torch.Tensor), f"{where}: row {i} msg {j} token_ids is {type(ids).__name__}")
            expect(ids.dtype == torch.int64, f"{where}: row {i} msg {j} token_ids dtype {ids.dtype}, not int64")
            if message["role"] == "assistant":
                lp = message.get("generation_logprobs")
                expect(isinstance(lp, torch.Tensor), f"{where}: row {i} msg {j} generation_logprobs missing")
                expect(lp.is_floating_point(), f"{where}: row {i} msg {j} generation_logprobs dtype {lp.dtype}")
                expect(
                    lp.shape == ids.shape,
                    f"{where}: row {i} msg {j} logprobs {tuple(lp.shape)} vs token_ids {tuple(ids.shape)}",
                )
                expect(bool(torch.isfinite(lp).all()), f"{where}: row {i} msg {j} non-finite logprobs")
                missing = [k for k in ("is_invalid_tool_call", "has_malformed_thinking") if k not in message]
                if missing:
                    note = (
                        f"{where}: assistant messages lack {missing} (NeMo-RL's actor sets both, nemo_gym.py:941-942; "
                        "grpo.py's invalid_tool_call/malformed_thinking advantages read them with .get(..., False))"
                    )
                    if note not in notes:
                        notes.append(note)


ROLLOUT_METRIC_KEYS = (
    "total_reward/mean",
    "turns_per_sample/mean",
    "gen_tokens_per_sample/mean",
    "total_tokens_per_sample/mean",
    "max_gen_tokens_per_turn/mean",
    "mean_gen_tokens_per_sample",
    "natural_termination_rate",
    "truncation_rate",
)


def check_final_batch(result: Found, agents: list[str], where: str, notes: list[str], tables: bool) -> list[float]:
    """A NemoGymRolloutResult as grpo.py consumes it; returns the rewards Gym graded (from the full results)."""
    import torch

    final = result.final_batch
    n = len(agents)
    expect(final.size == n, f"{where}: final_batch.size {final.size}, expected {n}")
    required = ("agent_ref", "message_log", "length", "loss_multiplier", "total_reward", "truncated", "mask_sample")
    absent = [key for key in required if key not in final]
    if absent:
        expect(False, f"{where}: final_batch lacks {absent} (has {sorted(final)}; mask_sample: masking is on)")
        return []
    expect([r["name"] for r in final["agent_ref"]] == agents, f"{where}: agents {final['agent_ref']} != {agents}")
    expect(final["truncated"].dtype == torch.bool, f"{where}: truncated dtype {final['truncated'].dtype}")
    expect(final["mask_sample"].dtype == torch.bool, f"{where}: mask_sample dtype {final['mask_sample'].dtype}")
    expect(result.input_ids.dtype == torch.int64, f"{where}: input_ids dtype {result.input_ids.dtype}")
    expect(result.input_ids.shape[0] == n, f"{where}: input_ids rows {result.input_ids.shape[0]} != {n}")
    check_message_logs(final["message_log"], where, notes)
    for i, log in enumerate(final["message_log"]):
        expect(int(final["length"][i]) == log[0]["token_ids"].numel(), f"{where}: length[{i}] != first message")
    metrics = result.rollout_metrics
    missing = [k for k in ROLLOUT_METRIC_KEYS if k not in metrics]
    expect(not missing, f"{where}: rollout_metrics lack {missing}")
    for agent in dict.fromkeys(agents):
        expect(f"{agent}/reward/mean" in metrics, f"{where}: rollout_metrics lack {agent}/reward/mean")
    rewards = [float(r) for r in final["total_reward"].tolist()]
    if final["total_reward"].dtype != torch.float32:
        notes.append(f"{where}: total_reward dtype {final['total_reward'].dtype}")
    graded: list[float] = []
    if tables:
        by_agent = {a: table_rows(metrics[f"{a}/full_result"]) for a in dict.fromkeys(agents) if f"{a}/full_result" in metrics}
        if len(by_agent) != len(set(agents)):
            expect(False, f"{where}: no {{agent}}/full_result table with log_full_result_tables on")
        else:
            seen: dict[str, int] = {}
            for agent in agents:
                graded.append(float(by_agent[agent][seen.get(agent, 0)]["reward"]))
                seen[agent] = seen.get(agent, 0) + 1
            expect(rewards == graded, f"{where}: total_reward {rewards} != Gym's graded rewards {graded}")
    expect(
        metrics["total_reward/mean"] == sum(rewards) / n or math.isclose(metrics["total_reward/mean"], sum(rewards) / n),
        f"{where}: total_reward/mean {metrics['total_reward/mean']} != mean of {rewards}",
    )
    return rewards


def check_record(record: Found, agent: str, where: str, notes: list[str]) -> None:
    """A PromptGroupRecord from a manager: N completions, rewards = Gym's graded reward, metrics present."""
    expect(len(record.completions) == NUM_GENERATIONS, f"{where}: {len(record.completions)} completions")
    check_message_logs([c.message_log for c in record.completions], where, notes)
    for i, c in enumerate(record.completions):
        graded = c.env_extras.get("reward") if isinstance(c.env_extras, dict) else None
        expect(graded is not None, f"{where}: completion {i} env_extras has no Gym 'reward' (keys {list(c.env_extras)[:8]})")
        expect(float(c.reward) == float(graded), f"{where}: completion {i} reward {c.reward} != Gym's {graded}")
    metrics = record.rollout_metrics
    missing = [k for k in ROLLOUT_METRIC_KEYS + (f"{agent}/reward/mean", f"{agent}/full_result") if k not in metrics]
    expect(not missing, f"{where}: rollout_metrics lack {missing}")
    expect("timing/rollout/total" in metrics, f"{where}: rollout_metrics lack timing/rollout/total")


# ---- the checks -----------------------------------------------------------------------------------------


@dataclass
class Env:
    root: Path
    mc: MasterConfig
    tokenizer: Tokenizer
    actor: ActorHandle
    generation: GenerationConfigHolder
    agents: list[str]


def run_async_batch(
    env: Env, fn: Callable[..., AsyncIterator[Found]], batch: NemoRLBatch, *, tables: bool
) -> list[Found]:
    """Drain ``fn`` (a ``run_async_nemo_gym_rollout``) with the trajectory collector's keywords."""
    from nemo_rl.experience.rollouts import get_nemo_gym_thinking_tags, should_mask_flagged_samples

    async def drain() -> list[Found]:
        return [
            r
            async for r in fn(
                policy_generation=env.generation,
                input_batch=batch,
                tokenizer=env.tokenizer,
                task_to_env={"nemo_gym": env.actor},
                max_seq_len=env.mc.policy["max_total_sequence_length"],
                generation_config=generation_config(env.mc),
                num_generations=NUM_GENERATIONS,
                log_full_result_tables=tables,
                max_rollout_turns=None,
                greedy=False,
                reward_penalty_config=env.mc.reward_penalties,
                thinking_tags=get_nemo_gym_thinking_tags(env.mc.env),
                mask_env_flagged_samples=should_mask_flagged_samples(env.mc.env),
                deduplicate_multimodal_data=False,
                debug_payload_metrics=False,
            )
        ]

    return asyncio.run(drain())


def run_sync_batch(env: Env, fn: Callable[..., Found], batch: NemoRLBatch) -> Found:
    """``fn`` (a ``run_nemo_gym_rollout_sync``) called keyword for keyword as grpo.py's training step calls it."""
    from nemo_rl.algorithms.grpo import _get_effort_config
    from nemo_rl.experience.rollouts import get_nemo_gym_thinking_tags, should_mask_flagged_samples
    from nemo_rl.utils.logger import should_log_nemo_gym_full_result_tables

    mc = env.mc
    log_tables = should_log_nemo_gym_full_result_tables(
        wandb_enabled=mc.logger["wandb_enabled"], wandb_config=mc.logger["wandb"]
    )
    assert log_tables is False, log_tables
    return fn(
        policy_generation=env.generation,
        input_batch=batch,
        tokenizer=env.tokenizer,
        task_to_env={"nemo_gym": env.actor},
        max_seq_len=mc.policy["max_total_sequence_length"],
        generation_config=generation_config(mc),
        # The recipe's logger.wandb.log_nemo_gym_full_result_tables is false (log_tables); the check turns the
        # tables on to read the rewards Gym graded.
        log_full_result_tables=True,
        max_rollout_turns=None,
        greedy=False,
        effort_config=_get_effort_config(mc),
        reward_penalty_config=mc.reward_penalties,
        thinking_tags=get_nemo_gym_thinking_tags(mc.env),
        mask_env_flagged_samples=should_mask_flagged_samples(mc.env),
        deduplicate_multimodal_data=mc.grpo.deduplicate_multimodal_data,
        debug_payload_metrics=mc.grpo.debug_payload_metrics,
    )


def check_a_async(env: Env, notes: list[str]) -> None:
    from nemo_rl.experience.rollouts import run_async_nemo_gym_rollout

    collector = SimpleNamespace(_next_nemo_gym_task_index=100)
    batch = nemo_rl_repeated_batch(env.tokenizer, collector)
    results = run_async_batch(env, run_async_nemo_gym_rollout, batch, tables=True)
    expect(len(results) == NUM_PROMPTS, f"{len(results)} groups streamed, expected {NUM_PROMPTS}")
    expect(sorted(r.task_index for r in results) == [100, 101], f"task indices {[r.task_index for r in results]}")
    for r in results:
        agent = env.agents[r.task_index - 100]
        rewards = check_final_batch(r, [agent] * NUM_GENERATIONS, f"group {r.task_index}", notes, tables=True)
        if agent == env.agents[0]:
            expect(rewards == [1.0] * NUM_GENERATIONS, f"equivalence group rewards {rewards}, expected 1.0 each")
    expect("timing/rollout/total" in results[-1].rollout_metrics, "last group lacks timing/rollout/total")


def check_a_sync(env: Env, notes: list[str]) -> None:
    from nemo_rl.experience.rollouts import run_nemo_gym_rollout_sync

    result = run_sync_batch(env, run_nemo_gym_rollout_sync, nemo_rl_repeated_batch(env.tokenizer))
    agents = [a for a in env.agents for _ in range(NUM_GENERATIONS)]
    rewards = check_final_batch(result, agents, "sync batch", notes, tables=True)
    expect(rewards[:NUM_GENERATIONS] == [1.0] * NUM_GENERATIONS, f"equivalence rewards {rewards[:NUM_GENERATIONS]}")


def nemo_rl_manager(env: Env, **kwargs: object) -> Found:
    from nemo_rl.experience.rollout_manager import RolloutManager, RolloutRetryPolicy, RolloutTimeouts

    return RolloutManager(
        tokenizer=env.tokenizer,
        task_to_env={"nemo_gym": env.actor},
        num_generations_per_prompt=NUM_GENERATIONS,
        max_seq_len=env.mc.policy["max_total_sequence_length"],
        generation_config=generation_config(env.mc),
        use_nemo_gym=True,
        timeouts=RolloutTimeouts(rollout_s=120.0),
        retry_policy=RolloutRetryPolicy(max_infra_attempts=2, max_data_attempts=1, max_gym_row_attempts=2),
        **kwargs,
    )


def run_manager(env: Env, manager: Found, notes: list[str], where: str) -> None:
    async def go() -> list[Found]:
        return [await manager.run_rollout(datum) for datum in nemo_rl_datums(env.tokenizer)]

    records = asyncio.run(go())
    for i, (record, agent) in enumerate(zip(records, env.agents, strict=True)):
        check_record(record, agent, f"{where} prompt {i}", notes)
        expect(record.prompt_idx == i, f"{where} prompt {i}: prompt_idx {record.prompt_idx}")
    eq = [float(c.reward) for c in records[0].completions]
    expect(eq == [1.0] * NUM_GENERATIONS, f"{where}: equivalence rewards {eq}, expected 1.0 each")


def check_b_manager(env: Env, notes: list[str]) -> None:
    from nemo_rl.experience import rollout_manager as nrm

    manager = nemo_rl_manager(env)
    expect(type(manager._impl) is nrm.AsyncNemoGymRolloutImpl, f"impl is {type(manager._impl)}")
    run_manager(env, manager, notes, "NeMo-RL manager")


def check_d_impl(env: Env, notes: list[str]) -> None:
    """NeMo-RL's RolloutManager builds *our* impl: its module global swapped for the construction only."""
    from nemo_rl.experience import rollout_manager as nrm

    from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl as Ours

    try:
        import gym_bridge

        gym_bridge.AsyncNemoGymRolloutImpl  # noqa: B018
    except AttributeError:
        notes.append("gym_bridge does not export AsyncNemoGymRolloutImpl (imported from gym_bridge.rollout.nemo_gym)")
    theirs = nrm.AsyncNemoGymRolloutImpl
    nrm.AsyncNemoGymRolloutImpl = Ours
    try:
        manager = nemo_rl_manager(env)
    finally:
        nrm.AsyncNemoGymRolloutImpl = theirs
    expect(isinstance(manager._impl, Ours), f"impl is {type(manager._impl)}")
    run_manager(env, manager, notes, "NeMo-RL manager over our impl")


def check_c_grpo(env: Env, notes: list[str]) -> None:
    """Our sync batch function, then grpo.py's post-processing in grpo_train's order (grpo.py ~2985-3310)."""
    import torch

    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.utils import calculate_baseline_and_std_per_prompt
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.utils.timer import Timer

    import gym_bridge

    mc = env.mc
    tok = env.tokenizer
    results = [run_sync_batch(env, gym_bridge.run_nemo_gym_rollout_sync, nemo_rl_repeated_batch(tok)) for _ in range(2)]
    agents = [a for a in env.agents for _ in range(NUM_GENERATIONS)]
    for k, r in enumerate(results):
        check_final_batch(r, agents, f"our sync batch {k}", notes, tables=True)
    raw = [r.final_batch["total_reward"].tolist() for r in results]

    # Dynamic sampling across two generation batches (grpo.py's loop): the cache grows by from_batches.
    batch_cache = None
    timer = Timer()
    train_rows = mc.grpo.num_prompts_per_step * mc.grpo.num_generations_per_prompt
    cumulative = 0
    for k, result in enumerate(results):
        # scale_rewards writes into the batch it is given: this loop works on copies.
        repeated_batch = grpo.scale_rewards(copy.deepcopy(result.final_batch), mc.grpo.reward_scaling)
        scaled = repeated_batch["total_reward"].tolist()
        expect(
            all(math.isclose(x, 2.0 * r - 1.0, abs_tol=1e-6) for x, r in zip(scaled, raw[k], strict=True)),
            f"scale_rewards gave {scaled} for {raw[k]} (source [0, 1] -> target [-1, 1])",
        )
        rewards = repeated_batch["total_reward"]
        baseline, std = calculate_baseline_and_std_per_prompt(
            result.input_ids, rewards, torch.ones_like(rewards),
            leave_one_out_baseline=mc.grpo.use_leave_one_out_baseline,
        )
        keep = int((std != 0.0).sum())
        cumulative += keep
        repeated_batch, complete, batch_cache, _ = grpo.dynamic_sampling(
            repeated_batch, std, baseline, k + 1, mc, timer, batch_cache
        )
        want = min(cumulative, train_rows) if keep else 0
        expect(repeated_batch.size == want, f"dynamic_sampling returned {repeated_batch.size} rows, expected {want}")
        expect(complete == (keep > 0 and cumulative >= train_rows), f"dynamic_sampling complete={complete}")
    notes.append(
        f"dynamic sampling: {cumulative} of {2 * NUM_PROMPTS * NUM_GENERATIONS} rows had non-zero std "
        "(the scripted policy is deterministic, so groups have equal rewards)"
    )
    # The rest of the step runs on one complete batch: the first result, with dynamic sampling's columns.
    repeated_batch = grpo.scale_rewards(results[0].final_batch, mc.grpo.reward_scaling)
    merged = BatchedDataDict.from_batches([results[0].final_batch, results[1].final_batch])
    expect(merged.size == 2 * NUM_PROMPTS * NUM_GENERATIONS, f"from_batches gave size {merged.size}")
    rewards = repeated_batch["total_reward"]
    input_ids = results[0].input_ids
    baseline, std = calculate_baseline_and_std_per_prompt(
        input_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=mc.grpo.use_leave_one_out_baseline
    )
    repeated_batch["baseline"], repeated_batch["std"] = baseline, std

    initial = grpo.extract_initial_prompt_messages(repeated_batch["message_log"], repeated_batch["length"])
    prompt_flat, _ = batched_message_log_to_flat_message(initial, pad_value_dict={"token_ids": tok.pad_token_id})
    prompt_ids_for_adv = prompt_flat["token_ids"]
    expect(torch.equal(prompt_ids_for_adv, input_ids), "extract_initial_prompt_messages != the batch's input_ids")

    # Overlong filtering is inline in grpo_train (grpo.py ~3122-3131): it indexes loss_multiplier by `truncated`.
    truncated = repeated_batch["truncated"]
    expect(isinstance(truncated, torch.Tensor) and truncated.dtype == torch.bool, f"truncated is {truncated!r}")
    loss_multiplier = repeated_batch["loss_multiplier"].clone()
    loss_multiplier[truncated] = 0
    repeated_batch["loss_multiplier"] = loss_multiplier
    masked = grpo._apply_mask_sample_filter(repeated_batch)
    expect(masked == int(repeated_batch["mask_sample"].sum()), f"_apply_mask_sample_filter masked {masked}")

    grpo.add_grpo_token_loss_masks_and_generation_logprobs(repeated_batch["message_log"])
    flat, input_lengths = batched_message_log_to_flat_message(
        repeated_batch["message_log"],
        pad_value_dict={"token_ids": tok.pad_token_id},
        make_sequence_length_divisible_by=mc.policy["make_sequence_length_divisible_by"],
    )
    train_data = grpo._build_async_grpo_train_data(flat, input_lengths, repeated_batch, mc.policy)
    b, s = train_data["input_ids"].shape
    expect(b == NUM_PROMPTS * NUM_GENERATIONS, f"train_data batch {b}")
    expect(train_data["input_ids"].dtype == torch.int64, f"train input_ids dtype {train_data['input_ids'].dtype}")
    expect(train_data["generation_logprobs"].shape == (b, s), "generation_logprobs not [B, S]")
    gen_tokens = [sum(m["token_ids"].numel() for m in log if m["role"] == "assistant") for log in repeated_batch["message_log"]]
    expect(train_data["token_mask"].sum(dim=1).tolist() == gen_tokens, "token_mask does not cover exactly the generated tokens")

    adv_estimator = grpo._create_advantage_estimator(mc)
    mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)
    train_data["advantages"] = adv_estimator.compute_advantage(
        prompt_ids=prompt_ids_for_adv,
        rewards=rewards,
        mask=mask,
        repeated_batch=repeated_batch,
        logprobs_policy=train_data["generation_logprobs"],  # grpo passes prev_logprobs; GRPO's estimator ignores it
        logprobs_reference=None,
    )
    adv = train_data["advantages"]
    expect(adv.shape == (b, s) and bool(torch.isfinite(adv).all()), f"advantages {tuple(adv.shape)} or non-finite")
    for g in range(NUM_PROMPTS):
        rows = slice(g * NUM_GENERATIONS, (g + 1) * NUM_GENERATIONS)
        if float(std[rows].max()) == 0.0:
            expect(bool((adv[rows] == 0).all()), f"group {g}: equal rewards but non-zero advantages")
    penalty = grpo._apply_configured_message_level_advantage_penalties(train_data, repeated_batch["message_log"], mc)
    expect(penalty and "invalid_tool_call_rate" in penalty, f"advantage penalties returned {penalty}")
    train_data["advantages"] = grpo._clip_grpo_advantages(train_data["advantages"], mc.grpo)
    expect(float(train_data["advantages"].abs().max()) <= 3.0, "advantages not clipped to [-3, 3]")


def check_c_collector(env: Env, notes: list[str]) -> None:
    """NeMo-RL's trajectory collector consuming *our* run_async_nemo_gym_rollout (its module-level name swapped
    for the call: ``_iter_rollout_groups`` imports it from nemo_rl.experience.rollouts when it runs)."""
    from nemo_rl.experience import rollouts as nrr

    import gym_bridge

    cls = collector_class()
    collector = SimpleNamespace(
        master_config=env.mc,
        policy_generation=env.generation,
        tokenizer=env.tokenizer,
        task_to_env={"nemo_gym": env.actor},
        _deduplicate_multimodal_data=False,
        _debug_payload_metrics=False,
        _next_nemo_gym_task_index=7,
    )
    batch = nemo_rl_repeated_batch(env.tokenizer, collector)
    index_map = cls._build_task_index_map(batch, NUM_GENERATIONS)
    expect(index_map == {7: 0, 8: 1}, f"_build_task_index_map gave {index_map}")

    async def drain() -> list[Found]:
        return [
            g
            async for g in cls._iter_rollout_groups(
                collector,
                repeated_batch=batch,
                num_generations=NUM_GENERATIONS,
                use_nemo_gym=True,
                task_index_to_group_index=index_map,
            )
        ]

    theirs = nrr.run_async_nemo_gym_rollout
    nrr.run_async_nemo_gym_rollout = gym_bridge.run_async_nemo_gym_rollout
    try:
        groups = asyncio.run(drain())
    finally:
        nrr.run_async_nemo_gym_rollout = theirs
    expect(sorted(g.group_index for g in groups) == [0, 1], f"group indices {[g.group_index for g in groups]}")
    for g in groups:
        agent = env.agents[g.group_index]
        # The collector's own per-group checks (trajectory_collector.py ~1218-1229).
        expect(g.final_batch.size == NUM_GENERATIONS, f"group {g.group_index} size {g.final_batch.size}")
        rewards = check_final_batch(
            SimpleNamespace(final_batch=g.final_batch, rollout_metrics=g.rollout_metrics,
                            input_ids=_input_ids(g.final_batch, env.tokenizer)),
            [agent] * NUM_GENERATIONS, f"collector group {g.group_index}", notes, tables=False,
        )
        if g.group_index == 0:
            expect(rewards == [1.0] * NUM_GENERATIONS, f"equivalence group rewards {rewards}")


def describe_value(value: object) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor[{value.dtype}, {tuple(value.shape)}]"
    if isinstance(value, list):
        return f"list[{type(value[0]).__name__ if value else ''}]"
    return type(value).__name__


def compare_metrics(theirs: JsonMapping, ours: JsonMapping, where: str, notes: list[str]) -> None:
    """NeMo-RL's metric keys all present in ours with equal values (timings excepted); extra keys are notes."""
    missing = sorted(k for k in theirs if k not in ours)
    extra = sorted(k for k in ours if k not in theirs)
    expect(not missing, f"{where}: metrics NeMo-RL emits and we do not: {missing}")
    if extra:
        notes.append(f"{where}: metrics only we emit: {extra}")
    from wandb import Histogram, Table

    histograms = []
    for key in sorted(set(theirs) & set(ours)):
        a, b = theirs[key], ours[key]
        if key.startswith("timing/") or isinstance(a, Table):  # timings differ run to run; Tables compared apart
            continue
        if isinstance(a, Histogram) and not isinstance(b, Histogram):
            # Ours is the list of values (docs/nemo_rl_migration.md); the same values make the same Histogram.
            h = Histogram(b) if isinstance(b, list) else None
            same = h is not None and list(h.histogram) == list(a.histogram) and list(h.bins) == list(a.bins)
            expect(same, f"{where}: metric {key}: NeMo-RL's Histogram is not Histogram(ours={b!r})")
            histograms.append(key)
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            same = math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
        else:
            same = a == b
        expect(same, f"{where}: metric {key}: NeMo-RL {a!r}, ours {b!r}")
        if type(a) is not type(b):
            notes.append(f"{where}: metric {key} is {type(b).__name__} in ours, {type(a).__name__} in NeMo-RL's")
    if histograms:
        notes.append(f"{where}: {len(histograms)} /histogram metrics are lists in ours, wandb.Histogram in NeMo-RL's "
                     "(same values)")


def compare_message_logs(
    theirs: Sequence[Sequence[JsonMapping]], ours: Sequence[Sequence[JsonMapping]], where: str
) -> None:
    import torch

    for i, (la, lb) in enumerate(zip(theirs, ours, strict=True)):
        expect(len(la) == len(lb), f"{where}: row {i} has {len(lb)} messages, NeMo-RL's {len(la)}")
        for j, (ma, mb) in enumerate(zip(la, lb)):
            expect(set(ma) == set(mb), f"{where}: row {i} msg {j} keys: NeMo-RL {sorted(ma)}, ours {sorted(mb)}")
            for key in set(ma) & set(mb):
                va, vb = ma[key], mb[key]
                if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                    expect(va.dtype == vb.dtype, f"{where}: row {i} msg {j} {key} dtype NeMo-RL {va.dtype}, ours {vb.dtype}")
                    expect(va.shape == vb.shape and torch.equal(va.to(vb.dtype), vb),
                           f"{where}: row {i} msg {j} {key} values differ")
                else:
                    expect(va == vb, f"{where}: row {i} msg {j} {key}: NeMo-RL {va!r}, ours {vb!r}")


def compare_results(theirs: Found, ours: Found, where: str, notes: list[str]) -> None:
    """Two NemoGymRolloutResults of the same batch on the same actor (the scripted policy is deterministic)."""
    import torch

    fa, fb = theirs.final_batch, ours.final_batch
    expect(set(fa) == set(fb), f"{where}: final_batch keys: NeMo-RL {sorted(fa)}, ours {sorted(fb)}")
    for key in sorted(set(fa) & set(fb)):
        va, vb = fa[key], fb[key]
        expect(describe_value(va) == describe_value(vb),
               f"{where}: final_batch[{key!r}] is {describe_value(vb)} in ours, {describe_value(va)} in NeMo-RL's")
        if key == "message_log":
            compare_message_logs(va, vb, f"{where} message_log")
        elif isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape:
            expect(torch.equal(va.to(vb.dtype), vb), f"{where}: final_batch[{key!r}]: NeMo-RL {va.tolist()}, ours {vb.tolist()}")
        elif not isinstance(va, torch.Tensor):
            expect(va == vb, f"{where}: final_batch[{key!r}] differs")
    expect(theirs.input_ids.dtype == ours.input_ids.dtype and torch.equal(theirs.input_ids, ours.input_ids),
           f"{where}: input_ids differ ({theirs.input_ids.dtype} {tuple(theirs.input_ids.shape)} vs "
           f"{ours.input_ids.dtype} {tuple(ours.input_ids.shape)})")
    expect(theirs.task_index == ours.task_index, f"{where}: task_index {theirs.task_index} vs ours {ours.task_index}")
    compare_metrics(theirs.rollout_metrics, ours.rollout_metrics, where, notes)
    from wandb import Table

    for key, table in theirs.rollout_metrics.items():
        if isinstance(table, Table) and isinstance(ours.rollout_metrics.get(key), Table):
            for i, (ra, rb) in enumerate(zip(table_rows(table), table_rows(ours.rollout_metrics[key]), strict=True)):
                paths = diff_paths(ra, rb)
                expect(not paths, f"{where}: {key} row {i} differs at {paths[:6]}")


VOLATILE_KEYS = frozenset({"id", "call_id", "created_at"})
"""Fields Gym's servers make fresh for every response (uuids, clock): never equal across two runs."""


def diff_paths(a: object, b: object, path: str = "") -> list[str]:
    """Where two JSON values differ: ``path (NeMo-RL's -> ours)`` entries; :data:`VOLATILE_KEYS` are skipped."""
    if isinstance(a, dict) and isinstance(b, dict):
        a = {k: v for k, v in a.items() if k not in VOLATILE_KEYS}
        b = {k: v for k, v in b.items() if k not in VOLATILE_KEYS}
        out = [f"{path}.{k} (only NeMo-RL's)" for k in a if k not in b]
        out += [f"{path}.{k} (only ours)" for k in b if k not in a]
        for k in a:
            if k in b:
                out += diff_paths(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff_paths(x, y, f"{path}[{i}]")]
    if a != b:
        return [f"{path} ({str(a)[:40]!r} -> {str(b)[:40]!r})"]
    return []


def compare_records(theirs: Found, ours: Found, where: str, notes: list[str]) -> None:
    """Two PromptGroupRecords of the same prompt, NeMo-RL's impl and ours, both under NeMo-RL's manager."""
    expect(type(theirs).__name__ == type(ours).__name__, f"{where}: record type {type(ours)} vs {type(theirs)}")
    for attr in ("prompt_idx", "extra_env_info", "metadata"):
        expect(getattr(theirs, attr) == getattr(ours, attr),
               f"{where}: {attr}: NeMo-RL {getattr(theirs, attr)!r}, ours {getattr(ours, attr)!r}")
    compare_message_logs([theirs.prompt], [ours.prompt], f"{where} prompt")
    expect(len(theirs.completions) == len(ours.completions), f"{where}: completion counts differ")
    for i, (ca, cb) in enumerate(zip(theirs.completions, ours.completions)):
        compare_message_logs([ca.message_log], [cb.message_log], f"{where} completion {i}")
        for attr in ("reward", "truncated"):
            expect(getattr(ca, attr) == getattr(cb, attr),
                   f"{where}: completion {i} {attr}: NeMo-RL {getattr(ca, attr)!r}, ours {getattr(cb, attr)!r}")
        ea, eb = dict(ca.env_extras), dict(cb.env_extras)
        # Gym's rollout identity, which our backend stamps on every row (docs/nemo_gym.md) and Gym's agents echo.
        identity = sorted((set(eb) - set(ea)) & set(ROLLOUT_IDENTITY_KEYS))
        if identity and (note := f"{where}: Gym's rollout identity only in ours (stamped, echoed): {identity}") not in notes:
            notes.append(note)
        eb = {k: v for k, v in eb.items() if k not in identity}
        expect(set(ea) == set(eb), f"{where}: completion {i} env_extras keys: only NeMo-RL {sorted(set(ea) - set(eb))}, "
               f"only ours {sorted(set(eb) - set(ea))}")
        fields_a = {f for f in vars(ca)} if hasattr(ca, "__dict__") else set()
        fields_b = {f for f in vars(cb)} if hasattr(cb, "__dict__") else set()
        note = f"Completion fields only ours has: {sorted(fields_b - fields_a)}"
        if fields_b - fields_a and note not in notes:
            notes.append(note)
    compare_metrics(theirs.rollout_metrics, ours.rollout_metrics, where, notes)


def check_e_same(env: Env, notes: list[str]) -> None:
    """NeMo-RL's functions and ours on the same batches and the same actor: the same rollouts, keys, dtypes, metrics."""
    from nemo_rl.experience import rollout_manager as nrm
    from nemo_rl.experience.rollouts import run_async_nemo_gym_rollout, run_nemo_gym_rollout_sync

    import gym_bridge
    from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl as Ours

    tok = env.tokenizer
    theirs = run_sync_batch(env, run_nemo_gym_rollout_sync, nemo_rl_repeated_batch(tok))
    ours = run_sync_batch(env, gym_bridge.run_nemo_gym_rollout_sync, nemo_rl_repeated_batch(tok))
    compare_results(theirs, ours, "sync batch", notes)

    def stream(fn: Callable[..., AsyncIterator[Found]]) -> list[Found]:
        batch = nemo_rl_repeated_batch(tok, SimpleNamespace(_next_nemo_gym_task_index=0))
        return run_async_batch(env, fn, batch, tables=False)

    theirs_groups, ours_groups = stream(run_async_nemo_gym_rollout), stream(gym_bridge.run_async_nemo_gym_rollout)
    expect(len(theirs_groups) == len(ours_groups), f"async: {len(ours_groups)} groups, NeMo-RL {len(theirs_groups)}")
    by_task = {g.task_index: g for g in ours_groups}
    last_theirs, last_ours = theirs_groups[-1].rollout_metrics, ours_groups[-1].rollout_metrics
    for g in theirs_groups:
        if g.task_index in by_task:
            a, b = dict(g.rollout_metrics), dict(by_task[g.task_index].rollout_metrics)
            # The whole-call timings ride on the last group, whichever finished last in each run.
            for m in (a, b):
                for k in [k for k in m if k.startswith("timing/")]:
                    m.pop(k)
            compare_results(SimpleNamespace(final_batch=g.final_batch, input_ids=g.input_ids, task_index=g.task_index,
                                            rollout_metrics=a),
                            SimpleNamespace(final_batch=by_task[g.task_index].final_batch,
                                            input_ids=by_task[g.task_index].input_ids,
                                            task_index=g.task_index, rollout_metrics=b),
                            f"async group {g.task_index}", notes)
    timing_a = sorted(k for k in last_theirs if k.startswith("timing/"))
    timing_b = sorted(k for k in last_ours if k.startswith("timing/"))
    expect(timing_a == timing_b, f"async last group timings: NeMo-RL {timing_a}, ours {timing_b}")

    manager_theirs = nemo_rl_manager(env)
    saved = nrm.AsyncNemoGymRolloutImpl
    nrm.AsyncNemoGymRolloutImpl = Ours
    try:
        manager_ours = nemo_rl_manager(env)
    finally:
        nrm.AsyncNemoGymRolloutImpl = saved

    async def records(manager: Found) -> list[Found]:
        return [await manager.run_rollout(d) for d in nemo_rl_datums(tok)]

    for i, (ra, rb) in enumerate(zip(asyncio.run(records(manager_theirs)), asyncio.run(records(manager_ours)))):
        compare_records(ra, rb, f"manager prompt {i}", notes)


def _input_ids(final_batch: JsonMapping, tokenizer: Tokenizer) -> torch.Tensor:
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message

    first = [log[:1] for log in final_batch["message_log"]]
    return batched_message_log_to_flat_message(first, pad_value_dict={"token_ids": tokenizer.pad_token_id})[0]["token_ids"]


CHECKS: dict[str, tuple[str, Callable[[Env, list[str]], None]]] = {
    "a_async": ("NeMo-RL run_async_nemo_gym_rollout -> our NemoGym actor", check_a_async),
    "a_sync": ("NeMo-RL run_nemo_gym_rollout_sync -> our NemoGym actor", check_a_sync),
    "b_manager": ("NeMo-RL RolloutManager(use_nemo_gym=True) -> our NemoGym actor", check_b_manager),
    "c_grpo": ("our run_nemo_gym_rollout_sync -> NeMo-RL grpo.py post-processing", check_c_grpo),
    "c_collector": ("our run_async_nemo_gym_rollout -> NeMo-RL trajectory collector", check_c_collector),
    "d_impl": ("our AsyncNemoGymRolloutImpl built by NeMo-RL's RolloutManager", check_d_impl),
    "e_same": ("NeMo-RL's functions and impl vs ours, same batches, same actor", check_e_same),
}


def run_bounded(fn: Callable[[], None], timeout_s: float) -> BaseException | None:
    """Run ``fn`` on a daemon thread; its exception, a TimeoutError after ``timeout_s``, or None."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - reported, never swallowed
            box[0] = error

    thread = threading.Thread(target=target, daemon=True, name="check")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return TimeoutError(f"did not finish within {timeout_s:.0f}s")
    return box[0]


# ---- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nemo-rl-src", default=os.environ.get("NEMO_RL_SRC"), help="a NeMo-RL checkout ($NEMO_RL_SRC)")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all): " + ",".join(CHECKS))
    args = parser.parse_args(argv)
    root = imports.check_checkout(args.nemo_rl_src)
    selected = [c.strip() for c in args.only.split(",") if c.strip()] or list(CHECKS)
    unknown = [c for c in selected if c not in CHECKS]
    if unknown:
        raise SystemExit(f"check-nemo-rl: unknown check(s) {unknown}; known: {list(CHECKS)}")

    commit = nemo_rl_commit(root)
    print(f"check-nemo-rl: NeMo-RL at {root} ({commit})", flush=True)
    t0 = time.monotonic()
    imports.import_nemo_rl(root)
    print(f"  imported NeMo-RL's modules unmodified in {time.monotonic() - t0:.0f}s; stood in: "
          f"{', '.join(sorted(imports.stood_in)) or 'nothing'}; transformers guard passed by reading "
          f"{imports.TRANSFORMERS_GUARD_VERSION} during {imports.TRANSFORMERS_GUARD_MODULE}'s import", flush=True)
    mc = load_master_config(root)
    ours = gym_bridge_state()
    print(f"  gym_bridge: {ours}", flush=True)

    outcomes: list[Outcome] = []
    with contextlib.ExitStack() as stack:
        try:
            env = start(stack, root, mc)
        except BaseException as error:  # noqa: BLE001
            print(f"check-nemo-rl: could not start Ray, the endpoint or the Gym actor: {describe(error)}", flush=True)
            traceback.print_exc()
            return 2
        for name in selected:
            title, fn = CHECKS[name]
            notes: list[str] = []
            print(f"--- {name}: {title}", flush=True)
            started = time.monotonic()
            _unmet.clear()
            error = run_bounded(lambda fn=fn, notes=notes: fn(env, notes), CHECK_TIMEOUT_S)
            seconds = time.monotonic() - started
            unmet = list(_unmet)
            outcome = Outcome(name, title, error is None and not unmet, seconds, notes=notes)
            outcome.error = "\n".join([f"unmet: {m}" for m in unmet] + ([describe(error)] if error else []))
            if error is not None:
                outcome.where = locate(error, root)
                if os.environ.get("CHECK_NEMO_RL_TRACEBACKS"):
                    traceback.print_exception(error)
            outcomes.append(outcome)
            print(f"    {'PASS' if outcome.ok else 'FAIL'} ({seconds:.1f}s)", flush=True)
            if isinstance(error, TimeoutError):
                print("    a check timed out: stopping here (its thread may still hold the actor)", flush=True)
                break
    print_summary(outcomes, commit, selected)
    return 0 if outcomes and all(o.ok for o in outcomes) and len(outcomes) == len(selected) else 1


def start(stack: contextlib.ExitStack, root: Path, mc: MasterConfig) -> Env:
    """Ray, our endpoint over the scripted policy, our NemoGym actor on real Gym servers; torn down by ``stack``."""
    import ray
    from transformers import AutoTokenizer

    import gym_bridge
    from gym_bridge.generation.scripted import ScriptedGeneration
    from gym_bridge.models.tiny import build_tiny_model
    from gym_bridge.ray_utils import init_ray
    from gym_bridge.serving import OpenAIServer
    from gym_bridge.testing import DEFAULT_GYM_CONFIGS, SERVED_MODEL_NAME
    from gym_bridge.testing.gym_rows import EQUIVALENCE_AGENT, TOOL_AGENT

    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="check-nemo-rl-")))
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(cache_dir=workdir / "tiny"))
    # With PYTHONPATH set (e.g. to check an exported older tree of gym_bridge) Ray's workers import what the driver does.
    pythonpath = os.environ.get("PYTHONPATH")
    init_ray(num_cpus=2, **({"runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}}} if pythonpath else {}))
    stack.callback(ray.shutdown)
    server = OpenAIServer(ScriptedGeneration(tokenizer), tokenizer, served_model_name=SERVED_MODEL_NAME)
    server.start_in_thread()
    stack.callback(server.stop_thread)
    t0 = time.monotonic()
    # NeMo-RL's spin-up signature; env.nemo_gym as NeMo-RL's grpo.setup passes it (the wheel's configs here).
    box: dict[str, ActorHandle] = {}

    def spin() -> None:
        box["actor"] = gym_bridge.spinup_nemo_gym_actor(
            {"nemo_gym": {"config_paths": [str(gym_bridge_wheel_config(p)) for p in DEFAULT_GYM_CONFIGS]}},
            [server.base_url],
            SERVED_MODEL_NAME,
            tokenizer=tokenizer,
        )

    error = run_bounded(spin, STARTUP_TIMEOUT_S)
    if "actor" in box:
        stack.callback(gym_bridge.stop_nemo_gym_actors, [box["actor"]])
    if error is not None:
        raise error
    print(f"  Ray, the scripted endpoint and our NemoGym actor on real Gym servers up in {time.monotonic() - t0:.0f}s",
          flush=True)
    generation = GenerationConfigHolder(mc.policy["generation"])
    return Env(root, mc, tokenizer, box["actor"], generation, [EQUIVALENCE_AGENT, TOOL_AGENT])


def gym_bridge_wheel_config(path: str) -> Path:
    from gym_bridge.gym.servers.config_files import wheel_config_path

    return wheel_config_path(path)


def git_output(tree: Path, *args: str) -> str | None:
    """``git -C tree args``'s stripped output; None when git fails, says nothing, or ``tree`` is no git tree."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def gym_bridge_state() -> str:
    """Where gym_bridge was imported from, and that tree's commit (``-dirty`` when it has changes)."""
    import gym_bridge

    where = Path(gym_bridge.__file__).resolve().parent.parent
    described = git_output(where, "describe", "--always", "--dirty")
    return f"{where} at {described}" if described else f"{where} (not a git tree)"


def nemo_rl_commit(root: Path) -> str:
    """The NeMo-RL checkout's short commit, else ``$NEMO_RL_COMMIT``, else a line saying it is unknown."""
    commit = git_output(root, "rev-parse", "--short", "HEAD")
    if commit:
        return f"commit {commit}"
    return os.environ.get("NEMO_RL_COMMIT", "not a git checkout; commit unknown (set NEMO_RL_COMMIT to name it)")


def print_summary(outcomes: list[Outcome], commit: str, selected: list[str]) -> None:
    print("\n==== check-nemo-rl summary " + "=" * 52)
    print(f"NeMo-RL: {commit}")
    print(f"gym_bridge: {gym_bridge_state()}")
    for o in outcomes:
        print(f"{'PASS' if o.ok else 'FAIL'}  {o.name:<12} {o.title}  ({o.seconds:.1f}s)")
        if not o.ok:
            for line in o.error.splitlines():
                print(f"        {line}")
            if o.where:
                print(f"        at {o.where}")
        for note in o.notes:
            print(f"        note: {note}")
    not_run = [n for n in selected if n not in {o.name for o in outcomes}]
    for name in not_run:
        print(f"SKIP  {name:<12} {CHECKS[name][0]}  (not run: an earlier check timed out)")
    passed = sum(o.ok for o in outcomes)
    print(f"{passed}/{len(selected)} checks passed")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # A check that timed out may leave a thread inside Ray: exit without waiting for it.
    os._exit(code)
