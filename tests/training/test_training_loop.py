"""The GRPO loop on fixed groups (no Gym, no engine): runs repeat bitwise whatever order groups commit in, the old
policy is the trainer's own logprobs, the async gap is split, dynamic sampling draws more prompts up to its bound,
and the learning-rate schedule follows NeMo-RL's ``policy.scheduler``."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from gym_bridge.failures import StepBatchShortfall
from gym_bridge.policy import HFPolicy, HFPolicyConfig
from gym_bridge.training import ClippedPGLossConfig, GRPOLoopConfig, GRPOTrainer
from gym_bridge.types import Completion, PromptGroupRecord

PROMPT = [11, 12, 13, 14, 15]
REPLIES = [[40, 41, 42], [50, 51, 52], [60, 61, 62], [70, 71, 72]]


def completions(rewards, logprob=-2.0):
    out = []
    for reply, reward in zip(REPLIES, rewards, strict=False):
        log = [
            {"role": "user", "content": "", "token_ids": torch.tensor(PROMPT)},
            {"role": "assistant", "content": "", "token_ids": torch.tensor(reply),
             "generation_logprobs": torch.full((len(reply),), logprob)},
        ]
        out.append(Completion(log, None, False, float(reward)))
    return out


class FixedGroups:
    """A manager that commits, for each drawn prompt, the group its dataset entry names, in a scripted order.

    ``order``: ``"drawn"`` commits in the order the prompts were drawn, ``"reversed"`` the other way round.
    """

    def __init__(self, order: str = "drawn") -> None:
        self.order = order
        self.weight_version = 0
        self.collects = 0
        self.in_step: list[int] = []

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    async def collect(self, datum, sink) -> None:
        self.collects += 1
        slot = sink.reserve(datum["idx"])
        version = self.weight_version
        self.in_step.append(datum["idx"])
        await asyncio.sleep(0)  # every prompt of the step is drawn before any commits
        rank = sorted(self.in_step, reverse=self.order == "reversed").index(datum["idx"])
        for _ in range(rank):
            await asyncio.sleep(0)
        self.in_step.remove(datum["idx"])
        record = PromptGroupRecord(datum["idx"], [], None, {}, completions(datum["rewards"]), {})
        sink.commit(slot, record, start_weight_version=version, end_weight_version=self.weight_version)


class NullEngine:
    def update_weights(self, state_dict, version):
        self.version = version


def dataset(rewards):
    return [{"message_log": [], "extra_env_info": None, "loss_multiplier": 1.0, "idx": i, "rewards": r}
            for i, r in enumerate(rewards)]  # fmt: skip


SPREAD = [[1, 0, 0, 1], [0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1], [1, 0, 1, 0], [0, 1, 0, 0]]


def trainer(tiny_model_dir, tmp_path, *, order="drawn", rewards=SPREAD, scheduler=None, **cfg):
    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False,
                                     scheduler=scheduler))
    loop = GRPOLoopConfig(**{"num_prompts_per_step": 2, "max_num_steps": 2, "seed": 5, **cfg})
    return GRPOTrainer(loop, manager=FixedGroups(order), policy=policy, engine=NullEngine(),
                       dataset=dataset(rewards), out_dir=tmp_path)


def run_keeping_weights(t: GRPOTrainer) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    weights: list[dict[str, torch.Tensor]] = []

    def keep(metrics):
        if metrics.get("kind") == "train":
            weights.append({k: v.detach().clone() for k, v in t.policy.model.state_dict().items()})

    return asyncio.run(t.run(on_step=keep)), weights


def test_two_runs_on_the_same_groups_give_equal_weights_step_by_step_in_any_commit_order(tiny_model_dir, tmp_path):
    first_metrics, first = run_keeping_weights(trainer(tiny_model_dir, tmp_path / "a"))
    _, again = run_keeping_weights(trainer(tiny_model_dir, tmp_path / "b"))
    shuffled_metrics, reversed_order = run_keeping_weights(trainer(tiny_model_dir, tmp_path / "c", order="reversed"))
    assert len(first) == 2 and all(not m["train/skipped_zero_advantage"] for m in first_metrics)
    start = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), keep_reference_model=False)).model.state_dict()
    assert any(not torch.equal(first[0][k], start[k]) for k in start), "the step moved the weights"
    for step in range(2):
        for other in (again, reversed_order):
            differ = [k for k in first[step] if not torch.equal(first[step][k], other[step][k])]
            assert not differ, f"step {step}: {differ[:3]} differ"
    assert [m["train/loss"] for m in first_metrics] == [m["train/loss"] for m in shuffled_metrics]
    digests = [m["train/rollout_sha256"] for m in first_metrics]
    assert digests == [m["train/rollout_sha256"] for m in shuffled_metrics] and len(digests[0]) == 16
    other_seed = trainer(tiny_model_dir, tmp_path / "d", seed=6)
    assert other_seed.prompts.draw(6) != trainer(tiny_model_dir, tmp_path / "e").prompts.draw(6), "grpo.seed orders data"


# float32 logprobs of one model over two batch shapes differ by ~1e-7 (kernel summation order); the trainer-vs-sampler
# gap the test tells apart is ~1e-2 on the tiny model (a separate engine, its own kernels and sampling temperature).
OLD_POLICY_ATOL = 1e-5


class Recording:
    """Wraps the loss and keeps each micro-batch it sees."""

    def __init__(self, loss):
        self.loss, self.seen = loss, []

    def __call__(self, logprobs, data, *args):
        self.seen.append((logprobs.detach().clone(), copy.copy(dict(data))))
        return self.loss(logprobs, data, *args)


def test_the_old_policy_is_the_trainers_logprobs_before_the_update_not_the_samplers(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir, tmp_path, max_num_steps=1, train_micro_batch_size=4)
    t.loss = recording = Recording(t.loss)
    before = copy.deepcopy(t.policy)
    groups = asyncio.run(t.rollout(0))
    metrics = asyncio.run(t.train_step(0, groups, 0.0, refit_engine=False))
    assert len(recording.seen) == 2
    for m, (_, data) in enumerate(recording.seen):
        # The trainer scores the whole batch; this re-scores one micro-batch. Another batch shape may sum in another
        # order on another CPU (AMD EPYC: equal to every printed digit, not bit for bit), so the two agree within
        # OLD_POLICY_ATOL, and the sampler's logprobs, which the loop must not use, stand far beyond it.
        prev, expected = torch.as_tensor(data["prev_logprobs"]), before.get_logprobs(data)["logprobs"]
        torch.testing.assert_close(prev, expected, atol=OLD_POLICY_ATOL, rtol=0, msg=f"micro-batch {m}")
        trained = torch.as_tensor(data["token_mask"]).bool()
        gap = (prev[trained] - torch.as_tensor(data["generation_logprobs"])[trained]).abs().max()
        assert float(gap) > 100 * OLD_POLICY_ATOL, f"micro-batch {m}: the sampler's logprobs are within {float(gap)}"
    # Sync: the sampling version is the trainer's, so the whole gap is engine mismatch, and nothing lags.
    assert metrics["train/policy_lag_abs_diff_max"] == 0.0
    assert metrics["train/engine_mismatch_abs_diff_mean"] == pytest.approx(metrics["on_policy/logprob_abs_diff_mean"])
    assert metrics["train/policy_step_abs_diff_mean"] > 0, "the per-step movement is logged in sync"
    assert metrics["train/policy_step_tokens"] == 24


def test_force_on_policy_ratio_takes_the_old_policy_from_the_update_itself(tiny_model_dir, tmp_path):
    """NeMo-RL's ``loss_fn.force_on_policy_ratio``: no pass before the update, the same update and metrics."""
    runs = {}
    for force in (False, True):
        t = trainer(tiny_model_dir, tmp_path / str(force), max_num_steps=1, train_micro_batch_size=4,
                    loss=ClippedPGLossConfig(force_on_policy_ratio=force))
        passes = []
        get_logprobs = t.policy.get_logprobs
        t.policy.get_logprobs = lambda data, *a, _f=get_logprobs: passes.append(1) or _f(data, *a)
        metrics = asyncio.run(t.train_step(0, asyncio.run(t.rollout(0)), 0.0, refit_engine=False))
        runs[force] = (len(passes), metrics, t.policy.model.state_dict())
    assert runs[False][0] == 2 and runs[True][0] == 1, "only the movement pass is left"
    (_, plain, plain_weights), (_, forced, forced_weights) = runs[False], runs[True]
    for key in ("train/engine_mismatch_abs_diff_mean", "train/policy_step_abs_diff_mean", "train/loss"):
        assert forced[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert forced["train/policy_step_abs_diff_mean"] > 0
    # The plain run's old policy comes from a pass in micro-batches of logprob_batch_size, the forced run's from the
    # update's micro-batches of 4: with shared prefixes their passes have other widths, so the ratio is 1 up to
    # float rounding, which Adam's first step can lift to a few 1e-6 where a gradient is near 0.
    for key, value in plain_weights.items():
        torch.testing.assert_close(forced_weights[key], value, rtol=1e-4, atol=1e-5)


def test_async_splits_the_gap_into_engine_mismatch_and_lag_with_the_sampling_versions_weights(tiny_model_dir,
                                                                                              tmp_path):
    is_loss = ClippedPGLossConfig(use_importance_sampling_correction=True)
    t = trainer(tiny_model_dir, tmp_path, async_rollouts=True, loss=is_loss, max_num_steps=3)
    history = [m for m in asyncio.run(t.run()) if m["kind"] == "train"]
    assert [m["staleness/max_age"] for m in history] == [0, 1, 1]
    fresh, lagged = history[0], history[1]
    assert fresh["train/policy_lag_abs_diff_max"] == 0.0
    # Step 1 trains on step 0's weights' samples: the lag is exactly how far step 0's update moved the policy,
    # and the mismatch is measured against the weights that sampled, so it stays what it was before any update.
    assert lagged["train/policy_lag_abs_diff_mean"] > 0 and lagged["train/engine_mismatch_tokens"] == 24
    mismatch = lagged["train/engine_mismatch_abs_diff_mean"]
    assert mismatch == pytest.approx(fresh["train/engine_mismatch_abs_diff_mean"], rel=1e-5), "same weights, tokens"
    assert lagged["on_policy/logprob_abs_diff_mean"] != pytest.approx(mismatch, rel=1e-3), "the whole gap differs"
    assert set(t.weight_snapshots) == {t.state.weight_version - 1}, "one kept version per step of lag"


class CommitsThenHangs:
    """A manager whose prompts commit one every ``every_s`` seconds, ``commits`` of them; the others never finish."""

    def __init__(self, commits: int, every_s: float) -> None:
        self.commits, self.every_s = commits, every_s
        self.cancelled = 0

    def set_weight_version(self, version: int) -> None:
        pass

    async def collect(self, datum, sink) -> None:
        slot = sink.reserve(datum["idx"])
        try:
            if datum["idx"] >= self.commits:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.every_s * (datum["idx"] + 1))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        record = PromptGroupRecord(datum["idx"], [], None, {}, completions([1, 0, 0, 0]), {})
        sink.commit(slot, record, start_weight_version=0, end_weight_version=0)


