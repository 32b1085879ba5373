"""The decode loop of :class:`~gym_bridge.generation.hf.HFGeneration`: rows that join and leave one KV cache.

A :class:`RunningBatch` holds the rows decoding together: one left-padded attention
mask, one KV cache, and for every row the logits of its next token. Between
two decode steps rows may join (:meth:`RunningBatch.admit`: their prompts are
prefilled as their own left-padded batch, then both caches are left-padded to one
width and stacked) and finished rows leave (their cache rows are dropped). The cache's
layers append in place (:mod:`gym_bridge.generation.kv_cache`), so a decode step
does not copy the cache; ``DecodeContext.growing_kv_cache=False`` keeps transformers'
``DynamicCache``, which does, and gives the same tokens and logprobs. Masked
padding never changes what a row sees, so a row decodes the same tokens alone or in
any company (up to float rounding in the batched matmuls). Token choice and
logprobs follow the semantics documented in :mod:`gym_bridge.generation.hf`.

A row fails alone: when choosing one row's token raises (or gives a NaN logprob), when its stop check raises, or
when the prefill of a group of joining rows raises (each is then prefilled by itself), only that row gets a
:class:`RowFailure` (through ``deliver``; :func:`decode_to_end` raises it) and leaves; the rows beside it go on.
Only a failure no row explains (the forward pass of the whole batch) fails the batch.

A seeded row (``RowSampling.seed``) draws from its own ``torch.Generator``, as vLLM does: its
noise depends only on its seed and how many tokens it has drawn, never on the rows beside it.
Unseeded rows share the engine's generator, so their draws depend on batch composition.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gym_bridge.failures import EngineShutDownError
from gym_bridge.generation import cascade_attention
from gym_bridge.generation.decode_row import DecodeContext, Row, RowFailure, RowResult
from gym_bridge.generation.prefix_cache import cache_supported, past_from_blocks, row_blocks
from gym_bridge.generation.token_choice import pick_tokens

logger = logging.getLogger("gym_bridge.generation.hf")

#: Left padding columns that every row masks out are trimmed once there are this many.
TRIM_COLUMNS = 32


@dataclass
class _Prefilled:
    """A group of joining rows after their prefill forward: their own cache, mask, next positions and logits."""

    cache: Any
    attention: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor


class RunningBatch:
    """Rows decoding over one KV cache; see the module docstring."""

    def __init__(self, ctx: DecodeContext, weight_version: int) -> None:
        self.ctx = ctx
        self.weight_version = weight_version
        self.rows: list[Row] = []
        self._cache: Any = None  # a transformers DynamicCache, whose layer types are a union the loop never narrows
        self._attention: torch.Tensor | None = None  # [n, W]
        self._next_pos: torch.Tensor | None = None  # [n] positions of the next token
        self._logits: torch.Tensor | None = None  # [n, V] the distribution of each row's next token

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, rows: Sequence[Row]) -> None:
        """Prefill ``rows`` and add them; rows with nothing to generate finish at once (truncated).

        With a prefix cache, each row starts from its longest cached prefix, and a row whose next block
        another joining row is about to compute waits one prefill for it when the rows waiting save enough of their
        prompts to repay that pass (:meth:`PrefixCache.waves`); a row
        whose whole prompt is another joining row's takes that row's keys, values and logits (:meth:`_copy_rows`).
        """
        ctx = self.ctx
        joining = []
        for row in rows:
            row.cap = max(0, min(row.sampling.max_new_tokens, ctx.max_model_len - len(row.prompt)))
            row.window = 4 * max((len(s) for s in row.stop_strings), default=0) + 4
            if row.cancelled:
                continue
            if row.cap == 0:
                self._finish(row, truncated=True)
            else:
                joining.append(row)
        if not joining:
            return
        prefix_cache = ctx.prefix_cache
        if prefix_cache is None:
            self._prefill(joining, [[] for _ in joining])
            return
        names = [prefix_cache.block_names(row.prompt) for row in joining]
        first, second = prefix_cache.waves([row.prompt for row in joining], names)
        joined = self._prefill([joining[i] for i in first], [names[i] for i in first])
        leaders = {tuple(row.prompt): row for row in joined}  # a row whose prefill failed leads no copy
        copies = [i for i in second if tuple(joining[i].prompt) in leaders]
        rest = [i for i in second if tuple(joining[i].prompt) not in leaders]
        if rest:
            self._prefill([joining[i] for i in rest], [names[i] for i in rest])
        if copies:
            for i in copies:
                found = prefix_cache.lookup(len(joining[i].prompt), names[i])
                ctx.stats.prefix_cache_queries += len(joining[i].prompt)
                ctx.stats.prefix_cache_hits += len(found) * prefix_cache.block_size
            self._copy_rows([(leaders[tuple(joining[i].prompt)], joining[i]) for i in copies])

    def _copy_rows(self, copies: list[tuple[Row, Row]]) -> None:
        """Add rows whose prompt equals a row's in the batch (the N samples of one prompt): that row's keys,
        values and next-token logits, with no forward pass."""
        from gym_bridge.generation.kv_cache import select_rows

        assert self._attention is not None and self._next_pos is not None and self._logits is not None
        index = [self.rows.index(leader) for leader, _ in copies]
        keep = torch.tensor(list(range(len(self.rows))) + index, dtype=torch.long, device=self.ctx.device)
        select_rows(self._cache, keep)
        self._attention, self._next_pos, self._logits = self._attention[keep], self._next_pos[keep], self._logits[keep]
        for leader, row in copies:
            row.kv_start, row.kv_blocks = leader.kv_start, leader.kv_blocks
        self.rows = self.rows + [row for _, row in copies]
        self.ctx.stats.max_rows_in_batch = max(self.ctx.stats.max_rows_in_batch, len(self.rows))

    def _prefill(self, joining: list[Row], names: list[list[bytes]]) -> list[Row]:
        """Prefill ``joining`` and stack them onto the batch; return the rows that joined.

        When the group's forward raises, each row is prefilled by itself, so a row that fails alone fails only
        itself (:class:`RowFailure`); the batch is not touched until a group's forward has succeeded.
        """
        try:
            part = self._prefill_forward(joining, names)
        except Exception as exc:
            if len(joining) > 1:
                joined: list[Row] = []
                for row, row_names in zip(joining, names, strict=True):
                    joined += self._prefill([row], [row_names])
                return joined
            self._fail(joining[0], f"its prefill failed: {type(exc).__name__}: {exc}", exc)
            return []
        self._join(joining, part)
        return joining

    def _prefill_forward(self, joining: list[Row], names: list[list[bytes]]) -> _Prefilled:
        """One forward over the uncached part of every joining row's prompt, into a cache of their own.

        Row ``j``'s columns: zeros, its cached prefix (``past`` wide in all), zeros, the rest of its prompt.
        """
        from gym_bridge.generation.kv_cache import new_cache

        ctx = self.ctx
        prefix_cache = ctx.prefix_cache
        found = [
            prefix_cache.lookup(len(row.prompt), row_names) if prefix_cache is not None else []
            for row, row_names in zip(joining, names, strict=True)
        ]
        cached = [len(blocks) * (prefix_cache.block_size if prefix_cache is not None else 0) for blocks in found]
        fed = [len(row.prompt) - c for row, c in zip(joining, cached, strict=True)]
        past, width = max(cached), max(fed)
        input_ids = torch.full((len(joining), width), ctx.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(joining), past + width), dtype=torch.long)
        for j, row in enumerate(joining):
            input_ids[j, width - fed[j] :] = torch.tensor(row.prompt[cached[j] :], dtype=torch.long)
            attention[j, past - cached[j] : past] = 1
            attention[j, past + width - fed[j] :] = 1
        input_ids, attention = input_ids.to(ctx.device), attention.to(ctx.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = new_cache(ctx.model, ctx.growing_kv_cache)
        if past:
            past_from_blocks(cache, found, past, spare=width)
        logits = self._forward(input_ids, attention, positions, cache)
        for j, row in enumerate(joining):
            row.kv_start = past - cached[j] if cached[j] else past + width - fed[j]
            row.kv_blocks = tuple(found[j])
        if prefix_cache is not None:
            ctx.stats.prefix_cache_queries += sum(len(row.prompt) for row in joining)
            ctx.stats.prefix_cache_hits += sum(cached)
            for j, row in enumerate(joining):
                cut = self._remember(cache, attention, j, row.prompt)
                if not cached[j] or fed[j] == width:  # the row's columns run on from its cached ones: no gap
                    row.kv_blocks += _leading(cut[len(found[j]) :])
        return _Prefilled(cache, attention, attention.sum(-1), logits)

    def _join(self, joining: list[Row], part: _Prefilled) -> None:
        """Stack prefilled rows onto the batch: both caches left-padded to one width."""
        from gym_bridge.generation.kv_cache import stack_caches

        ctx = self.ctx
        ctx.stats.max_rows_in_batch = max(ctx.stats.max_rows_in_batch, len(self.rows) + len(joining))
        if not self.rows:
            self.rows, self._cache, self._attention, self._next_pos, self._logits = (
                joining,
                part.cache,
                part.attention,
                part.next_pos,
                part.logits,
            )
            return
        assert self._attention is not None and self._next_pos is not None and self._logits is not None
        total = max(self._attention.shape[1], part.attention.shape[1])
        for rows, width in ((self.rows, self._attention.shape[1]), (joining, part.attention.shape[1])):
            for row in rows:
                row.kv_start += total - width
        stack_caches(self._cache, part.cache, total)
        self._attention = torch.cat([_pad_left(self._attention, total), _pad_left(part.attention, total)], 0)
        self._next_pos = torch.cat([self._next_pos, part.next_pos])
        self._logits = torch.cat([self._logits, part.logits])
        self.rows = self.rows + joining

    def _remember(self, cache: Any, attention: torch.Tensor, j: int, tokens: list[int]) -> list[torch.Tensor | None]:
        """Put the full blocks of ``tokens`` (row ``j`` of ``cache``, at its unmasked columns) in the prefix cache;
        return each block this row's columns gave (None: the block was cached already)."""
        prefix_cache = self.ctx.prefix_cache
        if prefix_cache is None:
            return []
        if not cache_supported(cache):
            logger.warning("prefix caching is off: this model's KV cache is not one full-attention DynamicCache")
            self.ctx.prefix_cache = None
            return []
        names = prefix_cache.block_names(tokens)
        wanted = [not prefix_cache.contains(name) for name in names]
        columns = attention[j].nonzero().squeeze(-1)
        blocks = row_blocks(cache, j, columns, prefix_cache.block_size, wanted)
        prefix_cache.insert(names, blocks)
        return blocks

    def step(self) -> None:
        """Pick every row's next token; finished and failed rows leave; the rest run one forward pass."""
        from gym_bridge.generation.kv_cache import select_rows

        ctx = self.ctx
        assert self._logits is not None and self._attention is not None and self._next_pos is not None
        tokens, logprobs, failed = self._choose()
        token_list, lp_list = tokens.tolist(), logprobs.tolist()
        keep: list[int] = []
        for j, row in enumerate(self.rows):
            if ctx.is_closed():
                raise EngineShutDownError("HFGeneration was shut down during generation")
            if row.cancelled:
                continue
            if j in failed:
                self._fail(row, *failed[j])
                continue
            if math.isnan(lp_list[j]):
                self._fail(row, "its next-token distribution is not finite (a NaN logprob)", None)
                continue
            row.tokens.append(token_list[j])
            row.logprobs.append(lp_list[j])
            try:
                stopped = token_list[j] in ctx.stop_token_ids or self._hit_stop_string(row)
            except Exception as exc:
                self._fail(row, f"its stop check failed: {type(exc).__name__}: {exc}", exc)
                continue
            if not stopped and len(row.tokens) < row.cap:
                keep.append(j)
                continue
            if ctx.prefix_cache is not None:
                self._remember(self._cache, self._attention, j, row.prompt + row.tokens[:-1])
            self._finish(row, truncated=not stopped)
        if not keep:
            self.rows, self._cache, self._attention, self._next_pos, self._logits = [], None, None, None, None
            return
        attention, next_pos = self._attention, self._next_pos
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long, device=ctx.device)
            select_rows(self._cache, index)
            attention, next_pos, tokens = attention[index], next_pos[index], tokens[index]
            self.rows = [self.rows[j] for j in keep]
            attention = self._trim(attention)
        attention = torch.cat([attention, attention.new_ones((len(keep), 1))], dim=-1)
        with cascade_attention.decoding(self._plan(attention)):
            self._logits = self._forward(tokens[:, None], attention, next_pos[:, None], self._cache)
        self._attention, self._next_pos = attention, next_pos + 1

    def _plan(self, attention: torch.Tensor) -> cascade_attention.DecodePlan | None:
        """The shared-prefix split of this decode step, when several rows hold one copy of a long prefix."""
        prefix_cache = self.ctx.prefix_cache
        if not self.ctx.shared_prefix or prefix_cache is None:
            return None
        size = prefix_cache.block_size
        min_blocks = -(-cascade_attention.MIN_SHARED_TOKENS // size)
        group = cascade_attention.choose_group([row.kv_blocks for row in self.rows], min_blocks)
        if group is None:
            return None
        dtype = getattr(self.ctx.model, "dtype", torch.float32)
        self.ctx.stats.cascade_steps += 1
        return cascade_attention.DecodePlan.build(group, [row.kv_start for row in self.rows], attention, size, dtype)

    def _choose(self) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[str, BaseException | None]]]:
        """Every row's next token and logprob, and the rows whose choice failed (index -> why).

        The rows are chosen together; when that raises, each row is chosen by itself, so the failure stays with
        the rows that cause it (a NaN logprob, which raises nothing, is caught by :meth:`step`)."""
        assert self._logits is not None
        failed: dict[int, tuple[str, BaseException | None]] = {}
        try:
            tokens, logprobs = pick_tokens(self._logits, self.rows, self.ctx.generator)
        except Exception:
            tokens = torch.zeros(len(self.rows), dtype=torch.long, device=self._logits.device)
            logprobs = torch.zeros(len(self.rows), dtype=self._logits.dtype, device=self._logits.device)
            for j, row in enumerate(self.rows):
                try:
                    one, lp = pick_tokens(self._logits[j : j + 1], [row], self.ctx.generator)
                except Exception as exc:
                    failed[j] = (f"choosing its next token failed: {type(exc).__name__}: {exc}", exc)
                    continue
                tokens[j], logprobs[j] = one[0], lp[0]
        return tokens, logprobs, failed

    def _trim(self, attention: torch.Tensor) -> torch.Tensor:
        """Drop leading columns that every remaining row masks out (left by rows that left)."""
        from gym_bridge.generation.kv_cache import drop_leading

        used = attention.any(0).nonzero()
        first = int(used[0]) if used.numel() else 0
        if first < TRIM_COLUMNS:
            return attention
        drop_leading(self._cache, first)
        for row in self.rows:
            row.kv_start -= first
        return attention[:, first:]

    def _fail(self, row: Row, why: str, cause: BaseException | None) -> None:
        """Row ``row`` leaves the batch unfinished: its waiter gets a :class:`RowFailure` saying ``why``."""
        failure = RowFailure(f"a generation row failed alone: {why}")
        failure.__cause__ = cause
        row.failure = failure
        logger.debug("%s", failure, exc_info=cause)
        if row.deliver is not None and not row.cancelled:
            row.deliver(failure)

    def _finish(self, row: Row, truncated: bool) -> None:
        row.result = RowResult(row.tokens, row.logprobs, truncated, self.weight_version)
        self.ctx.stats.rows_generated += 1
        self.ctx.stats.tokens_generated += len(row.tokens)
        if row.deliver is not None and not row.cancelled:
            row.deliver(row.result)

    def _forward(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: object
    ) -> torch.Tensor:
        kwargs: dict[str, int] = {"logits_to_keep": 1} if self.ctx.logits_to_keep else {}
        with self.ctx.packed.using() if self.ctx.packed is not None else contextlib.nullcontext():
            out = self.ctx.model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                **kwargs,
            )
        self.ctx.stats.forward_passes += 1
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _hit_stop_string(self, row: Row) -> bool:
        """Whether the newest token completed one of the row's stop strings.

        Any earlier occurrence would have stopped the row already, so it suffices to
        look at the text of the last few tokens (a stop string of n characters spans
        at most 4n byte tokens).
        """
        if not row.stop_strings:
            return False
        text = self.ctx.tokenizer.decode(row.tokens[-row.window :], skip_special_tokens=False)
        return any(s in text for s in row.stop_strings)


def decode_to_end(ctx: DecodeContext, rows: list[Row], weight_version: int) -> list[RowResult | None]:
    """Decode ``rows`` as one batch until every row finished; results in row order (None: cancelled).

    A row that failed alone lets the others finish, then its :class:`RowFailure` is raised (a blocking batch call
    gives every row or raises)."""
    batch = RunningBatch(ctx, weight_version)
    batch.admit(rows)
    while len(batch):
        batch.step()
    failure = next((row.failure for row in rows if row.failure is not None), None)
    if failure is not None:
        raise failure
    return [row.result for row in rows]


def _leading(blocks: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """The blocks before the first None."""
    out: list[torch.Tensor] = []
    for block in blocks:
        if block is None:
            break
        out.append(block)
    return tuple(out)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """An attention mask ``[n, w]`` left-padded with zeros to ``width`` columns."""
    missing = width - t.shape[1]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], missing)), t], dim=1)
