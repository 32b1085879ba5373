"""Settings, per-row sampling and counters of :class:`~gym_bridge.generation.hf.HFGeneration`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import GenerationSamplingParams


class HFGenerationConfig(BaseModel):
    """Settings of :class:`HFGeneration`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("tiny", description='A local model folder, or a built-in model: "tiny", "smollm2".')
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_new_tokens: int = Field(256, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="None, 0 or -1 disable top-k.")
    stop_token_ids: list[int] | None = Field(None, description="None: the tokenizer's and the model's eos ids.")
    stop_strings: list[str] | None = None
    max_batch_size: int = Field(32, ge=1)
    max_model_len: int | None = Field(None, ge=1, description="None: the model's max_position_embeddings.")
    seed: int | None = Field(0, description="Seed of the sampling generator; None draws a random one.")
    batch_wait_s: float = Field(0.002, ge=0.0, description="How long the worker waits to coalesce requests.")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the worker thread that decodes for generate_async (no other thread's count "
        "changes). None: the process's, one per core unless OMP_NUM_THREADS says otherwise. 1 on a 2-core machine "
        "that other heavy work shares: there 2 threads stall each other (see hf_worker).",
    )
    shutdown_timeout_s: float = Field(30.0, gt=0.0)
    enable_prefix_caching: bool = Field(
        True, description="vLLM's automatic prefix caching: rows reuse the keys and values of a cached prompt prefix."
    )
    prefix_cache_block_size: int = Field(16, ge=1, description="Tokens per cached block (vLLM's block_size).")
    shared_prefix_attention: bool = Field(
        True,
        description="Decode steps attend once to a long prefix several rows hold as the same prefix-cache copy "
        "(cascade attention; CPU, SDPA models, with prefix caching). Equal to per-row attention up to float rounding.",
    )
    packed_linear: bool = Field(
        True,
        description="The engine's linear layers multiply by oneDNN-packed copies of their float32 CPU weights (a "
        "second copy in memory, packed again when a weight changes); equal to nn.Linear up to float rounding.",
    )
    prefix_cache_max_bytes: int = Field(
        1 << 30, ge=0, description="Bytes of cached keys and values kept; least recently used blocks go first."
    )

    @classmethod
    def from_generation_config(
        cls, gen_cfg: JsonMapping, *, validation: bool = False, **overrides: object
    ) -> HFGenerationConfig:
        """Build from a NeMo-RL style :class:`~gym_bridge.types.GenerationConfig` dict.

        ``model_name`` becomes ``model``; ``validation=True`` takes the ``val_*``
        sampling profile. ``overrides`` (e.g. ``device``, ``max_batch_size``) win.
        """
        sampling = GenerationSamplingParams.from_generation_config(gen_cfg, validation=validation)
        values: JsonObject = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        if gen_cfg.get("model_name"):
            values["model"] = gen_cfg["model_name"]
        for key in ("max_new_tokens", "stop_token_ids", "stop_strings"):
            if gen_cfg.get(key) is not None:
                values[key] = gen_cfg[key]
        values.update(overrides)
        return cls.model_validate(values)


@dataclass
class HFGenerationStats:
    """Counters (reset by :meth:`HFGeneration.clear_logger_metrics`)."""

    batches_run: int = 0  # decode batches started from empty, both paths
    async_batches_run: int = 0  # of those, batches run by the worker for generate_async
    rows_joined_running_batch: int = 0  # rows admitted into a worker batch that was already decoding
    rows_generated: int = 0
    tokens_generated: int = 0
    forward_passes: int = 0
    max_rows_in_batch: int = 0
    weight_updates: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose keys and values came from the cache
    cascade_steps: int = 0  # decode steps whose rows attended a shared prefix once (cascade_attention)


@dataclass(frozen=True)
class RowCounts:
    """Rows of :meth:`HFGeneration.generate_async` now: decoding in the running batch, and queued for it
    (vLLM's ``num_requests_running`` / ``num_requests_waiting``, one row per request choice)."""

    running: int
    waiting: int


@dataclass(frozen=True)
class RowSampling:
    """The sampling of one row: the engine's config unless the batch overrides it per row.

    ``seed`` (vLLM's per-request ``seed``): the row draws from its own generator seeded with it, so its
    tokens do not depend on the rows it shares a decode batch with; None draws from the engine's generator.
    """

    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


#: Optional per-row keys of a generation batch that override the config's sampling for that row
#: (a list with one value per row; None in a slot means "use the config"; for ``seed``: unseeded).
PER_ROW_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
