"""Code written to NeMo-RL's older documented interface and code written to NeMo-RL HEAD both run unchanged.

Each interface is implemented twice, the documented way (``../shared/reference/documented-api``) and HEAD's
way (7ea279a), and driven through our code: environments through ``run_multi_turn_rollout`` (real Ray actors,
the scripted policy), policies by instantiating them and calling what our loop calls, ``generate_responses``
for its documented metrics. The VLM environment's documented construction is in tests/test_vlm_env.py.
"""

from __future__ import annotations

import pytest
import ray
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.data import datum_from_chat
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.interfaces import ColocatablePolicyInterface, EnvironmentInterface, PolicyInterface
from gym_bridge.rollout.sync import generate_responses, run_multi_turn_rollout
from gym_bridge.types import EnvironmentReturn, LogprobOutputSpec, ReferenceLogprobOutputSpec

pytestmark = pytest.mark.usefixtures("ray_session")


class DocumentedEnvironment(EnvironmentInterface):
    """The documented contract: ``step`` returns the five documented fields (no ``answers``)."""

    def step(self, message_log_batch, metadata):
        replies = [log[-1]["content"] for log in message_log_batch]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "done"} for _ in replies],
            metadata=metadata,
            next_stop_strings=[None] * len(replies),
            rewards=torch.tensor([float(r.strip() == m["expected"]) for r, m in zip(replies, metadata, strict=True)]),
            terminateds=torch.ones(len(replies), dtype=torch.bool),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class TupleEnvironment(DocumentedEnvironment):
    """Some documented-era environments return a plain 5-tuple."""

    def step(self, message_log_batch, metadata):
        return tuple(super().step(message_log_batch, metadata))


class HeadEnvironment(DocumentedEnvironment):
    """HEAD's contract: the sixth field, ``answers``."""

    def step(self, message_log_batch, metadata):
        ret = super().step(message_log_batch, metadata)
        return ret._replace(answers=[log[-1]["content"].strip() for log in message_log_batch])


@pytest.fixture(scope="module")
def environments(ray_session):
    actors = {name: ray.remote(num_cpus=0)(cls).remote() for name, cls in
              (("documented", DocumentedEnvironment), ("tuple", TupleEnvironment), ("head", HeadEnvironment))}
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def test_five_and_six_field_environments_run_through_the_rollout(environments, tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer)
    data = [
        datum_from_chat(tiny_tokenizer, [{"role": "user", "content": "Reply with exactly: 42"}], idx=i,
                        task_name=task, extra_env_info={"expected": "42"})
        for i, task in enumerate(["documented", "tuple", "head"])
    ]
    batch = BatchedDataDict({k: [d[k] for d in data] for k in ("message_log", "extra_env_info", "task_name", "idx")})
    final, metrics = run_multi_turn_rollout(policy, batch, tiny_tokenizer, environments, max_seq_len=256,
                                            max_rollout_turns=2)
    assert final["total_reward"].tolist() == [1.0, 1.0, 1.0]
    assert [log[-1]["content"] for log in final["message_log"]] == ["done"] * 3
    assert metrics["total_turns"] == 3


def test_an_environment_returning_neither_five_nor_six_fields_is_named(environments, tiny_tokenizer):
    from gym_bridge.rollout.env_step import _six_fields

    with pytest.raises(TypeError, match="returned 4 fields; expected EnvironmentReturn's 5"):
        _six_fields(([], [], None, torch.zeros(0)))


class DocumentedPolicy(PolicyInterface):
    """Exactly the documented abstract methods, with the documented signatures (gbs, mbs positional)."""

    def __init__(self):
        self.trained: list[tuple[int | None, int | None]] = []

    def get_logprobs(self, data):
        return BatchedDataDict(LogprobOutputSpec(logprobs=torch.zeros_like(data["input_ids"], dtype=torch.float32)))

    def get_reference_policy_logprobs(self, data):
        zeros = torch.zeros_like(data["input_ids"], dtype=torch.float32)
        return BatchedDataDict(ReferenceLogprobOutputSpec(reference_logprobs=zeros))

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None):
        self.trained.append((gbs, mbs))
        return {"loss": 0.0}

    def prepare_for_training(self, *args, **kwargs):
        return None

    def finish_training(self, *args, **kwargs):
        return None

    def save_checkpoint(self, *args, **kwargs):
        return None

    def shutdown(self):
        return True


