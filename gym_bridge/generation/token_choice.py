"""How each decoding row's next token is chosen: temperature, top-k then top-p, and vLLM's exponential-race draw.

One call chooses the tokens of a whole decode batch (:func:`pick_tokens`) and returns their logprobs from the
unrestricted ``log_softmax(logits / T)``, the semantics documented in :mod:`gym_bridge.generation.hf`. A seeded
row draws from its own generator, so its noise depends only on its seed and how many tokens it has drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gym_bridge.generation.decode_row import Row


def pick_tokens(
    logits: torch.Tensor, rows: Sequence[Row], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of every row; return them with ``log_softmax(logits / T)[token]``.

    ``T`` is the row's temperature (1 for greedy rows); top-k, then top-p, only restrict which tokens a sampled row
    may draw. A sampled row draws as vLLM's sampler does: ``argmax(probs / q)`` with ``q ~ Exp(1)``, one value per
    vocabulary entry (:func:`row_noise`), from the row's own generator when it has one (a seeded row), else from the
    shared ``generator``, whose rows draw together as one ``torch.multinomial(probs, 1)`` over them drew (the same
    values, so the same tokens). The rows are chosen together: one division and one argmax for the batch, no copy of
    the logits when every temperature is 1. Unseeded rows are checked as ``torch.multinomial`` checks them, so a row
    whose distribution is not finite raises here, as it did.
    """
    greedy_rows = [r.greedy for r in rows]
    temps = [1.0 if r.greedy else r.sampling.temperature for r in rows]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=logits.device)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if all(greedy_rows):
        tokens = torch.argmax(logits, dim=-1)
    else:
        probs = torch.softmax(restricted(scaled, rows), dim=-1)
        shared = [j for j, r in enumerate(rows) if r.generator is None]  # greedy ones too: one draw per row
        if shared:
            check_distribution(probs if len(shared) == len(rows) else probs[shared])
        tokens = torch.argmax(probs / row_noise(rows, generator, probs), dim=-1)
        if any(greedy_rows):
            greedy = torch.tensor(greedy_rows, device=logits.device)
            tokens = torch.where(greedy, torch.argmax(logits, dim=-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def restricted(scaled: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """``scaled`` with the tokens each row may not draw (beyond its top-k, then beyond its top-p) at ``-inf``."""
    allowed = scaled
    vocab = allowed.shape[-1]
    if any(r.sampling.top_k is not None and r.sampling.top_k < vocab for r in rows):
        top_k = torch.tensor([min(r.sampling.top_k or vocab, vocab) for r in rows], device=scaled.device)
        kth = torch.sort(allowed, dim=-1, descending=True).values.gather(-1, (top_k - 1)[:, None])
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if any(r.sampling.top_p < 1.0 for r in rows):
        top_p = torch.tensor([r.sampling.top_p for r in rows], device=scaled.device)
        sorted_logits, order = torch.sort(allowed, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p[:, None]
        drop_sorted[:, 0] = False  # never the most likely token (a top_p below float32's range rounds to 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        allowed = allowed.masked_fill(drop, float("-inf"))
    return allowed


def check_distribution(probs: torch.Tensor) -> None:
    """Raise as ``torch.multinomial`` does for rows that are not a distribution (inf, NaN, negative, all zero)."""
    if not bool((probs.max() < math.inf) & (probs.min() >= 0)):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(-1) == 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")


def row_noise(rows: Sequence[Row], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise shaped, typed and placed as ``like`` (``[rows, vocab]``).

    The rows without a generator (greedy ones too) draw from ``generator`` in one call, in row order: the values
    ``torch.multinomial`` over those rows drew. A seeded sampled row draws from its own generator; a seeded greedy row
    draws nothing (ones: its argmax is never used). The rows are written in place, with no copy.
    """
    noise = torch.empty_like(like)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if len(shared) == len(rows):
        return noise.exponential_(generator=generator)
    if shared:
        noise[shared] = like.new_empty((len(shared), like.shape[-1])).exponential_(generator=generator)
    for j, r in enumerate(rows):
        if r.generator is not None and r.greedy:
            noise[j].fill_(1.0)
        elif r.generator is not None:
            noise[j].exponential_(generator=r.generator)
    return noise