def test_a_stall_is_measured_from_the_last_commit_and_stops_the_steps_rollouts(tiny_tokenizer, tmp_path):
    import time
    from types import SimpleNamespace

    from gym_bridge.failures import RolloutStall

    cfg = GRPOLoopConfig(num_prompts_per_step=5, stall_timeout_s=1.5, stall_interval_s=0.02, stall_action="abort")
    manager = CommitsThenHangs(commits=4, every_s=0.1)
    t = GRPOTrainer(cfg, manager=manager, policy=SimpleNamespace(tokenizer=tiny_tokenizer), engine=None,
                    dataset=dataset(SPREAD), out_dir=tmp_path)

    async def stall() -> float:
        started = time.monotonic()
        with pytest.raises(RolloutStall, match=r"step 0: no rollout committed in 1\.5s \(4 groups committed so far"):
            await t.rollout(0)
        return time.monotonic() - started

    elapsed = asyncio.run(stall())
    # The deadline runs from the last commit (0.4 s), and the watch looks every interval: a watch that only woke
    # once per stall_timeout_s would see the commits late and stop at 3 s.
    assert 0.4 + 1.5 <= elapsed < 0.4 + 1.5 + 1.0, elapsed
    assert manager.cancelled == 1, "the prompt still in flight is cancelled"


