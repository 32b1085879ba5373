"""Shared-prefix (cascade) attention for decode steps: rows that hold the same copy of a long prefix attend to it once.

Gym's agents send many rows that start with one long preamble (workplace_assistant's tool definitions: ~4,500 tokens
of a ~4,600-token prompt). Each row of a decode batch keeps its own copy of that preamble's keys and values, and
SDPA reads every copy at every step: at 10 such rows attention is 63% of a step
(``benchmarks/history/2026-11-28-engine-profile.md``). Here the rows whose leading columns are copies of the same
prefix-cache blocks (bit for bit: loaded from those blocks, or the row the blocks were cut from) are one *group*:
at a decode step all their queries attend to one copy of the shared prefix in one kernel call, every row attends to
the rest of its own columns in a second, and the two halves are merged by their log-sum-exps, which is exact up to
float rounding (the softmax over the union of two column sets). Rows outside the group attend to their leading
columns in a call of their own.

:func:`choose_group` picks the group from the rows' block provenance; :class:`DecodePlan` carries it, with the masks,
into the model's attention layers through :func:`decoding` (a per-thread plan; without one, and for every prefill,
the layers run transformers' SDPA attention unchanged). :func:`enable` switches a model that runs SDPA attention to
:data:`ATTENTION`, which is that SDPA function whenever no plan is active.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

#: The attention implementation :func:`enable` registers: SDPA, with the shared prefix attended once in decode steps.
ATTENTION = "gym_bridge_cascade"
#: A group forms only when its rows share at least this many tokens (a second kernel call costs more than a short
#: shared prefix saves).
MIN_SHARED_TOKENS = 256

#: Attention arguments that make a layer more than softmax over its mask's columns: such a layer keeps SDPA's path.
_NOT_PLAIN = ("sliding_window", "softcap", "s_aux", "position_bias")
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_local = threading.local()


@dataclass(frozen=True)
class Group:
    """Rows whose first ``blocks`` prefix-cache blocks are the same copy; ``members`` index the batch's rows."""

    members: list[int]
    blocks: int


def choose_group(provenance: Sequence[Sequence[torch.Tensor]], min_blocks: int) -> Group | None:
    """The group that saves the most: rows sharing their first ``b`` block objects (compared by identity, so two
    computations of one prefix are never mixed), maximising ``(rows - 1) * b``; None when no two rows share
    ``min_blocks``."""
    best: Group | None = None
    by_first: dict[int, list[int]] = {}
    for j, chain in enumerate(provenance):
        if len(chain) >= min_blocks:
            by_first.setdefault(id(chain[0]), []).append(j)
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        reference = provenance[max(rows, key=lambda j: len(provenance[j]))]
        shared = {j: _common(reference, provenance[j]) for j in rows}
        for blocks in sorted(set(shared.values())):
            members = [j for j in rows if shared[j] >= blocks]
            saves = (len(members) - 1) * blocks
            if blocks >= min_blocks and saves > 0 and (best is None or saves > (len(best.members) - 1) * best.blocks):
                best = Group(members, blocks)
    return best


