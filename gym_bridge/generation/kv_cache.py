"""The decode loop's KV cache: keys and values in buffers with spare columns, so a decode step appends in place.

transformers' ``DynamicLayer`` keeps each layer's keys and values as one tensor and grows it with ``torch.cat`` at
every forward pass: each decode step copies the whole cache, per layer, to add one column. With a 4,500-token prompt
that is ~200 MB per row per step on SmolLM2-135M, and ~30% of decode time even at short prompts.
:class:`GrowingLayer` keeps them in buffers ``[rows, kv_heads, capacity, head_dim]`` with spare columns along the
sequence axis: an append writes the new columns into the spare ones, and attention gets views of the filled columns
(``keys`` / ``values``, as a ``DynamicLayer`` exposes them). A full buffer is copied once into one
:data:`GROWTH` times larger, so an append costs amortised O(1) copies of the cache, not one whole copy.

The views are not contiguous (their row and head strides span the capacity); SDPA on CPU reads them in place, at the
speed and with the float results of a contiguous cache (``benchmarks/kv_cache.py`` measures both; the tests compare
tokens and logprobs with ``DynamicCache``'s). Attention never sees the spare columns, and the left padding that
stacking writes is zeros, as ``DynamicCache``'s is, so masked columns add exactly nothing.

The batch operations of :class:`~gym_bridge.generation.hf_decode.RunningBatch` are functions here, each for a
growing cache and, unchanged, for any other cache whose layers hold ``keys`` / ``values`` (``growing=False``: the
reference the tests and the benchmark compare with): :func:`stack_caches` (rows join), :func:`select_rows` (rows
leave, or a row's copies join), :func:`drop_leading` (trim leading all-masked columns) and :func:`past_storage`
(where a prefill's cached prefix is written).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

#: A full buffer grows to this many times the columns it must hold.
GROWTH = 1.5
#: At least this many spare columns after every growth (short prompts would otherwise grow every few steps).
MIN_SPARE = 64


def capacity_for(columns: int) -> int:
    """The capacity a buffer that must hold ``columns`` columns is given."""
    return max(int(columns * GROWTH), columns + MIN_SPARE)


class GrowingLayer(DynamicLayer):
    """One full-attention layer's keys and values in buffers with spare sequence columns; see the module docstring.

    ``keys`` / ``values`` are always views of the filled columns ``[start, end)`` of the buffers; everything that
    changes the cache goes through a method that keeps it so.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' DynamicLayer.__init__ is unannotated
        self._k: torch.Tensor | None = None  # [rows, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None
        self._start = 0
        self._end = 0

    @property
    def capacity(self) -> int:
        """Columns the buffers hold, filled or not."""
        return 0 if self._k is None else int(self._k.shape[2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the dtype and device of the first states; the buffers are allocated by the first append."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` (``[rows, kv_heads, new, head_dim]``); return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._k is None or self._v is None:
            rows, heads, _, head_dim = key_states.shape
            self._k = key_states.new_empty((rows, heads, capacity_for(new), head_dim))
            self._v = value_states.new_empty((rows, heads, capacity_for(new), head_dim))
            self._start = self._end = 0
        elif self._end + new > self.capacity:
            self._regrow(self._end - self._start + new)
        assert self._k is not None and self._v is not None
        self._k[:, :, self._end : self._end + new].copy_(key_states)
        self._v[:, :, self._end : self._end + new].copy_(value_states)
        self._end += new
        return self._refresh()

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        """Take ``keys`` / ``values`` (``[rows, kv_heads, capacity, head_dim]``) as the buffers, their first ``filled``
        columns written."""
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._k, self._v, self._start, self._end = keys, values, 0, filled
        self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order, repeats allowed).

        Rows leaving (``indices`` increasing) move down in place: no buffer is allocated and only moved rows are
        copied. Any other selection is gathered into new buffers.
        """
        if self._k is None or self._v is None:
            return
        picked = [int(i) for i in indices.tolist()]
        lo, hi = self._start, self._end
        if all(a < b for a, b in itertools.pairwise(picked)):
            for j, src in enumerate(picked):
                if src != j:
                    self._k[j, :, lo:hi].copy_(self._k[src, :, lo:hi])
                    self._v[j, :, lo:hi].copy_(self._v[src, :, lo:hi])
            self._k, self._v = self._k[: len(picked)], self._v[: len(picked)]
        else:
            index = indices.to(self._k.device)
            self._k, self._v = self._with_spare(self._k[index, :, lo:hi]), self._with_spare(self._v[index, :, lo:hi])
            self._start, self._end = 0, hi - lo
        self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (transformers' beam expansion)."""
        if self._k is not None:
            self.batch_select_indices(torch.arange(self._k.shape[0]).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the rows (transformers' beam search)."""
        self.batch_select_indices(beam_idx)

    def drop_leading(self, columns: int) -> None:
        """Forget the first ``columns`` filled columns (no copy: the views start later)."""
        if self._k is None:
            return
        self._start = min(self._start + columns, self._end)
        self._refresh()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, not {tokens_to_remove}")
        if self._k is None:
            return
        self._end = max(self._start, self._end + tokens_to_remove)
        self._refresh()

    def reset(self) -> None:
        """Drop the buffers."""
        self._k = self._v = None
        self._start = self._end = 0
        super().reset()

    def _regrow(self, columns: int) -> None:
        assert self._k is not None and self._v is not None
        lo, hi = self._start, self._end
        self._k = self._with_spare(self._k[:, :, lo:hi], columns)
        self._v = self._with_spare(self._v[:, :, lo:hi], columns)
        self._start, self._end = 0, hi - lo

    @staticmethod
    def _with_spare(filled: torch.Tensor, columns: int | None = None) -> torch.Tensor:
        """A buffer of ``capacity_for(columns)`` columns whose first ones are ``filled``."""
        rows, heads, width, head_dim = filled.shape
        buffer = filled.new_empty((rows, heads, capacity_for(columns if columns is not None else width), head_dim))
        buffer[:, :, :width].copy_(filled)
        return buffer

    def _refresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k is not None and self._v is not None
        self.keys, self.values = self._k[:, :, self._start : self._end], self._v[:, :, self._start : self._end]
        return self.keys, self.values


def new_cache(model: Any, growing: bool = True) -> Any:
    """An empty cache for ``model``: a ``DynamicCache`` whose full-attention layers are :class:`GrowingLayer` s.

    A model with any other kind of layer (sliding window, linear attention) keeps transformers' layers, as does
    ``growing=False``.
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if growing and layers and all(type(layer) is DynamicLayer for layer in layers):
        cache.layers = [GrowingLayer() for _ in layers]
    return cache


def past_storage(cache: Any, block: torch.Tensor, rows: int, width: int, spare: int) -> torch.Tensor:
    """Uninitialised storage ``[layers, 2, rows, kv_heads, width, head_dim]`` for the prefix an empty ``cache``
    starts from (heads, head size, dtype and device those of a prefix-cache ``block``); each layer of ``cache`` then
    holds its ``width`` columns. A growing cache gets room for ``spare`` more (what the prefill appends), so the
    prefill copies nothing.
    """
    _, _, heads, _, head_dim = block.shape
    growing = all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    columns = capacity_for(width + spare) if growing else width
    storage = block.new_empty((len(cache.layers), 2, rows, heads, columns, head_dim))
    for i, layer in enumerate(cache.layers):  # storage[i], not iteration: unbound views refuse in-place writes
        keys, values = storage[i, 0], storage[i, 1]
        if isinstance(layer, GrowingLayer):
            layer.adopt(keys, values, width)
        else:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
    return storage[..., :width, :]


def stack_caches(running: Any, joining: Any, width: int) -> None:
    """Stack ``joining``'s rows under ``running``'s, both left-padded with zeros to ``width`` columns (in place)."""
    for old, new in zip(running.layers, joining.layers, strict=True):
        if isinstance(old, GrowingLayer):
            assert old.keys is not None and old.values is not None
            room = capacity_for(width)
            old.adopt(_stacked(old.keys, new.keys, width, room), _stacked(old.values, new.values, width, room), width)
        else:
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)], 0)
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)], 0)


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep the rows ``index`` of every layer, in that order (repeats allowed)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.batch_select_indices(index)
        else:
            layer.keys, layer.values = layer.keys[index], layer.values[index]


def drop_leading(cache: Any, columns: int) -> None:
    """Forget the first ``columns`` columns of every layer."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.drop_leading(columns)
        else:
            layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]


def _stacked(top: torch.Tensor, bottom: torch.Tensor, width: int, capacity: int) -> torch.Tensor:
    """A ``capacity``-column buffer holding ``top``'s rows over ``bottom``'s, each right-aligned in ``width`` columns
    with zeros before."""
    rows = top.shape[0] + bottom.shape[0]
    buffer = top.new_empty((rows, top.shape[1], capacity, top.shape[3]))
    for part, at in ((top, slice(0, top.shape[0])), (bottom, slice(top.shape[0], rows))):
        pad = width - part.shape[2]
        buffer[at, :, :pad].zero_()
        buffer[at, :, pad:width].copy_(part)
    return buffer


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[2] = missing
    return torch.cat([t.new_zeros(shape), t], dim=2)