def test_dynamic_sampling_draws_more_prompts_when_a_batch_has_no_signal(tiny_model_dir, tmp_path):
    flat, spread = [1, 1, 1, 1], [1, 0, 0, 0]
    rewards = [flat, flat, spread, flat, spread, spread, flat, flat]
    t = trainer(tiny_model_dir, tmp_path, rewards=rewards, max_num_steps=1, shuffle_data=False,
                use_dynamic_sampling=True)
    (metrics,) = asyncio.run(t.run())
    # Batches of 2: [flat, flat], [spread, flat], [spread, spread]: 3 batches, 6 prompts, 3 dropped, 1 left over.
    assert metrics["train/dynamic_sampling_num_gen_batches"] == 3
    assert metrics["train/dynamic_sampling_prompts_drawn"] == 6 and t.manager.collects == 6
    assert metrics["train/dynamic_sampling_groups_dropped"] == 3
    assert metrics["train/dynamic_sampling_num_discarded_valid_samples"] == 4
    assert metrics["train/groups"] == 2 and metrics["train/zero_std_groups"] == 0
    assert not metrics["train/skipped_zero_advantage"]
    assert t.prompts.checkpoint_state().requeued == [], "dropped and discarded prompts are used, not redone"
    wide = trainer(tiny_model_dir, tmp_path / "wide", rewards=rewards, max_num_steps=1, shuffle_data=False,
                   use_dynamic_sampling=True, batch_multiplier=1.5)
    (metrics,) = asyncio.run(wide.run())
    assert metrics["train/dynamic_sampling_num_gen_batches"] == 2 and wide.manager.collects == 6


