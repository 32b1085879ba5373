"""Code written to NeMo-RL's older documented interface and code written to NeMo-RL HEAD both run unchanged.

Each interface is implemented twice, the documented way (``shared/reference/documented-api``) and HEAD's way
(7ea279a), and driven through our code: environments as Ray actors through ``run_multi_turn_rollout``, the
native ``RolloutManager`` and ``calculate_rewards``; policies over the tiny model through one step of our
GRPO loop (``GRPOTrainer``) and NeMo-RL's own call forms; ``generate_responses`` on the tiny model; the VLM
environment created as each generation creates it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypedDict

import pytest
import ray
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.data import datum_from_chat
from gym_bridge.environments.vlm import VLMEnvironment, VLMVerifyWorker
from gym_bridge.failures import RolloutDataFailure
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.interfaces import ColocatablePolicyInterface, EnvironmentInterface, GenerationInterface, PolicyInterface
from gym_bridge.policy import HFPolicy, HFPolicyConfig
from gym_bridge.rollout.env_step import calculate_rewards
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.rollout.sync import generate_responses, run_multi_turn_rollout
from gym_bridge.training.loop import GRPOTrainer
from gym_bridge.training.loop_config import GRPOLoopConfig
from gym_bridge.training.trainer_state import STATE_FILE
from gym_bridge.types import EnvironmentReturn, LogprobOutputSpec, ReferenceLogprobOutputSpec, TopkLogitsOutputSpec

pytestmark = pytest.mark.usefixtures("ray_session")


# ---------------------------------------------------------------- environments


class DocumentedReturn(NamedTuple):
    """NeMo-RL's documented ``EnvironmentReturn``: five fields, no ``answers``."""

    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[Any]
    rewards: torch.Tensor
    terminateds: torch.Tensor


def _turn(message_log_batch, metadata):
    """One turn of a two-turn game: 1.0 for the expected reply; ``turns_left`` counts down to the end."""
    replies = [log[-1]["content"].strip() for log in message_log_batch]
    rewards = torch.tensor([float(r == m["expected"]) for r, m in zip(replies, metadata, strict=True)])
    done = [m["turns_left"] == 0 for m in metadata]
    observations = [{"role": "user", "content": "done" if d else "again"} for d in done]
    next_metadata = [
        None if d else {**m, "turns_left": m["turns_left"] - 1} for m, d in zip(metadata, done, strict=True)
    ]
    return replies, observations, next_metadata, rewards, done


