"""Abstract interfaces: generation, environments, policies, and the rollout-backend hook.

A rollout backend is found through the ``gym_bridge.rollout_backends`` entry-point
group and must satisfy :class:`RolloutBackend`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from gym_bridge.batched import BatchedDataDict
from gym_bridge.types import (
    DatumSpec,
    EnvironmentReturn,
    GenerationDatumSpec,
    GenerationOutputSpec,
    LLMMessageLogType,
    PromptGroupRecord,
)


class GenerationInterface(abc.ABC):
    """A generation engine: batched ``generate`` and per-sample streaming ``generate_async``."""

    @abc.abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate for a right-padded batch; see :class:`GenerationOutputSpec` for the output."""

    @abc.abstractmethod
    def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, single-row output)`` as each row of ``data`` finishes.

        Must not block the event loop.
        """

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int | None = None) -> list[Any]:
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

    def get_logger_metrics(self) -> dict[str, Any]:
        return {}

    def clear_logger_metrics(self) -> None:
        return None


class EnvironmentInterface(abc.ABC):
    """An environment, normally run as a Ray actor and called with ``.step.remote``."""

    @abc.abstractmethod
    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[Any]) -> EnvironmentReturn:
        """Score one turn for a batch of role/content-only logs and their metadata."""

    @abc.abstractmethod
    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """Post-process a finished batch and return it with environment metrics."""

    def shutdown(self) -> None:
        return None


class PolicyInterface(abc.ABC):
    """A trainable policy, as a training loop drives it.

    Abstract: what NeMo-RL's documented interface and NeMo-RL HEAD both require. HEAD's additions
    (``get_topk_logits``, ``calibrate_qkv_fp8_scales``) and the documented interface's methods HEAD
    dropped are optional: the default raises ``NotImplementedError`` naming the method, so a policy
    written to either generation can be instantiated.
    """

    @abc.abstractmethod
    def get_logprobs(self, data: BatchedDataDict[Any], timer: Any = None) -> BatchedDataDict[Any]:
        """Return ``{"logprobs": Tensor}`` for the token batch (:class:`LogprobOutputSpec`)."""

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """Return ``{"reference_logprobs": Tensor}`` (:class:`ReferenceLogprobOutputSpec`)."""

    @abc.abstractmethod
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: Any,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
    ) -> dict[str, Any]:
        """One optimisation step (no update when ``eval_mode``); returns metrics. ``gbs``/``mbs`` are HEAD's
        keyword-only arguments; callers here always pass them by keyword, so a policy written to the documented
        interface (positional ``gbs``/``mbs``) is called correctly too."""

    @abc.abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> bool: ...

    def get_topk_logits(
        self, data: BatchedDataDict[Any], k: int, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """HEAD: ``{"topk_logits", "topk_indices"}`` aligned to next-token positions (distillation)."""
        raise NotImplementedError(f"{type(self).__name__}.get_topk_logits is not implemented")

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[Any],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        """HEAD: FP8 KV scales calibrated on ``data``."""
        raise NotImplementedError(f"{type(self).__name__}.calibrate_qkv_fp8_scales is not implemented")


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that shares GPUs with generation and pushes weights to it.

    Abstract: the refit methods both generations require. HEAD's weight streaming
    (``stream_weights_via_ipc_zmq``, ``prepare_for_lp_inference``, ...) and the documented IPC methods
    (``prepare_weights_for_ipc``, ``get_weights_ipc_handles``) default to ``NotImplementedError`` naming
    themselves; ``init_collective`` takes HEAD's ``train_world_size`` as an optional keyword.
    """

    @abc.abstractmethod
    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int | None = None, nccl_peer: str = "nemo"
    ) -> list[Any]: ...

    @abc.abstractmethod
    def offload_before_refit(self) -> None: ...

    @abc.abstractmethod
    def offload_after_refit(self) -> None: ...

    @abc.abstractmethod
    def prepare_refit_info(self) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def broadcast_weights_for_collective(
        self,
        kv_scales: dict[str, Any] | None = None,
        *,
        buffer_size_bytes: int | None = None,
        num_buffers: int | None = None,
    ) -> list[Any]: ...

    def prepare_weights_for_ipc(self, *args: Any, **kwargs: Any) -> Any:
        """Documented interface: gather the weights' IPC metadata before a refit."""
        raise NotImplementedError(f"{type(self).__name__}.prepare_weights_for_ipc is not implemented")

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Documented interface: the IPC handles of the named weights."""
        raise NotImplementedError(f"{type(self).__name__}.get_weights_ipc_handles is not implemented")

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int, kv_scales: dict[str, Any] | None = None) -> list[Any]:
        """HEAD: stream the weights to colocated engines over ZMQ."""
        raise NotImplementedError(f"{type(self).__name__}.stream_weights_via_ipc_zmq is not implemented")

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """HEAD: get ready for logprob inference."""
        raise NotImplementedError(f"{type(self).__name__}.prepare_for_lp_inference is not implemented")

    def offload_to_cpu(self) -> None:
        return None

    def stream_weights_via_http(self, urls: list[str], buffer_size_bytes: int) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} cannot stream weights over HTTP")

    def set_rollout_num_gpus_per_engine(self, n: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not set GPUs per engine")

    def prepare_nccl_reshard_refit_info(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not support NCCL reshard refit")

    def nccl_reshard_refit(self, kv_scales: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not support NCCL reshard refit")


@runtime_checkable
class RolloutBackend(Protocol):
    """The hook contract for a rollout backend (entry-point group ``gym_bridge.rollout_backends``).

    ``RolloutManager`` constructs the class with keyword arguments: of the common ones
    (``tokenizer``, ``task_to_env``, ``num_generations_per_prompt``, ``max_seq_len``,
    ``max_rollout_turns``, ``policy_generation``, ``generation_config``,
    ``mask_env_flagged_samples``, ``timeouts``, ``retry_policy``, ``stats``) those its
    ``__init__`` declares, plus every extra keyword the caller passed, each of which the
    backend must declare (else ``TypeError`` naming it). A backend taking ``**kwargs``
    receives them all.

    ``run_rollout`` rolls out one prompt and returns a complete group of
    ``num_generations_per_prompt`` completions in generation order, or raises a
    :mod:`gym_bridge.failures` error. It never returns a partial group.
    """

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord: ...
