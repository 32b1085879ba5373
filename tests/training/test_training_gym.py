"""The GRPO loop through real NeMo-Gym servers, our server and the tiny model: versions, refit, staleness.

One run (engine + server + Gym + manager + policy) is built for the module with the
builder the recipe uses. Each test drives trainers of its own over the run's manager, policy and engine, a few
small steps at a time, and starts from the run as it was built (:func:`as_built`): the policy's weights,
optimizer and learning-rate schedule, the manager's retry policy, and an engine serving those weights.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from gym_bridge.config.run_settings import grpo_run_settings
from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RefitMismatch, RolloutStall, StepBatchShortfall
from gym_bridge.gym.transport.admission import AdmissionSettings
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym_versions import installed_gym
from gym_bridge.policy import HFPolicy, HFPolicyConfig
from gym_bridge.recipes.grpo_run import build_grpo_run, validator_from
from gym_bridge.testing.gym_rows import EQUIVALENCE_AGENT, gym_dataset_collate
from gym_bridge.training import (
    ClippedPGLossConfig,
    GRPOLoopConfig,
    GRPOTrainer,
    GymValidator,
    ValidationSet,
    load_trainer_state,
)
from gym_bridge.training.refit import refit
from gym_bridge.types import GenerationSamplingParams

pytestmark = [pytest.mark.gym, pytest.mark.slow]

WORDS = ["blue", "seven", "apple", "river"]
LC_CONFIG = "resources_servers/equivalence_rule/configs/lc.yaml"
LC_DATA = "resources_servers/equivalence_rule/data/example.jsonl"
ON_POLICY_ATOL = 1e-4


def tiny_config(data_path, log_dir):
    return {
        "use_nemo_gym": True,
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 3, "max_num_steps": 2, "seed": 0},
        "policy": {
            "model_name": "tiny",
            "max_total_sequence_length": 256,
            "optimizer": {"kwargs": {"lr": 1e-3}},
            "generation": {
                "backend": "vllm",
                "vllm_cfg": {"async_engine": True, "expose_http_server": True},
                "max_new_tokens": 6,
                "temperature": 1.0,
                "top_p": 1.0,
            },
        },
        "checkpointing": {"enabled": False},
        "env": {
            "nemo_gym": {
                "config_paths": [
                    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
                    "resources_servers/equivalence_rule/configs/lc.yaml",
                ],
                "lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"grading_rule": "seq_match"}}},
                "rollout_timeout_s": 120,
                "startup_timeout_s": 150,
                "log_dir": str(log_dir),
                "actor_options": {"num_cpus": 0},
            }
        },
        "data": {"path": str(data_path)},
    }


@pytest.fixture(scope="module")
def grpo_run(ray_session, tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    rows = [{
        "responses_create_params": {"input": [{"role": "user", "content": f"Answer with one word: {w}"}]},
        "expected_answer": w,
    } for w in WORDS]  # fmt: skip
    if installed_gym().task_source_routing:  # the rows as Gym 0.7 prepares them: task_source, no agent_ref
        data = gym_dataset_collate(folder / "collate", [LC_CONFIG], data={LC_DATA: rows})
        assert all("task_source" in json.loads(line) for line in data.read_text().split("\n") if line.strip())
    else:
        data = folder / "rows.jsonl"
        data.write_text("".join(json.dumps({**row, "agent_ref": {"name": EQUIVALENCE_AGENT}}) + "\n" for row in rows))
    run = build_grpo_run(tiny_config(data, folder / "gym-logs"), folder / "run")
    yield run
    run.close()


@pytest.fixture(scope="module")
def built(grpo_run):
    """What the tests change of the run, as it was built: the policy's weights, optimizer and schedule state (the
    learning rates with them) and steps taken, and the manager's retry policy."""
    policy = grpo_run.policy
    return (
        copy.deepcopy(policy.model.state_dict()),
        copy.deepcopy(policy.optimizer.state_dict()),
        copy.deepcopy(policy.scheduler.state_dict()),
        policy.steps_taken,
        grpo_run.trainer.manager.retry_policy,
    )