def test_dynamic_sampling_stops_the_run_past_its_bound_as_nemo_rl_does(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir, tmp_path, rewards=[[0, 0, 0, 0]] * 4, use_dynamic_sampling=True,
                dynamic_sampling_max_gen_batches=2)
    with pytest.raises(StepBatchShortfall, match=r"after 3 generation batches .*grpo.dynamic_sampling_max_gen_batches=2"):
        asyncio.run(t.run())
    assert t.manager.collects == 6, "NeMo-RL goes on while the batches so far are at most the bound: 3 of 2 prompts"
    without = trainer(tiny_model_dir, tmp_path / "off", rewards=[[0, 0, 0, 0]] * 4, max_num_steps=1)
    (metrics,) = asyncio.run(without.run())
    assert metrics["train/skipped_zero_advantage"] and without.manager.collects == 2


def test_dynamic_sampling_settings_are_checked_as_nemo_rl_checks_them():
    with pytest.raises(ValueError, match="grpo.batch_multiplier=2.0 needs grpo.use_dynamic_sampling"):
        GRPOLoopConfig(batch_multiplier=2.0)
    is_loss = ClippedPGLossConfig(use_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="async_grpo_train does not apply dynamic sampling"):
        GRPOLoopConfig(use_dynamic_sampling=True, async_rollouts=True, loss=is_loss)


WARMUP = [
    {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 2}},
    {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10_000}},
    {"milestones": [2]},
]