class DocumentedEnvironment(EnvironmentInterface):
    """The documented contract, built with our ``EnvironmentReturn`` and its five documented keywords."""

    def step(self, message_log_batch, metadata):
        _, observations, next_metadata, rewards, done = _turn(message_log_batch, metadata)
        return EnvironmentReturn(
            observations=observations,
            metadata=next_metadata,
            next_stop_strings=[None] * len(done),
            rewards=rewards,
            terminateds=torch.tensor(done),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class DocumentedNamedTupleEnvironment(DocumentedEnvironment):
    """The documented contract returning NeMo-RL's own five-field named tuple."""

    def step(self, message_log_batch, metadata):
        return DocumentedReturn(*super().step(message_log_batch, metadata)[:5])


class TupleEnvironment(DocumentedEnvironment):
    """A documented-era environment returning a plain 5-tuple."""

    def step(self, message_log_batch, metadata):
        return tuple(super().step(message_log_batch, metadata)[:5])


class GameMetadata(TypedDict):
    expected: str
    turns_left: int


class HeadEnvironment(EnvironmentInterface[GameMetadata]):
    """HEAD's contract: generic in its metadata, six fields with ``answers``, float ``terminateds`` (as HEAD's VLM)."""

    def step(self, message_log_batch, metadata):
        replies, observations, next_metadata, rewards, done = _turn(message_log_batch, metadata)
        return EnvironmentReturn[GameMetadata](
            observations, next_metadata, [None] * len(done), rewards, torch.tensor(done).float(), replies
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class FourFieldEnvironment(DocumentedEnvironment):
    """Neither generation's contract: a field is missing."""

    def step(self, message_log_batch, metadata):
        return tuple(super().step(message_log_batch, metadata)[:4])


ENVIRONMENTS = {
    "documented": DocumentedEnvironment,
    "documented_namedtuple": DocumentedNamedTupleEnvironment,
    "tuple": TupleEnvironment,
    "head": HeadEnvironment,
}


@pytest.fixture(scope="module")
def environments(ray_session):
    actors = {name: ray.remote(num_cpus=0)(cls).remote() for name, cls in ENVIRONMENTS.items()}
    yield actors
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer):
    return ScriptedGeneration(tiny_tokenizer)


def _datum(tokenizer, idx, task, expected, reply="42", turns_left=1):
    return datum_from_chat(
        tokenizer,
        [{"role": "user", "content": f"Reply with exactly: {reply}"}],
        idx=idx,
        task_name=task,
        extra_env_info={"expected": expected, "turns_left": turns_left},
    )


def _batch(data):
    return BatchedDataDict({k: [d[k] for d in data] for k in ("message_log", "extra_env_info", "task_name", "idx")})


def test_five_and_six_field_environments_run_through_the_batched_rollout(environments, scripted, tiny_tokenizer):
    data = [
        _datum(tiny_tokenizer, 2 * i + j, task, expected)
        for i, task in enumerate(ENVIRONMENTS)
        for j, expected in enumerate(["42", "7"])
    ]
    final, metrics = run_multi_turn_rollout(scripted, _batch(data), tiny_tokenizer, environments, 512, 3)
    assert final["total_reward"].tolist() == [2.0, 0.0] * len(ENVIRONMENTS)  # two turns, rewarded when right
    assert [[m["content"] for m in log[1:]] for log in final["message_log"]] == [["42", "again", "42", "done"]] * 8
    assert [info["turns_left"] for info in final["extra_env_info"]] == [0] * 8  # the environment's metadata carried
    assert metrics["total_turns"] == 16 and metrics["natural_termination_rate"] == 1.0


async def test_five_and_six_field_environments_run_through_the_native_manager(environments, scripted, tiny_tokenizer):
    manager = RolloutManager(tiny_tokenizer, environments, 2, 512, 3, scripted)
    for i, task in enumerate(ENVIRONMENTS):
        record = await manager.run_rollout(_datum(tiny_tokenizer, i, task, "42"))
        assert [c.reward for c in record.completions] == [2.0, 2.0], task
        assert [m["content"] for m in record.completions[0].message_log[1:]] == ["42", "again", "42", "done"]


def test_calculate_rewards_returns_six_fields_with_answers_only_where_the_environment_gave_them(
    environments, tiny_tokenizer
):
    logs = [
        [*_datum(tiny_tokenizer, 0, task, "42")["message_log"], {"role": "assistant", "content": "42"}]
        for task in ENVIRONMENTS
    ]
    batch = {
        "message_log": logs,
        "extra_env_info": [{"expected": "42", "turns_left": 0}] * len(logs),
        "task_name": list(ENVIRONMENTS),
    }
    ret = calculate_rewards(batch, environments)
    assert ret.answers == [None, None, None, "42"]
    assert ret.rewards.tolist() == [1.0] * 4 and ret.terminateds.tolist() == [True] * 4


def test_an_environment_returning_neither_five_nor_six_fields_is_named(scripted, tiny_tokenizer):
    env = ray.remote(num_cpus=0)(FourFieldEnvironment).remote()
    try:
        with pytest.raises(TypeError, match="returned 4 fields; expected EnvironmentReturn's 5"):
            run_multi_turn_rollout(
                scripted, _batch([_datum(tiny_tokenizer, 0, "four", "42")]), tiny_tokenizer, {"four": env}, 512
            )
    finally:
        ray.kill(env)


def test_environment_return_takes_the_documented_five_fields_and_heads_six():
    five = EnvironmentReturn([], [], None, torch.zeros(0), torch.zeros(0))
    six = EnvironmentReturn([], [], None, torch.zeros(0), torch.zeros(0), ["a"])
    assert five.answers is None and six.answers == ["a"]
    assert EnvironmentReturn._fields[:5] == DocumentedReturn._fields


# ---------------------------------------------------------------- policies


class DocumentedPolicy(PolicyInterface):
    """Exactly the documented abstract methods with their documented signatures, over the tiny model.

    ``tokenizer`` is our GRPO loop's own requirement (it pads with the policy's pad token).
    """

    def __init__(self, model: HFPolicy):
        self.model, self.tokenizer = model, model.tokenizer
        self.train_calls: list[tuple[int | None, int | None]] = []

    def get_logprobs(self, data):
        return self.model.get_logprobs(data)

    def get_reference_policy_logprobs(self, data):
        return self.model.get_reference_policy_logprobs(data)

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None):
        self.train_calls.append((gbs, mbs))
        return self.model.train(data, loss_fn, eval_mode, gbs=gbs, mbs=mbs)

    def prepare_for_training(self, *args, **kwargs):
        self.model.prepare_for_training()

    def finish_training(self, *args, **kwargs):
        self.model.finish_training()

    def save_checkpoint(self, *args, **kwargs):
        self.model.save_checkpoint(*args, **kwargs)

    def shutdown(self):
        return True


