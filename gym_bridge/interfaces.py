"""Abstract interfaces: generation, environments, policies, and the rollout-backend hook.

A rollout backend is found through the ``gym_bridge.rollout_backends`` entry-point
group and must satisfy :class:`RolloutBackend`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gym_bridge.batched import BatchedDataDict
from gym_bridge.json_types import JsonObject
from gym_bridge.types import (
    DatumSpec,
    EnvironmentReturn,
    GenerationDatumSpec,
    GenerationOutputSpec,
    LLMMessageLogType,
    LogprobOutputSpec,
    PromptGroupRecord,
    ReferenceLogprobOutputSpec,
    TopkLogitsOutputSpec,
)

if TYPE_CHECKING:
    from ray import ObjectRef


def _not_implemented(obj: object, method: str) -> NotImplementedError:
    """The error an optional method raises where a class does not implement it: names the class and the method."""
    return NotImplementedError(f"{type(obj).__name__}.{method} is not implemented")


class GenerationInterface(abc.ABC):
    """A generation engine: batched ``generate`` and per-sample streaming ``generate_async``.

    Only ``generate`` is abstract: NeMo-RL HEAD's interface has no ``generate_async``, so an engine written to it
    can be instantiated and drives ``run_multi_turn_rollout``; the native async backend needs ``generate_async``.
    """

    @abc.abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate for a right-padded batch; see :class:`GenerationOutputSpec` for the output."""

    def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, single-row output)`` as each row of ``data`` finishes; must not block the event loop.

        Raises ``NotImplementedError`` naming the class unless overridden.
        """
        raise _not_implemented(self, "generate_async")

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int | None = None
    ) -> list[ObjectRef[Any]]:
        raise NotImplementedError(f"{type(self).__name__} does not join a weight-sync collective")

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engine; idempotent."""
        return True

    def finish_generation(self, *args: Any, release_gpu: bool = True, **kwargs: Any) -> bool:
        """Let the engine sleep; idempotent."""
        return True

    def shutdown(self) -> bool:
        """Release resources; safe to call more than once."""
        return True

    def get_logger_metrics(self) -> JsonObject:
        return {}

    def clear_logger_metrics(self) -> None:
        return None


class EnvironmentInterface[MetadataT](abc.ABC):
    """An environment, normally run as a Ray actor and called with ``.step.remote``.

    Generic in its metadata type as in HEAD (``EnvironmentInterface[MyMetadata]``); unsubscripted as documented.
    """

    @abc.abstractmethod
    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[MetadataT]
    ) -> EnvironmentReturn[MetadataT]:
        """Score one turn for a batch of role/content-only logs and their metadata."""

    @abc.abstractmethod
    def global_post_process_and_metrics(self, batch: BatchedDataDict[Any]) -> tuple[BatchedDataDict[Any], JsonObject]:
        """Post-process a finished batch and return it with environment metrics."""

    def shutdown(self) -> None:
        return None