@pytest.fixture(autouse=True)
def as_built(grpo_run, built):
    """Before each test: the run as it was built, and the engine refit to those weights at a new version, so that
    no test depends on what ran before it (each row's sampling seed comes from the run seed and the row)."""
    policy, engine, manager = grpo_run.policy, grpo_run.engine, grpo_run.trainer.manager
    weights, optimizer, scheduler, steps_taken, manager.retry_policy = built
    policy.model.load_state_dict(weights)
    policy.optimizer.load_state_dict(optimizer)
    policy.scheduler.load_state_dict(scheduler)
    policy.steps_taken = steps_taken
    refit(policy, engine, max(engine.weight_version, manager.weight_version) + 1, manager)


def recipe_trainer(run, tmp_path):
    """A trainer with the recipe's loop settings over the module's manager, policy and engine, at their version."""
    from gym_bridge.training import TrainerState

    base = run.trainer
    return GRPOTrainer(
        base.cfg,
        manager=base.manager,
        policy=base.policy,
        engine=base.engine,
        dataset=base.prompts.dataset,
        out_dir=tmp_path,
        state=TrainerState(weight_version=base.manager.weight_version),
        validator=base.validator,
    )


def trainer_like(run, tmp_path, *, engine=None, validator=None, **cfg):
    """A trainer over the module's manager, policy and engine, starting at their current version."""
    from gym_bridge.training import TrainerState

    base = run.trainer
    if cfg.get("async_rollouts"):
        cfg.setdefault("loss", ClippedPGLossConfig(use_importance_sampling_correction=True))
    return GRPOTrainer(
        GRPOLoopConfig(num_prompts_per_step=2, **cfg),
        manager=base.manager,
        policy=base.policy,
        engine=engine or base.engine,
        dataset=base.prompts.dataset,
        out_dir=tmp_path,
        state=TrainerState(weight_version=base.manager.weight_version),
        validator=validator,
    )


async def test_sync_steps_are_on_policy_and_tag_every_group_with_its_version(grpo_run, tmp_path):
    trainer = recipe_trainer(grpo_run, tmp_path)
    start = trainer.state.weight_version
    history = await trainer.run()
    assert [m["step"] for m in history] == [0, 1]
    for step, metrics in enumerate(history):
        assert metrics["train/groups"] == 2 and metrics["train/samples"] == 6
        assert metrics["staleness/trained_start_versions"] == [start + step], "rolled out on this step's weights"
        assert metrics["on_policy/tokens"] > 0
        # Step 1 samples from the engine after the first refit: it must serve the policy's weights.
        assert metrics["on_policy/logprob_abs_diff_mean"] < ON_POLICY_ATOL, metrics
        assert metrics["on_policy/gen_kl_error"] < ON_POLICY_ATOL
        assert metrics["train/engine_mismatch_abs_diff_mean"] < ON_POLICY_ATOL
        assert metrics["train/policy_lag_abs_diff_max"] == 0.0 and metrics["train/policy_step_abs_diff_mean"] > 0
        assert metrics["time/rollout_s"] > 0 and metrics["time/train_s"] > 0 and metrics["time/refit_s"] > 0
        assert metrics["time/step_s"] >= metrics["time/train_s"] + metrics["time/refit_s"]
    assert history[0]["train/grad_norm"] > 0, "rewards differed, so the policy moved"
    assert trainer.state.weight_version == start + 2 and trainer.manager.weight_version == start + 2
    lines = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1] and all("time/step_s" in line for line in lines)


async def test_refit_reaches_the_engine_and_a_skipped_refit_shows_at_once(grpo_run, tmp_path):
    trainer = trainer_like(grpo_run, tmp_path)
    first = await trainer.train_step(0, await trainer.rollout(0), 0.0, refit_engine=False)
    assert first["on_policy/logprob_abs_diff_mean"] < ON_POLICY_ATOL
    stale = await trainer.train_step(1, await trainer.rollout(1), 0.0)
    # The engine kept the old weights: its samples no longer match the trainer's logprobs.
    assert stale["on_policy/logprob_abs_diff_max"] > 100 * ON_POLICY_ATOL, stale
    assert stale["on_policy/gen_kl_error"] > ON_POLICY_ATOL
    assert stale["staleness/trained_start_versions"] == [first["weight_version"]]
    healed = await trainer.train_step(2, await trainer.rollout(2), 0.0)
    assert healed["on_policy/logprob_abs_diff_mean"] < ON_POLICY_ATOL, "the refit after step 1 reached the engine"