class DocumentedColocatablePolicy(DocumentedPolicy, ColocatablePolicyInterface):
    """The documented colocatable methods, the IPC refit included; none of HEAD's streaming ones."""

    def init_collective(self, ip, port, world_size):
        self.collective = (ip, port, world_size)
        return []

    def offload_before_refit(self):
        return None

    def offload_after_refit(self):
        return None

    def prepare_refit_info(self):
        return {name: (tuple(t.shape), t.dtype) for name, t in self.model.model.state_dict().items()}

    def prepare_weights_for_ipc(self, *args, **kwargs):
        return [list(self.model.model.state_dict())]

    def get_weights_ipc_handles(self, keys):
        state = self.model.model.state_dict()
        return {key: state[key] for key in keys}

    def broadcast_weights_for_collective(self):
        return []


class HeadPolicy(PolicyInterface):
    """HEAD's abstract methods with HEAD's signatures (``timer``, keyword-only ``gbs``/``mbs``, top-k, FP8)."""

    def __init__(self, model: HFPolicy):
        self.model, self.tokenizer = model, model.tokenizer
        self.train_calls: list[tuple[int | None, int | None]] = []

    def get_logprobs(self, data, timer=None):
        return self.model.get_logprobs(data, timer=timer)

    def get_reference_policy_logprobs(self, data, micro_batch_size=None, timer=None):
        return self.model.get_reference_policy_logprobs(data, micro_batch_size, timer=timer)

    def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):
        return self.model.get_topk_logits(data, k, micro_batch_size, timer=timer)

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, timer=None):
        self.train_calls.append((gbs, mbs))
        return self.model.train(data, loss_fn, eval_mode, gbs=gbs, mbs=mbs, timer=timer)

    def calibrate_qkv_fp8_scales(self, data, micro_batch_size=None, percentile=99.9, margin=1.05, include_q=False):
        return {"percentile": percentile, "margin": margin, "layers": {}}

    def prepare_for_training(self, *args, **kwargs):
        self.model.prepare_for_training()

    def finish_training(self, *args, **kwargs):
        self.model.finish_training()

    def save_checkpoint(self, *args, **kwargs):
        self.model.save_checkpoint(*args, **kwargs)

    def shutdown(self):
        return True


class HeadColocatablePolicy(HeadPolicy, ColocatablePolicyInterface):
    """HEAD's colocatable methods: ``train_world_size``, ZMQ streaming, LP inference; no documented IPC refit."""

    def init_collective(self, ip, port, world_size, *, train_world_size, nccl_peer="nemo"):
        self.collective = (ip, port, world_size, train_world_size, nccl_peer)
        return []

    def offload_before_refit(self):
        return None

    def offload_after_refit(self):
        return None

    def prepare_refit_info(self):
        return {name: (tuple(t.shape), t.dtype) for name, t in self.model.model.state_dict().items()}

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes, kv_scales=None):
        return [buffer_size_bytes]

    def broadcast_weights_for_collective(self, kv_scales=None, *, buffer_size_bytes=None, num_buffers=None):
        return [buffer_size_bytes, num_buffers]

    def prepare_for_lp_inference(self, keep_train_buffers=False):
        self.model.finish_training()