def _common(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x is not y:
            return i
    return min(len(a), len(b))


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's split of the columns ``[0, W)`` (``W`` = the step's attention width).

    Each group row holds the shared prefix in ``length`` columns from its first token's; the copy attended is the
    ``source`` row's, from column ``source_start``. Every row attends to ``[lo, W)`` under ``rest_mask`` (the group's
    prefix columns masked), and each row of ``heads`` (a row outside the group whose columns start before ``lo``) to
    ``[0, lo)`` under its mask.
    """

    members: list[int]
    length: int
    source: int
    source_start: int
    lo: int
    rest_mask: torch.Tensor  # [n, 1, 1, W - lo], additive (0 or -inf)
    heads: list[tuple[int, torch.Tensor]]  # (row, [1, 1, 1, lo] additive mask)
    index: torch.Tensor | None  # the members as an index; None: every row of the batch, in order

    @classmethod
    def build(
        cls, group: Group, starts: Sequence[int], attention: torch.Tensor, block_size: int, dtype: torch.dtype
    ) -> DecodePlan:
        """The plan of a step whose 2-D mask (the new column included) is ``attention`` ``[n, W]``; ``starts[j]``
        is the column of row ``j``'s first token."""
        length = group.blocks * block_size
        member_starts = [starts[j] for j in group.members]
        lo = min(member_starts) + length
        keep = attention[:, lo:].bool().clone()
        for j, start in zip(group.members, member_starts, strict=True):
            keep[j, : max(0, start + length - lo)] = False
        outside = sorted(set(range(attention.shape[0])) - set(group.members))
        heads = [(j, _additive(attention[j : j + 1, :lo].bool(), dtype)) for j in outside if attention[j, :lo].any()]
        return cls(
            members=list(group.members),
            length=length,
            source=group.members[0],
            source_start=member_starts[0],
            lo=lo,
            rest_mask=_additive(keep, dtype),
            heads=heads,
            index=None if group.members == list(range(attention.shape[0])) else torch.tensor(group.members),
        )

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one decode step (``query`` ``[n, H, 1, D]``, ``key`` / ``value`` ``[n, KV, W, D]``), in
        transformers' output layout ``[n, 1, H, D]``."""
        n, heads, _, dim = query.shape
        kv, members = key.shape[1], len(self.members)
        q = query.reshape(n, kv, heads // kv, dim)  # a decode query per head: the heads of one KV head are its queries
        out, lse = _flash(q, key[:, :, self.lo :], value[:, :, self.lo :], attn_mask=self.rest_mask, scale=scale)
        grouped = q if self.index is None else q.index_select(0, self.index)
        src, shared = slice(self.source, self.source + 1), slice(self.source_start, self.source_start + self.length)
        shared_out, shared_lse = _flash(
            grouped.transpose(0, 1).reshape(1, kv, -1, dim), key[src, :, shared], value[src, :, shared], scale=scale
        )
        shared_out = shared_out.reshape(kv, members, -1, dim).transpose(0, 1)
        shared_lse = shared_lse.reshape(kv, members, -1).transpose(0, 1)
        if self.index is None:
            out = _merge(out, lse, shared_out, shared_lse)
        else:
            rows = (out.index_select(0, self.index), lse.index_select(0, self.index))
            out.index_copy_(0, self.index, _merge(*rows, shared_out, shared_lse))
        for j, mask in self.heads:
            row, head = slice(j, j + 1), slice(0, self.lo)
            head_out, head_lse = _flash(q[row], key[row, :, head], value[row, :, head], attn_mask=mask, scale=scale)
            out[row] = _merge(out[row], lse[row], head_out, head_lse)
        merged: torch.Tensor = out.reshape(n, 1, heads, dim)  # [n, KV, rep, D] and [n, 1, H, D] are one memory order
        return merged


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two column sets, from each set's normalised output and log-sum-exp: the
    two outputs weighted by the share of the softmax mass each set holds (``sigmoid(lse_a - lse_b)`` for ``a``)."""
    return torch.lerp(out_b, out_a, torch.sigmoid(lse_a - lse_b).unsqueeze(-1).to(out_a.dtype))


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``[n, w]`` keep-mask as the additive ``[n, 1, 1, w]`` mask the CPU flash kernel takes."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))[:, None, None, :]


@contextmanager
def decoding(plan: DecodePlan | None) -> Iterator[None]:
    """Run the forward passes inside with ``plan`` (this thread only)."""
    _local.plan = plan
    try:
        yield
    finally:
        _local.plan = None


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except in a decode step run under a :class:`DecodePlan`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: DecodePlan | None = getattr(_local, "plan", None)
    special = dropout or any(kwargs.get(k) is not None for k in _NOT_PLAIN)
    if plan is None or special or query.shape[2] != 1 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return plan.attend(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None


def enable(model: Any) -> bool:
    """Switch ``model`` from SDPA attention to :data:`ATTENTION` (registered with transformers once, masks as SDPA's);
    False, changing nothing, when the model runs another attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return True