async def test_async_rollouts_run_up_to_the_age_bound_ahead_and_never_train_on_older_groups(grpo_run, tmp_path):
    relaxed = trainer_like(grpo_run, tmp_path / "one", async_rollouts=True, max_trajectory_age_steps=1, max_num_steps=3)
    start = relaxed.state.weight_version
    history = await relaxed.run()
    assert [m["staleness/trained_start_versions"] for m in history] == [[start], [start], [start + 1]]
    assert [m["staleness/max_age"] for m in history] == [0, 1, 1] and relaxed.buffer.dropped_total == 0
    for m in (m for m in history if not m["train/skipped_zero_advantage"]):
        # Scored with the weights that sampled them, lagged samples match the engine as closely as fresh ones.
        assert m["train/engine_mismatch_abs_diff_mean"] < ON_POLICY_ATOL, m
        assert m["train/engine_mismatch_tokens"] == m["train/policy_step_tokens"], "every sampling version kept"
    # Two steps of lookahead: steps 1 and 2 are rolled out on the weights step 0 trains.
    two = trainer_like(
        grpo_run,
        tmp_path / "two",
        async_rollouts=True,
        max_trajectory_age_steps=2,
        in_flight_weight_updates=True,
        max_num_steps=4,
    )
    start = two.state.weight_version
    history = await two.run()
    assert [m["staleness/trained_start_versions"] for m in history] == [[start], [start], [start], [start + 1]]
    assert [m["staleness/max_age"] for m in history] == [0, 1, 2, 2] and two.buffer.dropped_total == 0


async def test_a_group_older_than_the_bound_is_dropped_counted_and_its_prompts_drawn_again(grpo_run, tmp_path):
    trainer = trainer_like(grpo_run, tmp_path, async_rollouts=True, max_trajectory_age_steps=1)
    old = await trainer.rollout(0)
    old_prompts = sorted(
        json.dumps(g.record.completions[0].env_extras["responses_create_params"]["input"]) for g in old
    )
    await trainer.train_step(0, await trainer.rollout(1), 0.0)
    await trainer.train_step(1, await trainer.rollout(2), 0.0)
    metrics = await trainer.train_step(2, old, 0.0)  # two versions old
    assert metrics["train/groups"] == 0 and metrics["staleness/dropped"] == 2
    assert metrics["staleness/requeued_total"] == 2 and len(trainer.prompts.state.requeued) == 2
    redone = await trainer.rollout(3)
    assert (
        sorted(json.dumps(g.record.completions[0].env_extras["responses_create_params"]["input"]) for g in redone)
        == old_prompts
    ), "the dropped prompts come back first"
    assert not trainer.prompts.state.requeued


async def rollout_with_reward(trainer, reward: float) -> list:
    """Step 0's groups, every completion's reward set to ``reward`` (so every advantage is zero)."""
    groups = await trainer.rollout(0)
    for group in groups:
        for completion in group.record.completions:
            completion.reward = reward
    return groups


async def test_a_step_whose_advantages_are_all_zero_skips_the_optimizer(grpo_run, tmp_path, caplog):
    trainer = trainer_like(grpo_run, tmp_path)
    groups = await rollout_with_reward(trainer, 0.5)
    steps, version = trainer.policy.steps_taken, trainer.state.weight_version
    metrics = await trainer.train_step(0, groups, 0.0)
    assert metrics["train/skipped_zero_advantage"] is True and metrics["time/train_s"] == 0.0
    assert trainer.policy.steps_taken == steps and trainer.state.weight_version == version
    assert trainer.engine.weight_version == version, "nothing to refit"
    assert any("every advantage is zero" in r.getMessage() for r in caplog.records)


async def test_steps_in_which_nothing_passes_say_the_run_has_stopped_learning(grpo_run, tmp_path, caplog):
    trainer = trainer_like(grpo_run, tmp_path)
    groups = await rollout_with_reward(trainer, 0.0)
    streak = [(await trainer.train_step(step, groups, 0.0))["train/all_wrong_steps_in_a_row"] for step in range(3)]
    assert streak == [1, 2, 3]
    alarms = [r.getMessage() for r in caplog.records if "steps in a row" in r.getMessage()]
    assert alarms == [alarms[0]] and alarms[0].startswith("steps 0-2: no sample of any group passed, 3 steps in a row")
    groups[0].record.completions[0].reward = 1.0
    assert (await trainer.train_step(3, groups, 0.0))["train/all_wrong_steps_in_a_row"] == 0


