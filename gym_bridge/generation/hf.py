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
- **Sampling** draws from one ``torch.Generator`` per engine, seeded from ``cfg.seed``:
  the same seed and the same sequence of calls give the same samples. (Batch
  composition matters: rows drawn in one batch share the generator stream.)

Per-row sampling: a batch may carry lists under ``temperature``, ``top_p``, ``top_k``
and ``max_new_tokens`` (one value per row, None = the config's), so that requests
with different sampling share one decode batch. A row with temperature 0 is greedy.

Batching: :meth:`generate` runs in the calling thread, ``max_batch_size`` rows at a
time. :meth:`generate_async` never runs the model on the event loop: every row is
queued for one worker thread, which takes everything pending (after a short
coalescing wait, ``batch_wait_s``), groups it by the greedy flag, runs up to
``max_batch_size`` rows as one batch, and hands each row back through
``loop.call_soon_threadsafe`` the moment that row finishes. Rows that finish early
are dropped from the batch (and its KV cache), so they cost nothing further. Rows
arriving while a batch runs wait for the next batch (no continuous batching).
Both paths share one lock, so the model never runs on two threads at once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.batch import assemble_output, check_input
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.models.loading import causal_lm_on_device
from gym_bridge.types import (
    GenerationDatumSpec,
    GenerationOutputSpec,
    GenerationSamplingParams,
)

logger = logging.getLogger(__name__)



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
    shutdown_timeout_s: float = Field(30.0, gt=0.0)

    @classmethod
    def from_generation_config(
        cls, gen_cfg: Mapping[str, Any], *, validation: bool = False, **overrides: Any
    ) -> HFGenerationConfig:
        """Build from a NeMo-RL style :class:`~gym_bridge.types.GenerationConfig` dict.

        ``model_name`` becomes ``model``; ``validation=True`` takes the ``val_*``
        sampling profile. ``overrides`` (e.g. ``device``, ``max_batch_size``) win.
        """
        sampling = GenerationSamplingParams.from_generation_config(gen_cfg, validation=validation)  # type: ignore[arg-type]
        values: dict[str, Any] = {
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
        return cls(**values)


@dataclass
class HFGenerationStats:
    """Counters (reset by :meth:`HFGeneration.clear_logger_metrics`)."""

    batches_run: int = 0  # decode batches, both paths
    async_batches_run: int = 0  # decode batches run by the worker for generate_async
    rows_generated: int = 0
    tokens_generated: int = 0
    forward_passes: int = 0
    max_rows_in_batch: int = 0


@dataclass
class _RowResult:
    tokens: list[int]
    logprobs: list[float]
    truncated: bool


@dataclass(frozen=True)
class RowSampling:
    """The sampling of one row: the engine's config unless the batch overrides it per row."""

    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)
class _Row:
    """One row to decode; ``deliver`` (worker path) receives a _RowResult or an exception."""

    prompt: list[int]
    stop_strings: tuple[str, ...]
    greedy: bool
    sampling: RowSampling
    deliver: Callable[[_RowResult | BaseException], None] | None = None
    cancelled: bool = False


_STOP = object()

#: Optional per-row keys of a generation batch that override the config's sampling for that row
#: (a list with one value per row; None in a slot means "use the config").
PER_ROW_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


class EngineShutDownError(RuntimeError):
    """The engine was shut down before (or while) this request ran."""


class HFGeneration(GenerationInterface):
    """Generation with a local transformers causal LM; see the module docstring for semantics."""

    #: Rows may carry their own temperature / top_p / top_k / max_new_tokens (PER_ROW_SAMPLING_KEYS).
    supports_per_request_sampling = True

    def __init__(
        self,
        cfg: HFGenerationConfig | Mapping[str, Any] | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        """Load ``cfg.model`` (a folder or a built-in name), or use an already loaded ``model`` + ``tokenizer``.

        A given model is moved to ``cfg.device`` and put in eval mode; its dtype is kept.
        """
        if cfg is None:
            cfg = HFGenerationConfig()
        elif not isinstance(cfg, HFGenerationConfig):
            cfg = HFGenerationConfig(**dict(cfg))
        self.cfg: HFGenerationConfig = cfg
        tokenizer, model = causal_lm_on_device(cfg.model, cfg.dtype, cfg.device, model=model, tokenizer=tokenizer)
        self.tokenizer, self.model = tokenizer, model
        self.device = torch.device(cfg.device)

        text_config = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        self.max_model_len: int = int(cfg.max_model_len or getattr(text_config, "max_position_embeddings", 2**31 - 1))
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.pad_token_id: int = _first_id(
            tokenizer.pad_token_id, tokenizer.eos_token_id, getattr(text_config, "pad_token_id", None), default=0
        )
        if cfg.stop_token_ids is not None:
            stop_ids = set(cfg.stop_token_ids)
        else:
            stop_ids = set()
            gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            for ids in (tokenizer.eos_token_id, gen_eos):
                if ids is None:
                    continue
                stop_ids.update([ids] if isinstance(ids, int) else ids)
        self.stop_token_ids: frozenset[int] = frozenset(int(i) for i in stop_ids)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

        self._generator = torch.Generator(device=self.device)
        if cfg.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(cfg.seed)

        self.stats = HFGenerationStats()
        self._model_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ public API

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate for a right-padded batch in the calling thread (blocking)."""
        self._check_open()
        input_ids, lengths, rows = self._rows_from_batch(data, greedy)
        results: list[_RowResult] = []
        step = self.cfg.max_batch_size
        for start in range(0, len(rows), step):
            results.extend(self._run_batch(rows[start : start + step], greedy))
        return assemble_output(input_ids, lengths, results, self.pad_token_id)

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
        futures: list[asyncio.Future[_RowResult]] = [loop.create_future() for _ in rows]
        for row, fut in zip(rows, futures):
            row.deliver = _make_deliver(loop, fut)
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
                    yield i, assemble_output(input_ids[i : i + 1], lengths[i : i + 1], [result], self.pad_token_id)
        finally:
            for row in rows:
                row.cancelled = True
            for fut in pending:
                fut.cancel()

    def shutdown(self) -> bool:
        """Stop the worker thread (bounded join) and fail requests still queued; idempotent."""
        with self._start_lock:
            if self._closed:
                return True
            self._closed = True
            worker = self._worker
        if worker is not None:
            self._queue.put(_STOP)
            worker.join(timeout=self.cfg.shutdown_timeout_s)
            if worker.is_alive():
                logger.warning("HFGeneration worker did not stop within %.1f s", self.cfg.shutdown_timeout_s)
        _fail_queued(self._queue, EngineShutDownError("HFGeneration was shut down"))
        return True

    def get_logger_metrics(self) -> dict[str, Any]:
        return {f"hf_generation/{k}": v for k, v in asdict(self.stats).items()}

    def clear_logger_metrics(self) -> None:
        self.stats = HFGenerationStats()

    # ------------------------------------------------------------------ input / output

    def _check_open(self) -> None:
        if self._closed:
            raise EngineShutDownError("HFGeneration was shut down")

    def _rows_from_batch(self, data: Mapping[str, Any], greedy: bool) -> tuple[torch.Tensor, torch.Tensor, list[_Row]]:
        input_ids, lengths = check_input(data)
        batch = input_ids.shape[0]
        row_stops = data.get("stop_strings")
        if row_stops is not None and len(row_stops) != batch:
            raise ValueError(f"stop_strings has {len(row_stops)} rows, input_ids {batch}")
        if batch and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            # Padding positions may hold anything; check only the real tokens.
            for i in range(batch):
                real = input_ids[i, : int(lengths[i])]
                if int(real.min()) < 0 or int(real.max()) >= self.vocab_size:
                    raise ValueError(f"row {i} holds token ids outside [0, {self.vocab_size})")
        overrides = {key: data[key] for key in PER_ROW_SAMPLING_KEYS if data.get(key) is not None}
        for key, values in overrides.items():
            if len(values) != batch:
                raise ValueError(f"{key} has {len(values)} rows, input_ids {batch}")
        rows = []
        for i in range(batch):
            stops = list(self.cfg.stop_strings or [])
            extra = row_stops[i] if row_stops is not None else None
            if isinstance(extra, str):
                extra = [extra]
            for s in extra or []:
                if s and s not in stops:
                    stops.append(s)
            sampling = self._row_sampling({key: values[i] for key, values in overrides.items()}, row=i)
            rows.append(
                _Row(
                    prompt=input_ids[i, : int(lengths[i])].tolist(),
                    stop_strings=tuple(stops),
                    greedy=greedy or sampling.greedy,
                    sampling=sampling,
                )
            )
        return input_ids, lengths, rows

    def _row_sampling(self, override: Mapping[str, Any], *, row: int) -> RowSampling:
        """The config's sampling with this row's overrides (None means "use the config")."""

        def value(key: str, default: Any) -> Any:
            given = override.get(key)
            return default if given is None else given

        temperature = float(value("temperature", self.cfg.temperature))
        top_p = float(value("top_p", self.cfg.top_p))
        top_k = value("top_k", self.cfg.top_k)
        max_new_tokens = int(value("max_new_tokens", self.cfg.max_new_tokens))
        if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
            raise ValueError(
                f"row {row}: invalid sampling temperature={temperature} top_p={top_p} max_new_tokens={max_new_tokens}"
            )
        return RowSampling(
            temperature=temperature,
            top_p=top_p,
            top_k=None if top_k in (None, 0, -1) else int(top_k),
            max_new_tokens=max_new_tokens,
        )

    # ------------------------------------------------------------------ decoding

    def _run_batch(self, rows: list[_Row], greedy: bool, *, from_worker: bool = False) -> list[_RowResult]:
        with self._model_lock:
            self.stats.batches_run += 1
            if from_worker:
                self.stats.async_batches_run += 1
            self.stats.max_rows_in_batch = max(self.stats.max_rows_in_batch, len(rows))
            with torch.inference_mode():
                return self._decode(rows, greedy)

    def _decode(self, rows: list[_Row], greedy: bool) -> list[_RowResult]:
        """Decode ``rows`` as one left-padded batch; rows leave the batch as they finish.

        Finished rows are handed to ``row.deliver`` at once (worker path). Returns
        the results in row order (``None`` for rows withdrawn by cancellation).
        """
        results: list[_RowResult | None] = [None] * len(rows)
        caps = [max(0, min(r.sampling.max_new_tokens, self.max_model_len - len(r.prompt))) for r in rows]
        gen_tokens: list[list[int]] = [[] for _ in rows]
        gen_logprobs: list[list[float]] = [[] for _ in rows]
        windows = [4 * max((len(s) for s in r.stop_strings), default=0) + 4 for r in rows]

        def finish(i: int, truncated: bool) -> None:
            res = _RowResult(gen_tokens[i], gen_logprobs[i], truncated)
            results[i] = res
            self.stats.rows_generated += 1
            self.stats.tokens_generated += len(gen_tokens[i])
            if rows[i].deliver is not None and not rows[i].cancelled:
                rows[i].deliver(res)

        active = []
        for i, row in enumerate(rows):
            if row.cancelled:
                continue
            if caps[i] == 0:
                finish(i, truncated=True)
            else:
                active.append(i)
        if not active:
            return results  # type: ignore[return-value]

        dev = self.device
        width = max(len(rows[i].prompt) for i in active)
        input_ids = torch.full((len(active), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(active), width), dtype=torch.long)
        for j, i in enumerate(active):
            n = len(rows[i].prompt)
            input_ids[j, width - n :] = torch.tensor(rows[i].prompt, dtype=torch.long)
            attention[j, width - n :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        next_pos = attention.sum(-1)  # [n] = prompt lengths
        cache = _new_cache(self.model)
        logits = self._forward(input_ids, attention, positions, cache)

        while True:
            tokens, logprobs = self._pick(logits, [rows[i] for i in active])
            token_list, lp_list = tokens.tolist(), logprobs.tolist()
            keep: list[int] = []
            for j, i in enumerate(active):
                if self._closed:
                    raise EngineShutDownError("HFGeneration was shut down during generation")
                if rows[i].cancelled:
                    continue
                tok = token_list[j]
                gen_tokens[i].append(tok)
                gen_logprobs[i].append(lp_list[j])
                if tok in self.stop_token_ids or self._hit_stop_string(rows[i], gen_tokens[i], windows[i]):
                    finish(i, truncated=False)
                elif len(gen_tokens[i]) >= caps[i]:
                    finish(i, truncated=True)
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(index)
                attention, next_pos, tokens = attention[index], next_pos[index], tokens[index]
                active = [active[j] for j in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=-1)
            logits = self._forward(tokens[:, None], attention, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return results  # type: ignore[return-value]

    def _forward(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        self.stats.forward_passes += 1
        return out.logits[:, -1, :].float()

    def _pick(self, logits: torch.Tensor, rows: Sequence[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose the next token of every row; return them with ``log_softmax(logits / T)[token]``.

        ``T`` is the row's temperature (1 for greedy rows); top-k, then top-p, only
        restrict which tokens a sampled row may draw.
        """
        greedy = torch.tensor([r.greedy for r in rows], device=logits.device)
        temps = torch.tensor([1.0 if r.greedy else r.sampling.temperature for r in rows], device=logits.device)
        scaled = logits / temps[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        if not bool(greedy.all()):
            allowed = scaled
            vocab = allowed.shape[-1]
            top_k = torch.tensor([r.sampling.top_k or vocab for r in rows], device=logits.device).clamp(max=vocab)
            if bool((top_k < vocab).any()):
                kth = torch.sort(allowed, dim=-1, descending=True).values.gather(-1, (top_k - 1)[:, None])
                allowed = allowed.masked_fill(allowed < kth, float("-inf"))
            top_p = torch.tensor([r.sampling.top_p for r in rows], device=logits.device)
            if bool((top_p < 1.0).any()):
                sorted_logits, order = torch.sort(allowed, dim=-1, descending=True)
                probs = torch.softmax(sorted_logits, dim=-1)
                before = probs.cumsum(-1) - probs  # mass of the more likely tokens
                drop_sorted = before >= top_p[:, None]  # never drops the most likely token
                drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
                allowed = allowed.masked_fill(drop, float("-inf"))
            sampled = torch.multinomial(torch.softmax(allowed, dim=-1), 1, generator=self._generator).squeeze(-1)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _hit_stop_string(self, row: _Row, tokens: list[int], window: int) -> bool:
        """Whether the newest token completed one of the row's stop strings.

        Any earlier occurrence would have stopped the row already, so it suffices to
        look at the text of the last few tokens (a stop string of n characters spans
        at most 4n byte tokens).
        """
        if not row.stop_strings:
            return False
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in row.stop_strings)

    # ------------------------------------------------------------------ worker thread

    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._closed:
                raise EngineShutDownError("HFGeneration was shut down")
            if self._worker is not None:
                return
            self._worker = threading.Thread(
                target=_worker_loop,
                args=(weakref.ref(self), self._queue, self.cfg.max_batch_size, self.cfg.batch_wait_s),
                name="hf-generation-worker",
                daemon=True,
            )
            self._worker.start()
            # If the engine is dropped without shutdown(), stop the thread anyway.
            weakref.finalize(self, self._queue.put, _STOP)


def _worker_loop(
    engine_ref: weakref.ref[HFGeneration], q: queue.SimpleQueue[Any], max_batch: int, wait_s: float
) -> None:
    pending: list[_Row] = []
    stopping = False
    while not stopping:
        if not pending:
            item = q.get()
            if item is _STOP:
                break
            pending.append(item)
            if wait_s > 0:
                threading.Event().wait(wait_s)  # let concurrent submitters join this batch
        while True:  # drain whatever else is queued
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stopping = True
                break
            pending.append(item)
        if stopping:
            break
        pending = [r for r in pending if not r.cancelled]
        if not pending:
            continue
        greedy = pending[0].greedy
        batch = [r for r in pending if r.greedy == greedy][:max_batch]
        chosen = set(map(id, batch))
        pending = [r for r in pending if id(r) not in chosen]
        engine = engine_ref()
        if engine is None or engine._closed:
            pending.extend(batch)
            break
        try:
            engine._run_batch(batch, greedy, from_worker=True)
        except Exception as exc:  # hand the failure to every row still waiting
            if not isinstance(exc, EngineShutDownError):
                logger.exception("HFGeneration batch failed")
            for row in batch:
                if row.deliver is not None and not row.cancelled:
                    row.deliver(exc)
        finally:
            del engine
    err = EngineShutDownError("HFGeneration was shut down")
    for row in pending:
        if row.deliver is not None:
            row.deliver(err)
    _fail_queued(q, err)


def _fail_queued(q: queue.SimpleQueue[Any], err: BaseException) -> None:
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return
        if item is not _STOP and item.deliver is not None:
            item.deliver(err)


def _make_deliver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> Callable[[Any], None]:
    def deliver(result: Any) -> None:
        try:
            loop.call_soon_threadsafe(_resolve, fut, result)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    return deliver


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _first_id(*candidates: Any, default: int) -> int:
    for c in candidates:
        if isinstance(c, int):
            return c
        if isinstance(c, (list, tuple)) and c:
            return int(c[0])
    return default
