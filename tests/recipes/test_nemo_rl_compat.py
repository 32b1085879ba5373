"""NeMo-RL drop-in: positional construction, keywords checked against the backend,
``calculate_rewards(batch, task_to_env)``, truncation per path and the drift flag."""

from __future__ import annotations

import inspect

import pytest
import ray
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.data import datum_from_chat
from gym_bridge.environments.arithmetic import arithmetic_env_actor
from gym_bridge.failures import RolloutRetryPolicy, RolloutStats, RolloutTimeouts
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.rollout.env_step import calculate_rewards
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.rollout.native import UNLIMITED_TURNS, AsyncRolloutImpl
from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl, group_metrics, gym_completion
from gym_bridge.rollout.sync import run_multi_turn_rollout
from gym_bridge.rollout.truncation import fit_observation, gym_completion_truncated
from gym_bridge.types import Completion, token_tensor

GEN_CFG = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def arithmetic(ray_session):
    env = arithmetic_env_actor()
    yield env
    ray.kill(env)


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer):
    return ScriptedGeneration(tiny_tokenizer, max_new_tokens=16)


def arithmetic_datum(tokenizer, idx=0):
    return datum_from_chat(
        tokenizer,
        [{"role": "user", "content": "Reply with exactly: 19"}],
        idx=idx,
        task_name="arithmetic",
        extra_env_info={"ground_truth": "19", "attempts_left": 0},
    )


# ---------------------------------------------------------------- construction


async def test_manager_takes_nemo_rl_positional_arguments(tiny_tokenizer, scripted, arithmetic):
    policy = RolloutRetryPolicy.single_attempt(max_data_attempts=2)
    timeouts = RolloutTimeouts(env_s=60.0)
    # NeMo-RL's order: tokenizer, task_to_env, N, max_seq_len, max_rollout_turns, policy_generation,
    # generation_config, use_nemo_gym, mask_env_flagged_samples, tq_buffer, timeouts, retry_policy
    manager = RolloutManager(
        tiny_tokenizer, {"arithmetic": arithmetic}, 2, 512, None, scripted, None, False, True, None, timeouts, policy
    )
    assert manager.backend_name == "native" and manager.retry_policy is policy and manager.timeouts is timeouts
    backend = manager.backend
    assert isinstance(backend, AsyncRolloutImpl)
    assert backend.max_rollout_turns == UNLIMITED_TURNS  # None: no turn limit of ours
    assert backend.retry_policy is policy and backend.stats is manager.stats
    record = await manager.run_rollout(arithmetic_datum(tiny_tokenizer, idx=5))
    assert record.prompt_idx == 5 and [c.reward for c in record.completions] == [1.0, 1.0]


def test_backends_take_nemo_rl_positional_arguments(tiny_tokenizer, scripted):
    assert inspect.signature(AsyncRolloutImpl).parameters["max_rollout_turns"].default == 999999
    with pytest.raises(ValueError, match="policy_generation"):
        AsyncRolloutImpl(tiny_tokenizer, {}, 3, 128, 5)
    native = AsyncRolloutImpl(tiny_tokenizer, {}, 3, 128, 5, scripted, RolloutTimeouts(generation_s=9.0))
    assert native.max_rollout_turns == 5 and native.timeouts.generation_s == 9.0

    actor, stats = object(), RolloutStats()
    policy = RolloutRetryPolicy.single_attempt(max_gym_row_attempts=4)
    # tokenizer, task_to_env, N, max_seq_len, max_rollout_turns, generation_config,
    # mask_env_flagged_samples, timeouts, retry_policy, stats
    gym = AsyncNemoGymRolloutImpl(
        tiny_tokenizer, {"nemo_gym": actor}, 2, 256, None, GEN_CFG, False, RolloutTimeouts(rollout_s=5.0), policy, stats
    )
    assert gym.actors == [actor] and gym.max_gym_row_attempts == 4 and gym.stats is stats
    assert gym.mask_env_flagged_samples is False and gym.timeouts.rollout_s == 5.0
    with pytest.raises(TypeError, match="max_gym_row_attempts"):  # the row budget has one route: the policy
        AsyncNemoGymRolloutImpl(
            tiny_tokenizer, {"nemo_gym": actor}, 2, 256, 1, GEN_CFG, max_gym_row_attempts=2  # type: ignore[call-arg]
        )