class DocumentedColocatable(DocumentedPolicy, ColocatablePolicyInterface):
    """The documented colocatable methods, IPC refit included; none of HEAD's streaming ones."""

    def init_collective(self, ip, port, world_size):
        return [f"{ip}:{port}/{world_size}"]

    def offload_before_refit(self):
        return None

    def offload_after_refit(self):
        return None

    def prepare_refit_info(self):
        return {"weights": 1}

    def prepare_weights_for_ipc(self, *args, **kwargs):
        return ["w"]

    def get_weights_ipc_handles(self, keys):
        return dict.fromkeys(keys, "handle")

    def broadcast_weights_for_collective(self):
        return []


class HeadColocatable(DocumentedColocatable):
    """HEAD's shape: keyword-only train sizes, ``train_world_size``, ZMQ streaming; no documented IPC methods."""

    prepare_weights_for_ipc = ColocatablePolicyInterface.prepare_weights_for_ipc
    get_weights_ipc_handles = ColocatablePolicyInterface.get_weights_ipc_handles

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, timer=None):
        return super().train(data, loss_fn, eval_mode, gbs, mbs)

    def init_collective(self, ip, port, world_size, *, train_world_size, nccl_peer="nemo"):
        return [train_world_size]

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes, kv_scales=None):
        return [buffer_size_bytes]

    def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):
        return BatchedDataDict({"topk_logits": torch.zeros(1, k), "topk_indices": torch.zeros(1, k, dtype=torch.long)})


@pytest.mark.parametrize("cls", [DocumentedPolicy, DocumentedColocatable, HeadColocatable])
def test_policies_of_both_generations_instantiate_and_train_as_our_loop_calls_them(cls):
    policy = cls()
    data = BatchedDataDict({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    assert policy.train(data, loss_fn=None, mbs=4) == {"loss": 0.0}  # our loop passes mbs by keyword
    assert policy.trained == [(None, 4)]
    assert policy.get_logprobs(data)["logprobs"].shape == (2, 3)
    assert policy.get_reference_policy_logprobs(data)["reference_logprobs"].shape == (2, 3)


def test_what_a_generation_lacks_raises_naming_the_method():
    documented, head = DocumentedColocatable(), HeadColocatable()
    with pytest.raises(NotImplementedError, match=r"DocumentedColocatable.get_topk_logits is not implemented"):
        documented.get_topk_logits(BatchedDataDict({}), 4)
    with pytest.raises(NotImplementedError, match=r"DocumentedColocatable.stream_weights_via_ipc_zmq"):
        documented.stream_weights_via_ipc_zmq(1024)
    with pytest.raises(NotImplementedError, match=r"HeadColocatable.get_weights_ipc_handles is not implemented"):
        head.get_weights_ipc_handles(["w"])
    with pytest.raises(NotImplementedError, match=r"calibrate_qkv_fp8_scales"):
        head.calibrate_qkv_fp8_scales(BatchedDataDict({}))
    assert documented.get_weights_ipc_handles(["a"]) == {"a": "handle"}
    assert documented.init_collective("10.0.0.1", 29500, 8) == ["10.0.0.1:29500/8"]
    assert head.init_collective("10.0.0.1", 29500, 8, train_world_size=4) == [4]
    assert head.stream_weights_via_ipc_zmq(1024) == [1024]


def test_an_incomplete_policy_still_cannot_be_instantiated():
    class NoTrain(DocumentedPolicy):
        train = None  # type: ignore[assignment]

    NoTrain.__abstractmethods__ = frozenset({"train"})
    with pytest.raises(TypeError, match="abstract method.*train"):
        NoTrain()


def test_generate_responses_reports_the_documented_metrics(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer)
    texts = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                tokenize=False)
             for c in ("Reply with exactly: 7", "Reply with exactly: seventy seven")]
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((2, int(lengths.max())), tiny_tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    batch = BatchedDataDict({"message_log": [[], []]})
    data = BatchedDataDict({"input_ids": ids, "input_lengths": lengths})
    _, generated, metrics = generate_responses(policy, data, batch, tiny_tokenizer, lengths)
    totals = [int(lengths[i]) + int(g.numel()) for i, g in enumerate(generated)]
    assert metrics["max_seqlen"] == max(totals)
    assert metrics["mean_generation_length"] == sum(g.numel() for g in generated) / 2