class PolicyInterface(abc.ABC):
    """A trainable policy, as a training loop drives it.

    Abstract: what NeMo-RL's documented interface and NeMo-RL HEAD both require. HEAD's additions
    (``get_topk_logits``, ``calibrate_qkv_fp8_scales``) raise ``NotImplementedError`` naming the method
    unless overridden, so a policy written to either generation can be instantiated.
    """

    @abc.abstractmethod
    def get_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], timer: object = None
    ) -> BatchedDataDict[LogprobOutputSpec]:
        """``logprobs`` [B, S] of the token batch (``timer`` is HEAD's; the documented form omits it)."""

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], micro_batch_size: int | None = None, timer: object = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """``reference_logprobs`` [B, S] of the token batch under the reference policy."""

    @abc.abstractmethod
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: Any,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: object = None,
    ) -> JsonObject:
        """One optimisation step (no update when ``eval_mode``); returns metrics.

        ``gbs``/``mbs`` are keyword-only as in HEAD, so implementations of either generation (the documented one
        takes them positionally too) satisfy it; callers pass them by keyword, which both accept.
        """

    @abc.abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Ready the policy's weights and optimizer for a training step."""

    @abc.abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Release what a training step held."""

    @abc.abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Save the weights (and optimizer) where the arguments say."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Release resources; True when done."""

    def get_topk_logits(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        k: int,
        micro_batch_size: int | None = None,
        timer: object = None,
    ) -> BatchedDataDict[TopkLogitsOutputSpec]:
        """HEAD: top-``k`` logits and their token ids at each next-token position (distillation)."""
        raise _not_implemented(self, "get_topk_logits")

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, float]:
        """HEAD: FP8 scales for the KV cache, calibrated on ``data``."""
        raise _not_implemented(self, "calibrate_qkv_fp8_scales")


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that shares GPUs with generation and pushes weights to it.

    Abstract: the refit methods both generations require. The documented IPC refit (``prepare_weights_for_ipc``,
    ``get_weights_ipc_handles``) and HEAD's streaming refit (``stream_weights_via_ipc_zmq``,
    ``prepare_for_lp_inference``, ...) raise ``NotImplementedError`` naming the method unless overridden.
    ``init_collective`` takes HEAD's ``train_world_size`` as an optional keyword, and
    ``broadcast_weights_for_collective`` HEAD's arguments as optional ones, so both call forms type-check.
    """

    @abc.abstractmethod
    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int | None = None, nccl_peer: str = "nemo"
    ) -> list[ObjectRef[Any]]:
        """Join the weight-sync collective at ``ip:port``; returns the Ray futures of the join."""

    @abc.abstractmethod
    def offload_before_refit(self) -> None:
        """Free GPU memory (optimizer state) before the weights are sent."""

    @abc.abstractmethod
    def offload_after_refit(self) -> None:
        """Free GPU memory (the weights) after they were sent."""

    @abc.abstractmethod
    def prepare_refit_info(self) -> dict[str, Any] | None:
        """The weights' names, shapes and dtypes, for the generation side to prepare for a refit."""

    @abc.abstractmethod
    def broadcast_weights_for_collective(
        self,
        kv_scales: dict[str, float] | None = None,
        *,
        buffer_size_bytes: int | None = None,
        num_buffers: int | None = None,
    ) -> list[ObjectRef[Any]]:
        """Broadcast the weights over the collective; returns the Ray futures of the broadcast."""

    def prepare_weights_for_ipc(self, *args: Any, **kwargs: Any) -> object:
        """Documented interface: gather the weights' IPC metadata before a refit."""
        raise _not_implemented(self, "prepare_weights_for_ipc")

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Documented interface: the IPC handles of the named weights."""
        raise _not_implemented(self, "get_weights_ipc_handles")

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[ObjectRef[Any]]:
        """HEAD: stream the weights to colocated engines over ZMQ."""
        raise _not_implemented(self, "stream_weights_via_ipc_zmq")

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """HEAD: put the policy in eval mode for logprob inference."""
        raise _not_implemented(self, "prepare_for_lp_inference")

    def offload_to_cpu(self) -> None:
        """HEAD: move the policy off the GPU; a no-op unless overridden."""
        return None

    def stream_weights_via_http(self, rollout_engine_urls: list[str], buffer_size_bytes: int) -> list[ObjectRef[Any]]:
        """HEAD: stream the weights to colocated SGLang engines over HTTP."""
        raise _not_implemented(self, "stream_weights_via_http")

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        """HEAD: record the rollout engine's tensor-parallel size for ``stream_weights_via_http``."""
        raise _not_implemented(self, "set_rollout_num_gpus_per_engine")

    def prepare_nccl_reshard_refit_info(
        self,
        train_parallelism: dict[str, int],
        gen_parallelism: dict[str, int],
        train_world_size: int,
        gen_world_size: int,
    ) -> object:
        """HEAD: per-layer parameter metadata for an NCCL-reshard refit."""
        raise _not_implemented(self, "prepare_nccl_reshard_refit_info")

    def nccl_reshard_refit(self, kv_scales: dict[str, float] | None = None) -> list[ObjectRef[Any]]:
        """HEAD: send the weights to generation workers by NCCL reshard."""
        raise _not_implemented(self, "nccl_reshard_refit")


@runtime_checkable
class RolloutBackend(Protocol):
    """What a rollout backend instance does (entry-point group ``gym_bridge.rollout_backends``).

    The class is built by ``RolloutManager`` through ``from_context(context, options)``, with its ``Options``
    model validated first (:class:`gym_bridge.rollout.backend.BackendClass`, checked when the class is loaded).

    ``run_rollout`` rolls out one prompt and returns a complete group of
    ``num_generations_per_prompt`` completions in generation order, or raises a
    :mod:`gym_bridge.failures` error. It never returns a partial group.
    """

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord: ...