def test_the_gym_backend_is_built_with_the_keywords_nemo_rls_manager_passes(tiny_tokenizer, scripted):
    """NeMo-RL's RolloutManager hands its impl every keyword it has (policy_generation among them); its impl
    takes **kwargs, so ours does too. Without a retry policy a row gets one attempt (NeMo-RL's single_attempt)."""
    gym = AsyncNemoGymRolloutImpl(
        tokenizer=tiny_tokenizer,
        task_to_env={"nemo_gym": object()},
        num_generations_per_prompt=2,
        max_seq_len=256,
        max_rollout_turns=1,
        policy_generation=scripted,
        generation_config=GEN_CFG,
        mask_env_flagged_samples=True,
        timeouts=RolloutTimeouts(),
        retry_policy=None,
        stats=RolloutStats(),
    )
    assert gym.max_gym_row_attempts == 1 and gym.client.resend_env_infra_failures is True
    unmasked = AsyncNemoGymRolloutImpl(tiny_tokenizer, {"nemo_gym": object()}, 2, 256, 1, GEN_CFG, False)
    assert unmasked.client.resend_env_infra_failures is False  # without masking, Gym's flagged rows are kept


def test_retry_policy_reaches_the_gym_backend_through_the_manager(tiny_tokenizer):
    policy = RolloutRetryPolicy.single_attempt(max_gym_row_attempts=5)
    manager = RolloutManager(
        tiny_tokenizer, {"nemo_gym": object()}, 2, 256, generation_config=GEN_CFG, use_nemo_gym=True,
        retry_policy=policy, max_rollout_turns=None,
    )
    assert manager.backend.max_gym_row_attempts == 5 and manager.backend.stats is manager.stats


