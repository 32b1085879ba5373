"""A :class:`GenerationInterface` over any local transformers causal LM (CPU or GPU).

Decoding is our own loop over the model's KV cache (not ``model.generate``), so the
reported logprobs come from the raw logits of the distribution that was actually
sampled from. Semantics, row by row:

- **Logprobs.** ``logprob(token) = log_softmax(raw_logits / T)[token]`` where ``T`` is
  the configured temperature for sampling and ``T = 1`` for greedy decoding (also
  when ``temperature == 0``, which means greedy). ``top_k`` / ``top_p`` only restrict
  which tokens *can be sampled* (top-k first, then top-p, over the ``raw_logits / T``
  distribution); they never change the reported logprob, which is always taken
  from the unrestricted distribution. This is vLLM's ``logprobs_mode="raw_logprobs"``
  with the temperature applied — the value a trainer recomputes with one forward
  pass and ``log_softmax(logits / T)``.
- **Stop token ids** (``cfg.stop_token_ids``; ``None`` means the tokenizer's eos plus
  the model's ``generation_config.eos_token_id``): the stop token is part of the output.
- **Stop strings** (``cfg.stop_strings`` merged with the row's ``stop_strings``): a row
  stops as soon as its generated text, decoded with ``skip_special_tokens=False``,
  contains one of them. Every token up to and including the one that completed the
  stop string is kept (vLLM with ``include_stop_str_in_output=True``, at token
  granularity: the last token may carry text past the stop string).
- **Caps.** A row generates at most ``min(max_new_tokens, max_model_len - input_len)``
  tokens. ``truncated`` is True when a row reached its cap without a stop token or
  stop string; this includes a row whose input already fills ``max_model_len`` (or
  ``max_new_tokens == 0``): it returns zero generated tokens with ``truncated=True``.
- **Layout.** ``output_ids`` [B, S + max generated] holds each row's unpadded input,
  then its generated tokens, then the pad id; ``logprobs`` has the same shape, zero
  on prompt and padding positions. Single-row outputs of :meth:`generate_async`
  use ``S + generated`` for that row (``S`` = the width of the input batch).
- **Sampling.** A row with a ``seed`` draws from its own ``torch.Generator`` (on the
  engine's device, ``manual_seed(seed)``), as vLLM does for a request's ``seed``: the
  same seed, prompt and weights give the same tokens whichever rows share its decode
  batch and in whatever order rows arrive (up to float rounding of the batched
  forward pass, which decides a draw only at a near-tie). Unseeded rows draw from one
  ``torch.Generator`` per engine, seeded from ``cfg.seed``: the same seed and the same
  sequence of calls give the same samples, but rows drawn in one batch share the
  generator stream, so batch composition matters.

Per-row sampling: a batch may carry lists under ``temperature``, ``top_p``, ``top_k``,
``max_new_tokens`` and ``seed`` (one value per row, None = the config's, or unseeded),
so that requests with different sampling share one decode batch. A row with temperature 0
is greedy.

Batching: :meth:`generate` runs in the calling thread, ``max_batch_size`` rows at a
time. :meth:`generate_async` never runs the model on the event loop: every row is
queued for one worker thread, which decodes continuously. Rows that arrive while a
batch decodes join it at the next step (prefilled, their KV cache stacked onto the
batch's, up to ``max_batch_size`` rows); rows that finish leave at once and are
handed back through ``loop.call_soon_threadsafe``. When the worker is idle, it waits
``batch_wait_s`` after the first row so that concurrent requests start together.
Both paths share one lock per decode step, so the model never runs on two threads at once.
The decode loop itself is :mod:`gym_bridge.generation.hf_decode`. ``num_threads`` gives the worker thread a torch
thread count of its own (default: the process's), leaving every other thread's as it was
(:mod:`gym_bridge.generation.hf_worker` says when fewer threads pay).

Prefix caching (``enable_prefix_caching``, on by default, as in vLLM): the keys and values of
every full ``prefix_cache_block_size``-token block of a row's prompt and output are kept
(:mod:`gym_bridge.generation.prefix_cache`), and a row whose prompt starts with cached blocks
prefills only the rest. The N samples of one prompt, a shared few-shot header or tool preamble and
the earlier turns of a multi-turn rollout are computed once. A row's tokens and logprobs are those
it gets without the cache, up to the float rounding of a forward pass over a different number of
positions (``tests/generation/test_prefix_cache.py`` measures it). A refit empties the cache. With
``shared_prefix_attention`` (on by default; CPU, SDPA models), the decode steps of rows that hold one
cached copy of a long prefix attend to it once, together (:mod:`gym_bridge.generation.cascade_attention`).
With ``packed_linear`` (on by default; float32 CPU weights, a torch with oneDNN), the engine's forward passes
multiply by oneDNN-packed copies of the linear weights (:mod:`gym_bridge.generation.packed_linear`).

Weight refit: :meth:`HFGeneration.update_weights` stops the worker admitting rows,
lets the rows in flight finish on the old weights, loads the new ones in place, empties the
prefix cache and resumes: every row is generated by one set of weights, and its output says which
(``weight_version``, one int64 per row).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import EngineShutDownError
from gym_bridge.failures.errors import SettingError
from gym_bridge.generation import cascade_attention
from gym_bridge.generation.batch import assemble_output
from gym_bridge.generation.decode_row import DecodeContext, Row, RowResult
from gym_bridge.generation.hf_config import HFGenerationConfig, HFGenerationStats, RowCounts
from gym_bridge.generation.hf_decode import RunningBatch, decode_to_end
from gym_bridge.generation.hf_rows import first_id, rows_from_batch
from gym_bridge.generation.hf_worker import (
    STOP,
    WAKE,
    WorkItem,
    fail_queued,
    make_deliver,
    publish_counts,
    start_worker,
)
from gym_bridge.generation.packed_linear import PackedLinears
from gym_bridge.generation.prefix_cache import PrefixCache, PrefixCacheCounts
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonMapping
from gym_bridge.models.fingerprint import weight_fingerprint
from gym_bridge.models.loading import causal_lm_on_device
from gym_bridge.types import GenerationDatumSpec, GenerationOutputSpec, Tokenizer

logger = logging.getLogger(__name__)


class HFGeneration(GenerationInterface):
    """Generation with a local transformers causal LM; see the module docstring for semantics."""

    #: Rows may carry their own temperature / top_p / top_k / max_new_tokens / seed (PER_ROW_SAMPLING_KEYS).
    supports_per_request_sampling = True

    def __init__(
        self,
        cfg: HFGenerationConfig | JsonMapping | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """Load ``cfg.model`` (a folder or a built-in name), or use an already loaded ``model`` + ``tokenizer``.

        A given model is moved to ``cfg.device`` and put in eval mode; its dtype is kept.
        """
        if cfg is None:
            cfg = HFGenerationConfig()
        elif not isinstance(cfg, HFGenerationConfig):
            cfg = HFGenerationConfig(**dict(cfg))
        self.cfg: HFGenerationConfig = cfg
        self.tokenizer, self.model = causal_lm_on_device(
            cfg.model, cfg.dtype, cfg.device, model=model, tokenizer=tokenizer
        )
        self.device = torch.device(cfg.device)
        text_config = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        limit = cfg.max_model_len  # None: the model's own limit
        self.max_model_len: int = (
            int(getattr(text_config, "max_position_embeddings", 2**31 - 1)) if limit is None else limit
        )
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.pad_token_id: int = first_id(
            self.tokenizer.pad_token_id,
            self.tokenizer.eos_token_id,
            getattr(text_config, "pad_token_id", None),
            default=0,
        )
        self.stop_token_ids: frozenset[int] = self._stop_ids()
        self._generator = torch.Generator(device=self.device)
        if cfg.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(cfg.seed)

        self.stats = HFGenerationStats()
        self._prefix_cache = self._build_prefix_cache()
        self._weight_version = 0
        self._model_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._refit_lock = threading.Lock()
        self._pause = threading.Event()  # set: the worker admits no rows (a refit is waiting)
        self._drained = threading.Event()  # set by the worker: paused with no row in flight
        self._queue: queue.SimpleQueue[WorkItem] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._rows_running = 0  # written by the worker thread (hf_worker.publish_counts)
        self._rows_pending = 0
        self._ctx = self._decode_context()

    def _stop_ids(self) -> frozenset[int]:
        """``cfg.stop_token_ids``, else the tokenizer's EOS ids and the model's generation-config EOS ids."""
        if self.cfg.stop_token_ids is not None:
            stop_ids = set(self.cfg.stop_token_ids)
        else:
            stop_ids = set()
            gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            for ids in (self.tokenizer.eos_token_id, gen_eos):
                if ids is None:
                    continue
                stop_ids.update([ids] if isinstance(ids, int) else ids)
        return frozenset(int(i) for i in stop_ids)

    # ------------------------------------------------------------------ engine optimisations

    def _decode_context(self) -> DecodeContext:
        """What the decode loop reads: the model and how rows stop, then each engine optimisation from its own
        builder below (a new optimisation is a :class:`DecodeContext` field and a builder here)."""
        return DecodeContext(
            model=self.model,
            tokenizer=self.tokenizer,
            device=self.device,
            pad_token_id=self.pad_token_id,
            stop_token_ids=self.stop_token_ids,
            max_model_len=self.max_model_len,
            generator=self._generator,
            stats=self.stats,
            logits_to_keep=self._last_logits_only(),
            is_closed=lambda: self._closed,
            prefix_cache=self._prefix_cache,
            growing_kv_cache=self._growing_kv_cache(),
            shared_prefix=self._cascade_attention(),
            packed=self._packed_linears(),
        )

    def _last_logits_only(self) -> bool:
        """Whether the model's forward takes ``logits_to_keep``, so a prefill computes the last position's logits."""
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _build_prefix_cache(self) -> PrefixCache | None:
        """vLLM's automatic prefix caching (``enable_prefix_caching``, :mod:`gym_bridge.generation.prefix_cache`)."""
        cfg = self.cfg
        if not cfg.enable_prefix_caching:
            return None
        return PrefixCache(cfg.prefix_cache_block_size, cfg.prefix_cache_max_bytes)

    def _growing_kv_cache(self) -> bool:
        """The KV cache that appends in place (:mod:`gym_bridge.generation.kv_cache`); always on in the engine."""
        return True

    def _cascade_attention(self) -> bool:
        """Decode steps that attend to a prefix several rows hold once (``shared_prefix_attention``, CPU, SDPA
        models, over the prefix cache's blocks: :mod:`gym_bridge.generation.cascade_attention`)."""
        return (
            self.cfg.shared_prefix_attention
            and self._prefix_cache is not None
            and self.device.type == "cpu"
            and cascade_attention.enable(self.model)
        )

    def _packed_linears(self) -> PackedLinears | None:
        """The linear weights packed by oneDNN (``packed_linear``; :mod:`~gym_bridge.generation.packed_linear`)."""
        return PackedLinears.for_model(self.model) if self.cfg.packed_linear else None

    # ------------------------------------------------------------------ public API

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate for a right-padded batch in the calling thread (blocking)."""
        self._check_open()
        input_ids, lengths, rows = self._rows_from_batch(data, greedy)
        results: list[RowResult] = []
        step = self.cfg.max_batch_size
        for start in range(0, len(rows), step):
            with self._model_lock, torch.inference_mode():
                self.stats.batches_run += 1
                chunk = decode_to_end(self._ctx, rows[start : start + step], self._weight_version)
            results.extend(r for r in chunk if r is not None)
        return _with_versions(assemble_output(input_ids, lengths, results, self.pad_token_id), results)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, single-row output)`` as rows finish; the model runs on the worker thread.

        Cancelling (or closing) the iteration withdraws the rows not yet delivered:
        queued ones are skipped and running ones are dropped from their batch.
        """
        self._check_open()
        input_ids, lengths, rows = self._rows_from_batch(data, greedy)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[RowResult]] = [loop.create_future() for _ in rows]
        for row, fut in zip(rows, futures, strict=True):
            row.deliver = make_deliver(loop, fut)
        self._ensure_worker()
        for row in rows:
            self._queue.put(row)
        pending = {fut: i for i, fut in enumerate(futures)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    i = pending.pop(fut)
                    result = fut.result()
                    out = assemble_output(input_ids[i : i + 1], lengths[i : i + 1], [result], self.pad_token_id)
                    yield i, _with_versions(out, [result])
        finally:
            for row in rows:
                row.cancelled = True
            for fut in pending:
                fut.cancel()

    @property
    def weight_version(self) -> int:
        """The version of the weights that rows started from now on are generated with."""
        return self._weight_version

    def weight_fingerprint(self) -> dict[str, torch.Tensor]:
        """:func:`~gym_bridge.models.fingerprint.weight_fingerprint` of the weights rows start on now."""
        with self._model_lock:
            return weight_fingerprint(self.model.state_dict())

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, strict: bool = True, timeout_s: float = 600.0
    ) -> None:
        """Load ``state_dict`` into the model in place and call these weights ``version``; blocks until done.

        The worker stops admitting rows, the rows in flight finish on the old weights
        (at most ``timeout_s``), the weights are copied in (cast to the model's dtype
        and device, so the caller may go on training its own tensors), and rows
        waiting meanwhile start on the new ones. ``strict`` as in ``load_state_dict``.
        ``version`` may not go backwards (the same version re-syncs).
        """
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SettingError(f"version must be a non-negative int, got {version!r}")
        with self._refit_lock:
            if version < self._weight_version:
                raise SettingError(f"version {version} is older than the engine's weights ({self._weight_version})")
            self._drained.clear()
            self._pause.set()
            try:
                if self._worker is not None and self._worker.is_alive():
                    self._queue.put(WAKE)
                    if not self._drained.wait(timeout_s):
                        raise TimeoutError(f"rows in flight did not finish within {timeout_s} s; weights unchanged")
                with self._model_lock, torch.no_grad():
                    result = self.model.load_state_dict(dict(state_dict), strict=strict)
                    if not strict and result.unexpected_keys:
                        raise SettingError(f"update_weights got unknown parameters: {result.unexpected_keys[:5]}")
                    if self._prefix_cache is not None:
                        self._prefix_cache.clear()
                    self._weight_version = version
                    self.stats.weight_updates += 1
            finally:
                self._pause.clear()
                self._queue.put(WAKE)
        logger.info("HFGeneration weights updated to version %d", version)

    def invalidate_kv_cache(self) -> bool:
        """NeMo-RL's hook after a refit: rows drain and the prefix cache is emptied at every refit already."""
        return True

    def prefix_cache_counts(self) -> PrefixCacheCounts:
        """Prompt tokens looked up in the prefix cache and found there since the engine started (zeros when off)."""
        cache = self._prefix_cache
        return cache.counts() if cache is not None else PrefixCacheCounts(0, 0)

    def request_counts(self) -> RowCounts:
        """Rows of :meth:`generate_async` decoding now and rows waiting for a place in the batch (queued, or held
        by a refit): vLLM's ``num_requests_running`` / ``num_requests_waiting``. Cheap and safe from any thread;
        at most one decode step old."""
        queued = self._queue.qsize()  # rows submitted since the worker last took from the queue (and signals)
        return RowCounts(running=self._rows_running, waiting=self._rows_pending + queued)

    def shutdown(self) -> bool:
        """Stop the worker thread (bounded join) and fail requests still queued; idempotent."""
        with self._start_lock:
            if self._closed:
                return True
            self._closed = True
            worker = self._worker
        if worker is not None:
            self._queue.put(STOP)
            worker.join(timeout=self.cfg.shutdown_timeout_s)
            if worker.is_alive():
                logger.warning("HFGeneration worker did not stop within %.1f s", self.cfg.shutdown_timeout_s)
        fail_queued(self._queue, EngineShutDownError("HFGeneration was shut down"))
        return True

    def get_logger_metrics(self) -> dict[str, int]:
        return {f"hf_generation/{k}": v for k, v in asdict(self.stats).items()}

    def clear_logger_metrics(self) -> None:
        self.stats = HFGenerationStats()
        self._ctx.stats = self.stats

    # ------------------------------------------------------------------ input

    def _check_open(self) -> None:
        if self._closed:
            raise EngineShutDownError("HFGeneration was shut down")

    def _rows_from_batch(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[Row]]:
        return rows_from_batch(data, greedy, self.cfg, vocab_size=self.vocab_size, device=self.device)

    # ------------------------------------------------------------------ worker thread

    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._closed:
                raise EngineShutDownError("HFGeneration was shut down")
            if self._worker is not None:
                return
            self._worker = start_worker(weakref.ref(self), self._queue, self.cfg.num_threads)
            # If the engine is dropped without shutdown(), stop the thread anyway.
            weakref.finalize(self, self._queue.put, STOP)

    def _admit_and_step(self, batch: RunningBatch | None, pending: list[Row]) -> RunningBatch | None:
        """One turn of the worker: admit what fits (unless a refit waits), then one decode step.

        On a failure every row of the batch and every joining row gets the exception
        before it propagates, so no waiter is left hanging (the batch may be new here).
        """
        joining: list[Row] = []
        try:
            if not self._pause.is_set() and pending:
                free = self.cfg.max_batch_size - (len(batch) if batch is not None else 0)
                joining, pending[:] = pending[:free], pending[free:]
                publish_counts(self, batch, pending, joining)
                if joining:
                    with self._model_lock, torch.inference_mode():
                        if batch is None:
                            batch = RunningBatch(self._ctx, self._weight_version)
                            self.stats.batches_run += 1
                            self.stats.async_batches_run += 1
                        elif len(batch):
                            self.stats.rows_joined_running_batch += len(joining)
                        batch.admit(joining)
            if batch is not None and len(batch):
                with self._model_lock, torch.inference_mode():
                    batch.step()
        except Exception as exc:
            for row in (batch.rows if batch is not None else []) + joining:
                if row.deliver is not None and not row.cancelled:
                    row.deliver(exc)  # a row already resolved ignores a second delivery
            raise
        if batch is not None and not len(batch):
            batch = None
        return batch


def _with_versions(
    out: BatchedDataDict[GenerationOutputSpec], results: Sequence[RowResult]
) -> BatchedDataDict[GenerationOutputSpec]:
    """``out`` with each row's ``weight_version`` (int64), the weights that generated it."""
    out["weight_version"] = torch.tensor([r.weight_version for r in results], dtype=torch.int64)
    return out
