"""Automatic prefix caching for :class:`~gym_bridge.generation.hf.HFGeneration`, as vLLM does it.

A prompt is cut into blocks of ``block_size`` tokens. Block ``b`` is named by the hash chain
``sha256(name of block b-1, tokens of block b)``, so one name stands for the whole prefix up to
the block's end, and two rows share a cached block only when they share every token before it.
A cached block holds the keys and values of its tokens in every layer (``[layers, 2, heads,
block_size, head_dim]``); a row that finds its first ``k`` blocks cached starts from their keys
and values and prefills only the rest of its prompt.

Only full blocks are cached, and a lookup always leaves at least the prompt's last token to
prefill (the logits of the first generated token come from it). The cache is bounded by
``max_bytes`` and evicts the least recently used block first; a lookup or an insert touches a
chain from its last block to its first, so a prefix's first blocks outlive its later ones (a
later block is useless without every block before it). The cache belongs to one set of weights:
:meth:`PrefixCache.clear` runs at every refit.

``queries`` and ``hits`` count prompt tokens looked up and prompt tokens found, for the life of
the cache (vLLM's ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_ROOT = b"gym-bridge-prefix-cache"
#: Rows that join together wait a second prefill pass for blocks another of them computes only when they find at least
#: this many prompt tokens there (:meth:`PrefixCache.waves`; ``benchmarks/kv_cache.py --only wait`` measures it).
WAIT_MIN_TOKENS = 64


@dataclass(frozen=True)
class PrefixCacheCounts:
    """Prompt tokens looked up in the prefix cache and prompt tokens found there, since the engine started."""

    queries: int
    hits: int


class PrefixCache:
    """KV blocks of token prefixes, keyed by their hash chain, with a byte budget and LRU eviction."""

    def __init__(self, block_size: int, max_bytes: int, wait_min_tokens: int = WAIT_MIN_TOKENS) -> None:
        """An empty cache of ``block_size``-token blocks holding at most ``max_bytes`` of keys and values; rows that
        join together wait a second prefill for each other's blocks when that saves ``wait_min_tokens`` (:meth:`waves`).
        """
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.wait_min_tokens = wait_min_tokens
        self.queries = 0
        self.hits = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """The bytes of keys and values held now."""
        return self._bytes

    def counts(self) -> PrefixCacheCounts:
        """The lifetime query and hit counters."""
        return PrefixCacheCounts(self.queries, self.hits)

    def block_names(self, tokens: Sequence[int]) -> list[bytes]:
        """The hash-chain name of every full block of ``tokens``, in order."""
        names: list[bytes] = []
        parent = _ROOT
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = array("q", tokens[start : start + size]).tobytes()
            parent = hashlib.sha256(parent + block).digest()
            names.append(parent)
        return names

    def contains(self, name: bytes) -> bool:
        """Whether the block named ``name`` is cached."""
        return name in self._blocks

    def usable(self, prompt_len: int, names: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt may come from the cache: its last token is always prefilled."""
        return min(len(names), (prompt_len - 1) // self.block_size)

    def cached_count(self, names: Sequence[bytes]) -> int:
        """How many of ``names``, from the first, are cached now (no counting, no LRU touch)."""
        count = 0
        for name in names:
            if name not in self._blocks:
                break
            count += 1
        return count

    def waves(self, prompts: Sequence[Sequence[int]], names: Sequence[Sequence[bytes]]) -> tuple[list[int], list[int]]:
        """Split rows that join together into those prefilled first and those that wait for blocks the first compute.

        A row may wait when the first blocks it misses are ones an earlier row of the first wave computes. If its
        prompt is that row's (the N samples of one prompt), it waits and then copies that row's cache with no forward
        pass. The others wait for a second prefill pass only when together they find at least ``wait_min_tokens``
        tokens there that they would otherwise compute: a pass has a cost of its own, which a short shared part does
        not repay; else they are prefilled in the first wave.
        """
        coming: set[bytes] = set()
        leaders: set[tuple[int, ...]] = set()
        first: list[int] = []
        copies: list[int] = []
        waiting: list[int] = []
        saved = 0
        for i, (prompt, row_names) in enumerate(zip(prompts, names, strict=True)):
            usable = row_names[: self.usable(len(prompt), row_names)]
            have = self.cached_count(usable)
            gain = 0
            while have + gain < len(usable) and usable[have + gain] in coming:
                gain += 1
            if gain and tuple(prompt) in leaders:
                copies.append(i)
            elif gain:
                waiting.append(i)
                saved += gain * self.block_size
            else:
                first.append(i)
                coming.update(row_names)
                leaders.add(tuple(prompt))
        if saved < self.wait_min_tokens:
            for i in waiting:  # no second pass: each computes its prompt, or copies an identical one's
                (copies if tuple(prompts[i]) in leaders else first).append(i)
                leaders.add(tuple(prompts[i]))
            waiting = []
        return sorted(first), sorted(copies + waiting)

    def lookup(self, prompt_len: int, names: Sequence[bytes]) -> list[torch.Tensor]:
        """The cached blocks of the longest usable cached prefix; counts the query and the hit."""
        found = [self._blocks[name] for name in names[: self.cached_count(names[: self.usable(prompt_len, names)])]]
        for name in reversed(names[: len(found)]):
            self._blocks.move_to_end(name)
        self.queries += prompt_len
        self.hits += len(found) * self.block_size
        return found

    def insert(self, names: Sequence[bytes], blocks: Sequence[torch.Tensor | None]) -> None:
        """Cache ``blocks`` under ``names`` (None: already cached), then evict down to the budget."""
        for name, block in zip(reversed(names), reversed(blocks), strict=True):
            if block is not None and name not in self._blocks:
                self._blocks[name] = block
                self._bytes += block.numel() * block.element_size()
            if name in self._blocks:
                self._blocks.move_to_end(name)
        while self._bytes > self.max_bytes and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self._bytes -= evicted.numel() * evicted.element_size()

    def clear(self) -> None:
        """Drop every block (the weights changed, so every cached key and value is stale); counters stay."""
        self._blocks.clear()
        self._bytes = 0


def cache_supported(cache: Any) -> bool:
    """Whether blocks can be cut from ``cache`` (a filled DynamicCache): full-attention layers of one shape."""
    from transformers.cache_utils import DynamicLayer

    from gym_bridge.generation.kv_cache import GrowingLayer

    layers = list(cache.layers)
    kinds = (DynamicLayer, GrowingLayer)
    if not layers or any(type(layer) not in kinds or not layer.is_initialized for layer in layers):
        return False
    shape = layers[0].keys.shape[1:2] + layers[0].keys.shape[3:]
    return all(layer.keys.shape[1:2] + layer.keys.shape[3:] == shape for layer in layers)


def row_blocks(cache: Any, row: int, columns: torch.Tensor, block_size: int, wanted: Sequence[bool]) -> list[Any]:
    """The blocks of one row of a filled ``cache``: its tokens sit at ``columns``; None for a block not ``wanted``."""
    picks = [b for b, want in enumerate(wanted) if want]
    if not picks:
        return [None] * len(wanted)
    index = torch.cat([columns[b * block_size : (b + 1) * block_size] for b in picks])
    stacked = torch.stack(
        [torch.stack([layer.keys[row, :, index], layer.values[row, :, index]]) for layer in cache.layers]
    )
    parts = iter(stacked.split(block_size, dim=3))
    return [next(parts).clone() if want else None for want in wanted]


def past_from_blocks(cache: Any, rows: Sequence[Sequence[torch.Tensor]], width: int, spare: int = 0) -> None:
    """Fill an empty ``cache`` with each row's cached blocks, right-aligned in ``width`` columns (zeros before);
    every block is copied once, straight into its place. A growing cache keeps room for ``spare`` more columns."""
    from gym_bridge.generation.kv_cache import past_storage

    sample = next(block for blocks in rows for block in blocks)
    size = sample.shape[3]
    past = past_storage(cache, sample, len(rows), width, spare)
    for j, blocks in enumerate(rows):
        start = width - len(blocks) * size
        past[:, :, j, :, :start].zero_()
        for b, block in enumerate(blocks):
            past[:, :, j, :, start + b * size : start + (b + 1) * size] = block