async def test_greedy_validation_through_gym_at_start_period_and_end(grpo_run, tmp_path):
    rows = [datum["extra_env_info"] for datum in grpo_run.trainer.prompts.dataset]
    validator = GymValidator(
        GymClient(grpo_run.rollouts.actors),
        [ValidationSet("held", rows[:3]), ValidationSet("other", rows[3:])],
        sampling=GenerationSamplingParams(temperature=0.0),
        max_new_tokens=6,
        results_path=tmp_path / "val_results.jsonl",
    )
    trainer = trainer_like(
        grpo_run, tmp_path, max_num_steps=2, val_at_start=True, val_period=1, val_at_end=True, validator=validator
    )
    first = await validator(0, trainer.state.weight_version)
    again = await validator(0, trainer.state.weight_version)
    assert first == again, "greedy through Gym: the same weights give the same answers"
    history = await trainer.run()
    assert [(m["kind"], m["step"]) for m in history] == [
        ("val", 0),
        ("train", 0),
        ("val", 1),
        ("train", 1),
        ("val", 2),
    ], "val_at_end and the period do not repeat"
    lines = [json.loads(line) for line in (tmp_path / "val_results.jsonl").read_text().splitlines()]
    assert len(lines) == 5 * len(rows)
    for m in (h for h in history if h["kind"] == "val"):
        mine = [line for line in lines if line["step"] == m["step"] and line["set"] == "held"][-3:]
        assert m["val/accuracy"] == sum(line["reward"] >= 1.0 for line in mine) / 3
        assert set(m) >= {"val/format_rate", "val/mean_tokens", "val/other/accuracy"} and m["val/mean_tokens"] > 0
        assert all(isinstance(line["reply"], str) for line in mine)
    assert any(line["reply"] for line in lines), "the graded text is recorded"