def test_the_learning_rate_warms_up_once_per_step_and_resumes_from_the_checkpoint(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir, tmp_path, scheduler=WARMUP, max_num_steps=3, checkpoint_every_steps=1)
    history = [m for m in asyncio.run(t.run()) if m["kind"] == "train"]
    assert [m["train/lr"] for m in history] == pytest.approx([1e-4, 5.5e-4, 1e-3])
    resumed = HFPolicy(HFPolicyConfig(model=str(t.checkpoint_dir), learning_rate=1e-3, keep_reference_model=False,
                                      scheduler=WARMUP))
    resumed.load_optimizer(t.checkpoint_dir)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert resumed.scheduler.state_dict()["last_epoch"] == 3


def test_the_train_demo_config_warms_up_from_a_tenth_of_its_rate():
    from pathlib import Path

    import yaml

    from gym_bridge.config.grpo import loop_config_from, policy_config
    from gym_bridge.config.training import nemo_gym_rollout_settings
    from gym_bridge.policy.lr_scheduler import build_lr_scheduler

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "grpo_nemo_gym.yaml").read_text())
    loop = loop_config_from(config, nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:1/v1"]))
    policy = policy_config(config, "tiny", loop)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=policy.learning_rate)
    scheduler = build_lr_scheduler(optimizer, policy.scheduler)
    rates = []
    for _ in range(5):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([2e-6, 8e-6, 1.4e-5, 2e-5, 2e-5])
    assert loop.use_dynamic_sampling, "the demo's sync loop samples dynamically"
    assert not loop.loss.use_importance_sampling_correction, "the demo's sync loss reads no sampling logprobs"


@pytest.mark.e2e
def test_the_train_demo_ends_a_bad_config_in_one_line_and_exit_code_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parents[2]
    text = (repo / "examples" / "grpo_nemo_gym.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("      max_num_seqs: 192", "      max_num_seqs: 0  #", 1))
    done = subprocess.run([sys.executable, "examples/grpo_nemo_gym.py", str(bad), "--out", str(tmp_path / "run")],
                          cwd=repo, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "gym-bridge train: policy.generation.vllm_kwargs.max_num_seqs must be a positive integer, got 0"
    )



class WatchingValidator:
    """A validator that notes the manager's weight version and how many groups it had collected, as it starts and
    as it ends (after yielding to the loop a few times)."""

    def __init__(self, manager: FixedGroups) -> None:
        self.manager = manager
        self.seen: list[tuple[int, int, tuple[int, int], tuple[int, int]]] = []

    async def __call__(self, step: int, weight_version: int) -> dict[str, float]:
        started = (self.manager.weight_version, self.manager.collects)
        for _ in range(50):
            await asyncio.sleep(0)
        self.seen.append((step, weight_version, started, (self.manager.weight_version, self.manager.collects)))
        return {"val/accuracy": 0.5}


def test_a_validation_runs_beside_the_next_steps_rollouts_and_ends_before_its_refit(tiny_model_dir, tmp_path):
    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3, keep_reference_model=False))
    manager = FixedGroups()
    validator = WatchingValidator(manager)
    loop = GRPOLoopConfig(num_prompts_per_step=2, max_num_steps=2, seed=5, val_period=1, val_at_start=True,
                          val_at_end=True)
    t = GRPOTrainer(loop, manager=manager, policy=policy, engine=NullEngine(), dataset=dataset(SPREAD),
                    out_dir=tmp_path, validator=validator)
    history = asyncio.run(t.run())
    assert [(m["kind"], m["step"]) for m in history] == [("val", 0), ("train", 0), ("val", 1), ("train", 1), ("val", 2)]
    for step, version, (version_at_start, collected_at_start), (version_at_end, collected_at_end) in validator.seen:
        assert version == version_at_start == version_at_end == step, "no refit while a validation runs"
        if step < 2:
            assert collected_at_end > collected_at_start, f"step {step}'s rollouts ran beside its validation"
        else:
            assert collected_at_end == collected_at_start, "the last validation has no rollouts beside it"