POLICIES = [DocumentedPolicy, DocumentedColocatablePolicy, HeadPolicy, HeadColocatablePolicy]


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return HFPolicy(HFPolicyConfig(model=str(tiny_model_dir), learning_rate=1e-3))


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
async def test_policies_of_both_generations_train_in_our_grpo_loop(
    cls, tiny_policy, environments, scripted, tiny_tokenizer, tmp_path
):
    policy = cls(tiny_policy)
    manager = RolloutManager(tiny_tokenizer, environments, 2, 512, 3, scripted)
    dataset = [_datum(tiny_tokenizer, i, "documented", expected) for i, expected in enumerate(["42", "7"])]
    trainer = GRPOTrainer(
        GRPOLoopConfig(num_prompts_per_step=2, max_num_steps=1, train_micro_batch_size=2),
        manager=manager,
        policy=policy,
        engine=None,
        dataset=dataset,
        out_dir=tmp_path,
    )
    steps_before = tiny_policy.steps_taken
    groups = await trainer.rollout(0)
    groups[0].record.completions[0].reward -= 1.0  # the scripted replies are equal within a group: give it a spread
    metrics = await trainer.train_step(0, groups, rollout_s=0.0, refit_engine=False)
    assert policy.train_calls == [(None, 2)]  # our loop passes mbs by keyword: both signatures take it
    assert tiny_policy.steps_taken == steps_before + 1
    assert metrics["train/samples"] == 4 and metrics["train/mean_reward"] == 0.75  # 2.0 and 0.0 per prompt, one -1
    assert math.isfinite(metrics["train/loss"]) and metrics["on_policy/tokens"] > 0
    checkpoint = trainer.save_checkpoint()
    assert {"config.json", "optimizer.pt", STATE_FILE} <= {p.name for p in checkpoint.iterdir()}


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_policies_answer_nemo_rls_logprob_calls(cls, tiny_policy, tiny_tokenizer):
    words = tiny_tokenizer.encode("one two three four", add_special_tokens=False)
    pad = tiny_tokenizer.pad_token_id
    ids = torch.tensor([words[:3], [words[3], pad, pad]])
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([3, 1])})
    policy = cls(tiny_policy)
    logprobs = policy.get_logprobs(data)  # the documented call form, which HEAD's signature accepts too
    reference = policy.get_reference_policy_logprobs(data)
    assert set(logprobs) == LogprobOutputSpec.__required_keys__ and logprobs["logprobs"].shape == (2, 3)
    assert set(reference) == ReferenceLogprobOutputSpec.__required_keys__
    assert reference["reference_logprobs"].shape == (2, 3)
    assert bool((logprobs["logprobs"] <= 0).all()) and logprobs["logprobs"][1, 1:].tolist() == [0.0, 0.0]
    if isinstance(policy, HeadPolicy):  # HEAD's call forms
        again = policy.get_logprobs(data, timer=None)
        assert torch.equal(again["logprobs"], logprobs["logprobs"])
        in_steps = policy.get_reference_policy_logprobs(data, micro_batch_size=1, timer=None)
        assert torch.allclose(in_steps["reference_logprobs"], reference["reference_logprobs"], atol=1e-5)
        top = policy.get_topk_logits(data, k=4)
        assert set(top) == TopkLogitsOutputSpec.__required_keys__ and top["topk_logits"].shape == (2, 2, 4)
        assert policy.calibrate_qkv_fp8_scales(data, percentile=99.0)["percentile"] == 99.0
    else:
        with pytest.raises(NotImplementedError, match=rf"^{cls.__name__}\.get_topk_logits is not implemented$"):
            policy.get_topk_logits(data, 4)
        with pytest.raises(NotImplementedError, match=rf"^{cls.__name__}\.calibrate_qkv_fp8_scales is not"):
            policy.calibrate_qkv_fp8_scales(data)


def test_documented_colocatable_refit_in_its_call_forms_and_heads_methods_name_themselves(tiny_policy):
    policy = DocumentedColocatablePolicy(tiny_policy)
    assert policy.init_collective("10.0.0.1", 29500, 2) == [] and policy.collective == ("10.0.0.1", 29500, 2)
    keys = policy.prepare_weights_for_ipc()[0][:2]
    assert set(policy.get_weights_ipc_handles(keys)) == set(keys) and set(keys) <= set(policy.prepare_refit_info())
    assert policy.broadcast_weights_for_collective() == [] and policy.offload_to_cpu() is None
    heads = {
        "stream_weights_via_ipc_zmq": lambda: policy.stream_weights_via_ipc_zmq(buffer_size_bytes=1 << 20),
        "prepare_for_lp_inference": lambda: policy.prepare_for_lp_inference(keep_train_buffers=True),
        "stream_weights_via_http": lambda: policy.stream_weights_via_http(
            rollout_engine_urls=["http://127.0.0.1:30000"], buffer_size_bytes=1 << 20
        ),
        "set_rollout_num_gpus_per_engine": lambda: policy.set_rollout_num_gpus_per_engine(num_gpus_per_engine=2),
        "prepare_nccl_reshard_refit_info": lambda: policy.prepare_nccl_reshard_refit_info(
            train_parallelism={"tp": 1}, gen_parallelism={"tp": 1}, train_world_size=1, gen_world_size=1
        ),
        "nccl_reshard_refit": lambda: policy.nccl_reshard_refit(kv_scales=None),
    }
    for name, call in heads.items():
        with pytest.raises(NotImplementedError, match=rf"^DocumentedColocatablePolicy\.{name} is not implemented$"):
            call()