def test_unknown_keywords_are_rejected_naming_keyword_and_backend(tiny_tokenizer, scripted):
    with pytest.raises(TypeError, match=r"'native': unknown option 'max_turns' \(it takes: greedy\)"):
        RolloutManager(tiny_tokenizer, {}, 2, 128, policy_generation=scripted, max_turns=3)
    with pytest.raises(TypeError, match=r"'nemo_gym': unknown option 'stop_strings' \(it takes: .*full_results_path"):
        RolloutManager(
            tiny_tokenizer, {"nemo_gym": object()}, 2, 128, generation_config=GEN_CFG, use_nemo_gym=True,
            stop_strings=["x"],
        )
    with pytest.raises(TypeError, match="max_turns"):
        AsyncRolloutImpl(tiny_tokenizer, {}, 2, 128, policy_generation=scripted, max_turns=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tq_buffer"):
        AsyncNemoGymRolloutImpl(
            tiny_tokenizer, {}, 2, 128, generation_config=GEN_CFG, tq_buffer=None  # type: ignore[call-arg]
        )
    with pytest.raises(TypeError, match="tq_buffer must implement the replay-buffer contract"):
        RolloutManager(tiny_tokenizer, {}, 2, 128, policy_generation=scripted, tq_buffer=object())


NEMO_RL_ORDERS = {
    RolloutManager: ["tokenizer", "task_to_env", "num_generations_per_prompt", "max_seq_len", "max_rollout_turns",
                     "policy_generation", "generation_config", "use_nemo_gym", "mask_env_flagged_samples",
                     "tq_buffer", "timeouts", "retry_policy"],
    AsyncRolloutImpl: ["tokenizer", "task_to_env", "num_generations_per_prompt", "max_seq_len", "max_rollout_turns",
                       "policy_generation", "timeouts"],
    AsyncNemoGymRolloutImpl: ["tokenizer", "task_to_env", "num_generations_per_prompt", "max_seq_len",
                              "max_rollout_turns", "generation_config", "mask_env_flagged_samples", "timeouts",
                              "retry_policy", "stats"],
    run_multi_turn_rollout: ["policy_generation", "input_batch", "tokenizer", "task_to_env", "max_seq_len",
                             "max_rollout_turns", "greedy", "deduplicate_multimodal_data"],
}


@pytest.mark.parametrize("target", list(NEMO_RL_ORDERS), ids=lambda t: t.__name__)
def test_positional_parameters_are_nemo_rl_s_and_nothing_else_is_positional(target):
    params = inspect.signature(target).parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == NEMO_RL_ORDERS[target]


def test_rollout_stats_take_nemo_rl_s_keywords():
    """NeMo-RL's manager and collectors call these with its own argument names (rollout_manager.py 172-196)."""
    stats = RolloutStats()
    stats.record_redispatch(reason="RolloutTimeout")
    stats.record_data_retry(reason="InvalidGymRow")
    stats.record_data_failure(reason="InvalidGymRow")
    stats.record_infra_drop(reason="RolloutTimeout", consecutive=2)
    stats.record_gym_row_redispatch()
    stats.record_gym_row_redispatch(rows=3)
    assert stats.gym_row_redispatches == 4 and stats.max_consecutive_infra_drops == 2
    assert stats.as_metrics()["rollout/gym_row_redispatch_total"] == 4


# ---------------------------------------------------------------- calculate_rewards


def test_calculate_rewards_as_nemo_rl_calls_it(tiny_tokenizer, arithmetic):
    def log(answer):
        return [
            {"role": "user", "content": "What is 12 + 7?", "token_ids": token_tensor([1])},
            {"role": "assistant", "content": answer, "token_ids": token_tensor([2])},
        ]

    batch = BatchedDataDict(
        {
            "message_log": [log("19"), log("20"), log("The answer is 19")],
            "extra_env_info": [{"ground_truth": "19", "attempts_left": 0}] * 3,
            "task_name": ["arithmetic"] * 3,
        }
    )
    observations, metadata, next_stops, rewards, terminateds, answers = calculate_rewards(
        batch, {"arithmetic": arithmetic}
    )
    assert rewards.tolist() == [1.0, 0.0, 1.0]
    assert terminateds.tolist() == [True, True, True]
    assert len(observations) == len(metadata) == len(next_stops) == 3
    with pytest.raises(KeyError, match="no environment for task_name='other'"):
        calculate_rewards({**batch, "task_name": ["other"] * 3}, {"arithmetic": arithmetic})
    with pytest.raises(ValueError, match="3 message logs but 1 extra_env_info"):
        calculate_rewards({**batch, "extra_env_info": [{}]}, {"arithmetic": arithmetic})


# ---------------------------------------------------------------- truncation and drift


def test_native_and_sync_rule_cuts_the_observation_to_what_max_seq_len_leaves():
    obs = token_tensor(range(10))
    fits = fit_observation(obs, input_len=50, gen_len=20, max_seq_len=100)
    assert fits.truncated is False and fits.token_ids.tolist() == list(range(10))
    assert fit_observation(obs, input_len=50, gen_len=20, max_seq_len=100, response_truncated=True).truncated
    cut = fit_observation(obs, input_len=50, gen_len=45, max_seq_len=100)
    assert cut.truncated and cut.token_ids.tolist() == [0, 1, 2, 3, 4]
    exact = fit_observation(obs, input_len=50, gen_len=40, max_seq_len=100)  # 100 >= 100: NeMo-RL's ">="
    assert exact.truncated and exact.token_ids.numel() == 10
    full = fit_observation(token_tensor([]), input_len=60, gen_len=40, max_seq_len=100)
    assert full.truncated and full.token_ids.dtype == torch.int64 and full.token_ids.numel() == 0


def test_gym_rule_is_exact_equality_with_max_seq_len():
    assert gym_completion_truncated(100, 100)
    assert not gym_completion_truncated(99, 100) and not gym_completion_truncated(101, 100)
    assert not gym_completion_truncated(100, None)


def _gym_result(lengths, drift=None):
    log = []
    for i, n in enumerate(lengths):
        message = {"role": "user" if i % 2 == 0 else "assistant", "content": "", "token_ids": token_tensor(range(n))}
        if i % 2:
            message["generation_logprobs"] = torch.zeros(n)
        log.append(message)
    return GymRowResult(row_index=0, message_log=log, full_result={"reward": 1.0}, reward=1.0, token_drift=drift)


def test_gym_completions_keep_truncation_and_drift_apart():
    def completion(row: GymRowResult) -> Completion:
        return gym_completion(row, max_seq_len=10, mask_env_flagged_samples=True)

    at_cap = completion(_gym_result([4, 6]))
    past_cap = completion(_gym_result([4, 7]))
    drift = {"turn": 1, "position": 3, "expected": [1], "got": [2]}
    drifted = completion(_gym_result([4, 3], drift=drift))
    assert (at_cap.truncated, at_cap.token_drift) == (True, False)
    assert (past_cap.truncated, past_cap.token_drift) == (False, False)  # NeMo-RL's equality, not ">="
    assert (drifted.truncated, drifted.token_drift) == (False, True)
    assert drifted.env_extras["token_drift"] == drift
    metrics = group_metrics([at_cap, past_cap, drifted], ["agent"] * 3)
    assert metrics["truncation_rate"] == pytest.approx(1 / 3)
    assert metrics["natural_termination_rate"] == pytest.approx(2 / 3)
    assert metrics["token_drift_rate"] == pytest.approx(1 / 3)


def test_sync_rollout_refuses_multimodal_deduplication_it_cannot_do():
    with pytest.raises(ValueError, match="deduplicate_multimodal_data"):
        run_multi_turn_rollout(None, BatchedDataDict({"message_log": [[]]}), None, {}, 10, None, False, True)


def test_should_use_nemo_gym_refuses_what_nemo_rls_asserts_refuse():
    """NeMo-RL asserts on a backend without an async HTTP server and on megatron's removed async_engine key."""
    from gym_bridge.config.keys import TrainingConfigError
    from gym_bridge.config.nemo_rl_gym import should_use_nemo_gym

    def config(generation: dict) -> dict:
        return {"env": {"should_use_nemo_gym": True}, "policy": {"generation": generation}}

    for backend in ("sglang", "hf"):
        with pytest.raises(TrainingConfigError, match=f"backend: {backend} does not offer"):
            should_use_nemo_gym(config({"backend": backend}))
    megatron = {"backend": "megatron", "mcore_generation_config": {"async_engine": True, "expose_http_server": True}}
    with pytest.raises(TrainingConfigError, match="async_engine: Megatron inference is always async"):
        should_use_nemo_gym(config(megatron))
    del megatron["mcore_generation_config"]["async_engine"]
    assert should_use_nemo_gym(config(megatron))


def test_the_managers_max_seq_len_is_the_one_context_length():
    """NeMo-RL's single controller sizes the manager with vllm_cfg.max_model_len, which its recipes set to
    ``${policy.max_total_sequence_length}``: one value. Either key alone is it; two that disagree are refused."""
    from gym_bridge.config.keys import TrainingConfigError
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = {
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": []}},
        "policy": {
            "model_name": "m",
            "max_total_sequence_length": 512,
            "generation": {
                "backend": "vllm",
                "vllm_cfg": {"max_model_len": 384, "async_engine": True, "expose_http_server": True},
                "max_new_tokens": 64,
            },
        },
        "grpo": {"num_generations_per_prompt": 2},
    }
    with pytest.raises(TrainingConfigError, match=r"max_total_sequence_length \(512\) and .*max_model_len \(384\)"):
        nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:9/v1"])
    config["policy"]["generation"]["vllm_cfg"]["max_model_len"] = 512
    assert nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:9/v1"]).launch.max_seq_len == 512
    del config["policy"]["generation"]["vllm_cfg"]["max_model_len"]
    assert nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:9/v1"]).launch.max_seq_len == 512