async def test_a_validation_admits_its_rows_through_the_training_clients_control(grpo_run, tmp_path):
    """A validation runs beside the next step's rollouts on the same engine, so its rows count against the training
    client's limit on rows in flight; a validator built without that control has one of its own with the run's
    ``env.nemo_gym.admission`` settings, not the defaults."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(datum["extra_env_info"]) + "\n" for datum in grpo_run.trainer.prompts.dataset))
    config = tiny_config(rows, tmp_path / "gym-logs")
    config["data"]["validation"] = {"data_path": str(rows)}
    config["env"]["nemo_gym"]["admission"] = {"adaptive": False}
    settings = grpo_run_settings(config)

    shared = grpo_run.rollouts.admission
    validator = validator_from(settings, grpo_run.rollouts.actors, tmp_path, admission=shared)
    assert validator is not None and validator.client.admission is shared
    shared.peak_in_flight = 0
    metrics = await validator(0, grpo_run.trainer.manager.weight_version)
    assert metrics["val/mean_tokens"] > 0
    assert shared.peak_in_flight >= 1 and shared.in_flight == 0, "the validation's rows went through the shared control"

    own = validator_from(settings, grpo_run.rollouts.actors, tmp_path)
    assert own is not None and own.client.admission is not shared
    assert own.client.admission.settings == AdmissionSettings(adaptive=False)


async def test_without_in_flight_weight_updates_the_refit_waits_for_the_next_steps_rollouts(grpo_run, tmp_path):
    waiting = trainer_like(grpo_run, tmp_path / "wait", async_rollouts=True, max_num_steps=2)
    start = waiting.state.weight_version
    history = await waiting.run()
    assert "time/refit_wait_s" in history[0], history[0]
    assert "time/refit_wait_s" not in history[1], history[1]  # the last step has no next
    # Step 1 was rolled out entirely before step 0's refit: all of it on the old weights, start and end.
    assert history[1]["staleness/trained_start_versions"] == [start]
    in_flight = trainer_like(
        grpo_run, tmp_path / "in-flight", async_rollouts=True, in_flight_weight_updates=True, max_num_steps=2
    )
    assert not any("time/refit_wait_s" in m for m in await in_flight.run())


async def test_a_step_that_commits_nothing_within_the_stall_deadline_stops_the_run(grpo_run, tmp_path, caplog):
    aborting = trainer_like(grpo_run, tmp_path / "abort", stall_timeout_s=0.01, stall_action="abort")
    with pytest.raises(RolloutStall, match=r"step 0: no rollout committed in .*stall_timeout_s=0.01"):
        await aborting.rollout(0)
    warning = trainer_like(grpo_run, tmp_path / "warn", stall_timeout_s=0.01, stall_action="warn")
    assert len(await warning.rollout(0)) == 2
    assert any("rollout stall: step 0" in r.getMessage() for r in caplog.records)


async def test_a_step_below_min_step_batch_fraction_stops_the_run(grpo_run, tmp_path):
    manager = grpo_run.trainer.manager
    bad = {"responses_create_params": {"input": "x"}}  # no agent_ref: a data failure, skipped
    trainer = trainer_like(grpo_run, tmp_path, min_step_batch_fraction=0.75, shuffle_data=False)
    trainer.prompts.dataset = [trainer.prompts.dataset[0], datum_from_gym_row(bad, idx=99)]  # this trainer's copy
    manager.retry_policy = replace(manager.retry_policy, max_skipped_prompts=10)  # as_built restores it
    with pytest.raises(StepBatchShortfall, match="step 0 committed 1 of 2 prompt groups, below the floor of 2"):
        await trainer.rollout(0)
    assert trainer.state.requeued_total == 1 and len(trainer.prompts.state.requeued) == 1, "the lost prompt"
    trainer.prompts.state.requeued.clear()
    trainer.cfg = trainer.cfg.model_copy(update={"min_step_batch_fraction": 0.5})
    assert len(await trainer.rollout(0)) == 1


async def test_checkpoint_restores_weights_optimizer_and_state(grpo_run, tmp_path):
    trainer = recipe_trainer(grpo_run, tmp_path)
    await trainer.train_step(0, await trainer.rollout(0), 0.0)
    path = trainer.save_checkpoint()
    state = load_trainer_state(path)
    assert state == trainer.state
    restored = HFPolicy(HFPolicyConfig(model=str(path), keep_reference_model=False))
    restored.load_optimizer(path)
    assert restored.steps_taken == trainer.policy.steps_taken
    for name, tensor in trainer.policy.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], tensor), name


class SkippingEngine:
    """The module's engine, except that from refit ``skip_from`` on it loses the refit: ``"all"`` of it, or only
    the ``"weights"`` (it reports the new version while serving the old weights)."""

    def __init__(self, engine, skip_from, lose):
        self.engine, self.skip_from, self.lose, self.refits = engine, skip_from, lose, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights(self, state_dict, version):
        self.refits += 1
        if self.refits < self.skip_from:
            return self.engine.update_weights(state_dict, version)
        if self.lose == "weights":
            return self.engine.update_weights(
                {k: v.clone() for k, v in self.engine.model.state_dict().items()}, version
            )
        return None


@pytest.mark.parametrize("lose", ["all", "weights"])
async def test_a_refit_that_did_not_arrive_late_in_a_run_stops_it(grpo_run, tmp_path, lose):
    policy = grpo_run.policy
    # Learning has slowed (as_built restores the rate): the logprob threshold alone would not notice the lag.
    # The scheduler sets each step's rate from its base rates, so those slow down too.
    for group in policy.optimizer.param_groups:
        group["lr"] = 1e-7
    policy.scheduler.base_lrs = [1e-7] * len(policy.scheduler.base_lrs)
    skipping = SkippingEngine(grpo_run.engine, skip_from=3, lose=lose)
    trainer = trainer_like(grpo_run, tmp_path, engine=skipping, max_num_steps=4)
    expected = (
        r"step 2: after the refit the engine serves weight version"
        if lose == "all"
        else r"step 2: the engine reports weight version \d+ but \d+ parameter\(s\) differ"
    )
    with pytest.raises(RefitMismatch, match=expected):
        await trainer.run()
    lines = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert all(line["refit/version_checked"] and line["refit/fingerprint_checked"] for line in lines)
    assert all(line.get("train/lr", 1e-7) == pytest.approx(1e-7) for line in lines), "each step learned slowly"
    assert lines[-1]["on_policy/logprob_abs_diff_max"] < ON_POLICY_ATOL