def test_head_colocatable_refit_in_its_call_forms_and_the_documented_methods_name_themselves(tiny_policy):
    policy = HeadColocatablePolicy(tiny_policy)
    assert policy.init_collective("10.0.0.1", 29500, 2, train_world_size=1) == []
    assert policy.collective == ("10.0.0.1", 29500, 2, 1, "nemo")
    assert policy.stream_weights_via_ipc_zmq(buffer_size_bytes=1024, kv_scales=None) == [1024]
    assert policy.broadcast_weights_for_collective(None, buffer_size_bytes=64, num_buffers=2) == [64, 2]
    policy.prepare_for_lp_inference(keep_train_buffers=False)
    assert not tiny_policy.model.training
    with pytest.raises(NotImplementedError, match=r"^HeadColocatablePolicy\.prepare_weights_for_ipc is not"):
        policy.prepare_weights_for_ipc()
    with pytest.raises(NotImplementedError, match=r"^HeadColocatablePolicy\.get_weights_ipc_handles is not"):
        policy.get_weights_ipc_handles(["lm_head.weight"])


@pytest.mark.parametrize(
    ("complete", "bases", "missing"),
    [
        (DocumentedPolicy, (PolicyInterface,), "train"),
        (HeadPolicy, (PolicyInterface,), "get_logprobs"),
        (
            DocumentedColocatablePolicy,
            (DocumentedPolicy, ColocatablePolicyInterface),
            "broadcast_weights_for_collective",
        ),
        (HeadColocatablePolicy, (HeadPolicy, ColocatablePolicyInterface), "init_collective"),
    ],
)
def test_a_policy_missing_a_method_both_generations_require_cannot_be_instantiated(
    complete, bases, missing, tiny_policy
):
    methods = {k: v for k, v in vars(complete).items() if not k.startswith("__") and k != missing}
    incomplete = type(f"No_{missing}", bases, {**methods, "__init__": complete.__init__})
    assert isinstance(complete(tiny_policy), bases)  # the complete class instantiates and implements every base
    with pytest.raises(TypeError, match=rf"abstract method.*'{missing}'"):
        incomplete(tiny_policy)


# ---------------------------------------------------------------- generate_responses


@pytest.fixture(scope="module")
def tiny_generation(tiny_model_dir):
    gen = HFGeneration(HFGenerationConfig(model=str(tiny_model_dir), max_new_tokens=6, seed=0))
    yield gen
    gen.shutdown()


