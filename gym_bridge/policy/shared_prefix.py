"""Token logprobs of a right-padded batch whose rows share prefixes, each shared prefix computed once.

GRPO trains the N samples of a prompt side by side, so runs of neighbouring rows start with the same prompt
tokens. :func:`plan_prefixes` splits the rows into runs, each with the longest prefix all of its rows share,
choosing the split that feeds the model the fewest tokens. :func:`shared_prefix_logprobs` then makes two forward
passes: one over each run's prefix (keeping its keys and values) and one over every row's remainder against its
run's cached prefix. The logprobs are those of one forward over the whole rows up to float rounding; gradients
reach a prefix once per row through the shared keys and values (indexing sums them), so the loss and its gradient
are the same as well. The padding columns the whole-row pass computes are skipped too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Sharing runs a second forward pass; below this fraction of the tokens saved it is not worth it.
MIN_SAVED_FRACTION = 0.25

#: The most rows one run may span (bounds the split search, which is quadratic in it).
MAX_RUN_ROWS = 128


@dataclass(frozen=True)
class PrefixRun:
    """Rows ``start .. stop - 1`` and the ``prefix`` tokens they all start with (at least one of each row's
    tokens stays outside it)."""

    start: int
    stop: int
    prefix: int


def _adjacent_common(input_ids: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """How many leading tokens row ``k`` and row ``k + 1`` share, for every ``k``."""
    same = (input_ids[:-1] == input_ids[1:]).long().cumprod(dim=1).sum(dim=1)
    return torch.minimum(same, torch.minimum(lengths[:-1], lengths[1:])).tolist()


def plan_prefixes(input_ids: torch.Tensor, lengths: torch.Tensor) -> list[PrefixRun]:
    """The split of the rows into runs of neighbours that feeds the fewest tokens: a run of rows with a common
    prefix of ``p`` tokens costs ``p`` plus each row's tokens after it (a dynamic program over the split points)."""
    rows = int(input_ids.shape[0])
    lens = [int(n) for n in lengths.tolist()]
    common = _adjacent_common(input_ids, lengths)
    best: list[tuple[int, int, int]] = [(0, 0, 0)]  # best[j]: (cost of rows < j, start of the last run, its prefix)
    for stop in range(1, rows + 1):
        choice: tuple[int, int, int] | None = None
        shared, shortest, remainder = 1 << 62, 1 << 62, 0
        for start in range(stop - 1, max(-1, stop - 1 - MAX_RUN_ROWS), -1):
            shortest = min(shortest, lens[start])
            if start < stop - 1:
                shared = min(shared, common[start])
            prefix = max(0, min(shared, shortest - 1))
            remainder += lens[start]
            cost = best[start][0] + prefix + remainder - (stop - start) * prefix
            if choice is None or cost < choice[0]:
                choice = (cost, start, prefix)
        assert choice is not None
        best.append(choice)
    runs: list[PrefixRun] = []
    stop = rows
    while stop:
        _, start, prefix = best[stop]
        runs.append(PrefixRun(start, stop, prefix))
        stop = start
    return runs[::-1]


def fed_tokens(runs: list[PrefixRun], lengths: torch.Tensor) -> int:
    """Tokens the two passes feed the model for ``runs``."""
    lens = lengths.tolist()
    return sum(run.prefix + sum(int(n) - run.prefix for n in lens[run.start : run.stop]) for run in runs)


def worth_sharing(runs: list[PrefixRun], lengths: torch.Tensor) -> bool:
    """Whether sharing saves at least :data:`MIN_SAVED_FRACTION` of the tokens of the whole-row pass."""
    whole = int(lengths.max()) * int(lengths.shape[0])
    return bool(whole) and fed_tokens(runs, lengths) <= (1 - MIN_SAVED_FRACTION) * whole


def shared_prefix_logprobs(
    forward: Callable[..., Any],
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    runs: list[PrefixRun],
    first: int,
    temperature: float,
) -> torch.Tensor:
    """``[b, S]``: ``log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]`` for ``first <= t < length``,
    else 0, computed as the module docstring says. ``forward`` is the model call (keyword arguments)."""
    rows, width = input_ids.shape
    device = input_ids.device
    run_of = torch.cat([torch.full((run.stop - run.start,), i, dtype=torch.long) for i, run in enumerate(runs)])
    run_of = run_of.to(device)
    prefix_len = torch.tensor([run.prefix for run in runs], dtype=torch.long, device=device)
    widest = int(prefix_len.max())

    prefix_ids = torch.zeros((len(runs), widest), dtype=torch.long, device=device)
    for i, run in enumerate(runs):
        prefix_ids[i, : run.prefix] = input_ids[run.start, : run.prefix]
    prefix_mask = (torch.arange(widest, device=device)[None, :] < prefix_len[:, None]).long()
    # Logits from column first - 1 (or each run's last prefix column, if earlier) to the widest prefix's end.
    earliest = min(first - 1, int(prefix_len.min()) - 1)
    keep = widest - earliest
    out = forward(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True, logits_to_keep=keep)
    prefix_logp = torch.log_softmax(out.logits.float() / temperature, dim=-1)  # [runs, keep, V]
    cache = out.past_key_values
    cache.batch_select_indices(run_of)

    row_prefix = prefix_len[run_of]  # [b]
    rest_len = lengths - row_prefix
    rest_width = int(rest_len.max())
    columns = torch.arange(rest_width, device=device)[None, :]
    source = (row_prefix[:, None] + columns).clamp(max=width - 1)
    rest_mask = columns < rest_len[:, None]
    rest_ids = torch.where(rest_mask, input_ids.gather(1, source), torch.zeros_like(source))
    attention = torch.cat([prefix_mask[run_of], rest_mask.long()], dim=1)
    positions = row_prefix[:, None] + columns
    rest = forward(
        input_ids=rest_ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
    )
    rest_logp = torch.log_softmax(rest.logits[:, :-1].float() / temperature, dim=-1)  # [b, rest_width - 1, V]

    result = torch.zeros((rows, width), dtype=prefix_logp.dtype, device=device)
    t = torch.arange(width, device=device)[None, :].expand(rows, width)
    wanted = (t >= first) & (t < lengths[:, None])
    in_prefix = wanted & (t <= row_prefix[:, None])  # scored by the prefix pass's logits at column t - 1
    in_rest = wanted & ~in_prefix  # by the remainder's logits at column t - 1 - prefix
    b, col = in_prefix.nonzero(as_tuple=True)
    result[b, col] = prefix_logp[run_of[b], col - 1 - earliest, input_ids[b, col]]
    b, col = in_rest.nonzero(as_tuple=True)
    result[b, col] = rest_logp[b, col - 1 - row_prefix[b], input_ids[b, col]]
    return result
