"""The GPU-only keys of NeMo-RL's Gym recipes (:data:`GPU_KEYS`): what each asks of NeMo-RL's GPU workers, the values
that ask for nothing, and what ``--smoke`` turns it to; :func:`gpu_only_keys` lists those a CPU run ignores."""

from __future__ import annotations

from dataclasses import dataclass

from gym_bridge.config.keys import config_value
from gym_bridge.config.smoke_table import ABSENT, IgnoredKey
from gym_bridge.json_types import JsonMapping


@dataclass(frozen=True)
class GpuKey:
    """A key that asks for something only NeMo-RL's GPU workers do.

    ``inert``: the values that ask for nothing (not listed). ``off``: what ``--smoke`` sets it to (:data:`ABSENT`:
    nothing to set, so it is listed as ignored). ``refused``: gym-bridge refuses an active value when it reads the
    config, so without ``--smoke`` it is not listed as ignored."""

    key: str
    why: str
    inert: tuple[object, ...] = (None,)
    off: object = ABSENT
    refused: bool = False


GPU_KEYS: tuple[GpuKey, ...] = (
    GpuKey(
        "policy.megatron_cfg.enabled",
        "Megatron-Core training workers (refused by gym-bridge: HFPolicy trains in one process)",
        (False, None),
        False,
        refused=True,
    ),
    GpuKey(
        "policy.dtensor_cfg.enabled",
        "DTensor (FSDP2) training workers; HFPolicy trains in one process",
        (False, None),
        False,
    ),
    GpuKey(
        "policy.precision",
        "the GPU workers' dtype; HFPolicy trains in float32 on the CPU",
        ("float32", None),
        "float32",
    ),
    GpuKey(
        "policy.generation.vllm_cfg.precision",
        "vLLM's dtype; the engine (HFGeneration) generates in float32 on the CPU",
        ("float32", None),
        "float32",
    ),
    GpuKey(
        "policy.generation.colocated.enabled",
        "generation on the training GPUs; here the engine is its own HFGeneration in this process",
        (False, None),
        False,
    ),
    GpuKey("policy.generation.vllm_cfg.tensor_parallel_size", "vLLM's GPUs per replica", (1, None), 1),
    GpuKey("policy.generation.vllm_cfg.pipeline_parallel_size", "vLLM's pipeline stages", (1, None), 1),
    GpuKey("policy.generation.vllm_cfg.expert_parallel_size", "vLLM's expert-parallel GPUs", (1, None), 1),
    GpuKey("policy.sequence_packing.enabled", "packs sequences for GPU throughput", (False, None), False),
    GpuKey("policy.dynamic_batching.enabled", "packs micro-batches by tokens for GPU throughput", (False, None), False),
    GpuKey("cluster.gpus_per_node", "the Ray cluster's GPUs; the run is one process and a local Ray", (0, None), 0),
    GpuKey("cluster.num_nodes", "the Ray cluster's nodes; the run is one process and a local Ray", (1, None), 1),
    GpuKey("logger.monitor_gpus", "NeMo-RL's GPU monitoring (Prometheus scrapes of GPU nodes)", (False, None), False),
    GpuKey(
        "grpo.calculate_advantages_on_gpu", "where advantages are computed, not what they are", (False, None), False
    ),
    GpuKey("policy.generation.vllm_cfg.gpu_memory_utilization", "vLLM's share of GPU memory"),
    GpuKey("policy.generation.vllm_cfg.kv_cache_dtype", "vLLM's KV-cache dtype", ("auto", None)),
    GpuKey("policy.generation.vllm_cfg.use_deep_gemm", "DeepGEMM FP8 kernels", (False, None)),
    GpuKey("policy.generation.vllm_cfg.num_last_layers_in_bf16", "vLLM FP8 layer exceptions", (0, None)),
    GpuKey("policy.generation.vllm_cfg.num_first_layers_in_bf16", "vLLM FP8 layer exceptions", (0, None)),
    GpuKey(
        "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser",
        "vLLM's tool-call parser; gym-bridge's server parses Hermes <tool_call> blocks (the built-in models' template)",
        ("hermes", None),
    ),
    GpuKey(
        "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser",
        "vLLM's reasoning parser; gym-bridge's server parses <think> blocks",
    ),
    GpuKey("policy.generation.vllm_cfg.tool_parser_plugin", "a vLLM tool-parser plugin file"),
    GpuKey("policy.generation.vllm_cfg.reasoning_parser_plugin", "a vLLM reasoning-parser plugin file"),
    GpuKey(
        "policy.generation.vllm_kwargs.compilation_config", "vLLM's torch.compile and CUDA-graph settings", (None, {})
    ),
    GpuKey("policy.generation.vllm_kwargs.mamba_ssm_cache_dtype", "vLLM's Mamba state dtype (Nemotron-H models)"),
    GpuKey("policy.logprob_chunk_size", "chunks the vocabulary in the logprob kernel to save GPU memory"),
    GpuKey("policy.refit_buffer_size_gb", "the GPU buffer that carries weights to vLLM"),
    GpuKey("policy.offload_optimizer_for_logprob", "moves optimizer state off the GPU", (False, None)),
)
"""The GPU-only keys of NeMo-RL's Gym recipes that a smoke run turns off or a CPU run ignores."""


def is_active(spec: GpuKey, value: object) -> bool:
    return value is not ABSENT and not any(value == inert and type(value) is type(inert) for inert in spec.inert)


def gpu_only_keys(config: JsonMapping) -> list[IgnoredKey]:
    """The GPU-only keys ``config`` sets to a value that asks for something (:data:`GPU_KEYS`) and that a CPU run
    ignores: what a run without ``--smoke`` names once. Keys gym-bridge refuses when set are not listed here."""
    return [
        IgnoredKey(spec.key, config_value(config, spec.key, ABSENT), spec.why)
        for spec in GPU_KEYS
        if not spec.refused and is_active(spec, config_value(config, spec.key, ABSENT))
    ]