def test_generate_responses_reports_max_seqlen_in_both_call_forms(tiny_generation, tiny_tokenizer):
    texts = ["What is 1 + 1?", "Name the seven colours of the rainbow, in order, please."]
    prompts = [
        datum_from_chat(tiny_tokenizer, [{"role": "user", "content": t}], idx=i)["message_log"][0]["token_ids"]
        for i, t in enumerate(texts)
    ]
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((2, int(lengths.max())), tiny_tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    for form in ("documented", "head"):
        batch = BatchedDataDict({"message_log": [[], []]})
        data = BatchedDataDict({"input_ids": ids.clone(), "input_lengths": lengths})
        if form == "documented":  # all positional, as the documented signature lists them
            _, generated, metrics = generate_responses(
                tiny_generation, data, batch, tiny_tokenizer, lengths, True, True
            )
        else:
            _, generated, metrics = generate_responses(
                policy_generation=tiny_generation,
                generation_input_data=data,
                batch=batch,
                tokenizer=tiny_tokenizer,
                input_lengths=lengths,
                include_logprobs=True,
                greedy=True,
            )
        totals = [int(lengths[i]) + int(g.numel()) for i, g in enumerate(generated)]
        assert metrics["max_seqlen"] == max(totals) and max(totals) > int(lengths.max()), form
        assert metrics["mean_generation_length"] == sum(g.numel() for g in generated) / 2, form
        assert metrics["total_generated_tokens"] == sum(g.numel() for g in generated), form
        assert [m[0]["token_ids"].tolist() for m in batch["message_log"]] == [g.tolist() for g in generated]


class HeadGeneration(GenerationInterface):
    """A generation engine written to HEAD's interface (its abstract methods only: no ``generate_async``)."""

    def __init__(self, engine: HFGeneration):
        self.engine = engine

    def init_collective(self, ip, port, world_size, *, train_world_size):
        return []

    def generate(self, data, greedy):
        return self.engine.generate(data, greedy=greedy)

    def prepare_for_generation(self, *args, **kwargs):
        return True

    def finish_generation(self, *args, **kwargs):
        return True

    def shutdown(self):
        return True


async def test_a_generation_engine_written_to_head_rolls_out_in_the_batched_path(
    tiny_generation, environments, tiny_tokenizer
):
    engine = HeadGeneration(tiny_generation)
    data = [_datum(tiny_tokenizer, i, task, "42") for i, task in enumerate(ENVIRONMENTS)]
    final, metrics = run_multi_turn_rollout(engine, _batch(data), tiny_tokenizer, environments, 512, 3, True)
    assert metrics["total_turns"] == 2 * len(data)
    for log, reward in zip(final["message_log"], final["total_reward"].tolist(), strict=True):
        replies = [m["content"].strip() for m in log if m["role"] == "assistant"]
        assert len(replies) == 2 and reward == sum(float(r == "42") for r in replies)
    native = RolloutManager(tiny_tokenizer, environments, 1, 512, 3, engine)
    with pytest.raises(RolloutDataFailure, match=r"HeadGeneration\.generate_async is not implemented$"):
        await native.run_rollout(data[0])


# ---------------------------------------------------------------- the VLM environment


def _vlm_rollout(env, scripted, tokenizer):
    replies = ["<think>ok</think><answer>cube</answer>", "<answer>ball</answer>"]
    data = [
        datum_from_chat(
            tokenizer,
            [{"role": "user", "content": f"What shape? Reply with exactly: {r}"}],
            idx=i,
            task_name="vlm",
            extra_env_info={"ground_truth": "cube"},
        )
        for i, r in enumerate(replies)
    ]
    batch = BatchedDataDict({k: [d[k] for d in data] for k in ("message_log", "extra_env_info", "task_name")})
    final, _ = run_multi_turn_rollout(scripted, batch, tokenizer, {"vlm": env}, 512, 1)
    return final


@pytest.mark.slow  # four Ray actor processes that import torch
def test_vlm_environment_as_each_generation_creates_and_configures_it(scripted, tiny_tokenizer):
    reward_functions = [{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}]
    documented = VLMEnvironment.remote({"num_workers": 1, "stop_strings": None, "reward_functions": reward_functions})
    head = VLMEnvironment.options(runtime_env={"env_vars": {"GYM_BRIDGE_TEST": "head"}}).remote(
        {"num_workers": 1, "reward_functions": reward_functions}  # HEAD: stop_strings is NotRequired
    )
    worker = VLMVerifyWorker.remote({"num_workers": 1, "stop_strings": None, "reward_functions": reward_functions})
    try:
        scores = ray.get(worker.verify.remote(["<think>a</think><answer>cube</answer>", "x"], ["cube", "cube"]))
        assert scores == pytest.approx([1.0, 0.0])
        for env in (documented, head):
            final = _vlm_rollout(env, scripted, tiny_tokenizer)
            assert final["total_reward"].tolist() == pytest.approx([1.0, 0.2 * 0.75])
            assert [log[-1]["content"] for log in final["message_log"]] == [
                "Environment: correct",
                "Environment: incorrect",
            ]
            _, metrics = ray.get(env.global_post_process_and_metrics.remote(final))
            documented_metrics = {
                "accuracy": 0.5,
                "pass@samples_per_prompt": 0.5,
                "fraction_of_samples_properly_ended": 1.0,
                "num_problems_in_batch": 2,
            }
            assert {k: metrics[k] for k in documented_metrics} == pytest.approx(documented_metrics)
            assert metrics["generation_lengths"] > 0 and metrics["prompt_lengths"] > 0
            assert metrics["correct_solution_generation_lengths"] == final["message_log"][0][1]["token_ids"].numel()
    finally:
        for env in (documented, head):
            ray.get(env.shutdown.remote())
            ray.kill(env)
        ray.kill(worker)
