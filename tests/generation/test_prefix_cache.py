"""Prefix sharing in HFGeneration on the real tiny model: rows get the same tokens and logprobs with and without it,
the shared part is computed once, a refit empties it; and the block cache's own rules (hash chain, budget, LRU).

Exactness. A row that reuses cached keys and values runs its prompt's remainder through the model in a forward
pass over fewer positions than a full prefill, so float32 matmuls and attention sums round in a different order.
Tokens must be equal; logprobs may differ by that rounding. On the tiny model the largest difference measured is
9.5e-7 (a few float32 ulps of a logprob near -7), the same size as the rounding between one row decoded alone and in a
batch (which this engine already allows); ``LOGPROB_TOL`` = 1e-5 leaves a 10x margin and is still far below any
difference a wrong prefix (another token, another position, stale weights) makes (> 1e-2 here).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.prefix_cache import PrefixCache

LOGPROB_TOL = 1e-5
BLOCK = 16


def ids_batch(prompts: list[list[int]], **extra: object) -> BatchedDataDict:
    """Token-id prompts right-padded into one batch, with per-row ``extra`` fields."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts]), **extra})


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` ordinary token ids of the tiny vocabulary, drawn with ``seed``."""
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(tiny_lm, *, sharing: bool, model: torch.nn.Module | None = None, **cfg: object) -> HFGeneration:
    """An engine over the tiny model with prefix sharing on or off; no stop ids, so rows run to their cap."""
    tok, shared_model = tiny_lm
    settings: dict = {"max_new_tokens": 16, "stop_token_ids": [], "enable_prefix_caching": sharing, **cfg}
    return HFGeneration(HFGenerationConfig(**settings), model=model or shared_model, tokenizer=tok)


def rows(out: BatchedDataDict) -> list[tuple[list[int], torch.Tensor]]:
    """Each row's ids and logprobs, padding removed."""
    return [
        (out["output_ids"][i, :n].tolist(), out["logprobs"][i, :n])
        for i, n in enumerate(out["unpadded_sequence_lengths"].tolist())
    ]


def assert_same_rows(shared: BatchedDataDict, alone: BatchedDataDict) -> float:
    """Equal tokens and logprobs within ``LOGPROB_TOL`` row by row; returns the largest logprob difference."""
    worst = 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(rows(shared), rows(alone), strict=True):
        assert ids_a == ids_b
        worst = max(worst, float((lp_a - lp_b).abs().max()))
    assert worst <= LOGPROB_TOL
    return worst


PREFIX = random_ids(100, seed=1)
#: Eight rows over one 100-token prefix: the N samples of one prompt (the prefix itself, three times) and
#: prompts that continue it by 0 to 33 tokens (a few-shot header with different questions).
PROMPTS = [PREFIX] * 3 + [PREFIX + random_ids(k, seed=10 + k) for k in (1, 7, 20, 33, 40)]


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefix_rows_match_rows_without_sharing(tiny_lm, greedy: bool) -> None:
    seeds = {} if greedy else {"seed": list(range(len(PROMPTS)))}
    data = ids_batch(PROMPTS, **seeds)
    on, off = engine(tiny_lm, sharing=True), engine(tiny_lm, sharing=False)
    first, again = on.generate(data, greedy=greedy), on.generate(data, greedy=greedy)
    reference = off.generate(data, greedy=greedy)
    assert_same_rows(first, reference)
    assert_same_rows(again, reference)
    full_blocks = (len(PREFIX) - 1) // BLOCK * BLOCK  # what every later row of the first call can reuse
    counts = on.prefix_cache_counts()
    assert counts.queries == 2 * sum(map(len, PROMPTS))
    # First call: one row computes the prefix, the seven others reuse it; second call: every row hits.
    assert counts.hits >= 7 * full_blocks + 8 * full_blocks
    assert on.stats.prefix_cache_hits == counts.hits
    assert off.prefix_cache_counts().queries == 0 and off.stats.prefix_cache_hits == 0


def test_later_turns_reuse_earlier_turns_and_their_output(tiny_lm) -> None:
    """A multi-turn rollout: turn 2's prompt is turn 1's prompt, its generation and an observation."""
    on, off = engine(tiny_lm, sharing=True), engine(tiny_lm, sharing=False)
    turn1 = ids_batch([PREFIX + random_ids(5, seed=3)], seed=[7])
    out1_on, out1_off = on.generate(turn1), off.generate(turn1)
    assert_same_rows(out1_on, out1_off)
    history = rows(out1_on)[0][0]
    turn2 = ids_batch([history + random_ids(9, seed=4)], seed=[8])
    before = on.prefix_cache_counts().hits
    assert_same_rows(on.generate(turn2), off.generate(turn2))
    hit = on.prefix_cache_counts().hits - before
    # Every full block of turn 1's prompt and output (its last token has no keys yet) came from the cache.
    assert hit == (len(history) - 1) // BLOCK * BLOCK
    assert hit > len(turn1["input_ids"][0])


async def test_concurrent_requests_share_through_the_worker(tiny_lm) -> None:
    on, off = engine(tiny_lm, sharing=True, batch_wait_s=0.05), engine(tiny_lm, sharing=False)
    try:

        async def one(i: int) -> BatchedDataDict:
            data = ids_batch([PROMPTS[i]], seed=[i], temperature=[0.9])
            (out,) = [out async for _, out in on.generate_async(data)]
            return out

        outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), timeout=300)
    finally:
        on.shutdown()
    # A seeded row's draws do not depend on its batch, so one reference batch serves every request.
    reference = off.generate(ids_batch(PROMPTS, seed=list(range(len(PROMPTS))), temperature=[0.9] * len(PROMPTS)))
    for i, out in enumerate(outs):
        assert_same_rows(out, reference.slice(i, i + 1))
    assert on.prefix_cache_counts().hits >= (len(PROMPTS) - 1) * ((len(PREFIX) - 1) // BLOCK * BLOCK)


def test_a_refit_empties_the_prefix_cache(tiny_lm) -> None:
    """After new weights, a cached prefix would be stale keys and values: the same prompt must miss."""
    _, model = tiny_lm
    on = engine(tiny_lm, sharing=True, model=copy.deepcopy(model))
    data = ids_batch([PREFIX + random_ids(3, seed=5)], seed=[1])
    old = on.generate(data)
    on.generate(data)
    hits_before = on.prefix_cache_counts().hits
    assert hits_before > 0

    torch.manual_seed(1)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    refitted = copy.deepcopy(model)
    refitted.load_state_dict(new_weights)
    on.update_weights(new_weights, 1)
    after = on.generate(data)
    assert on.prefix_cache_counts().hits == hits_before  # nothing old was reused
    assert_same_rows(after, engine(tiny_lm, sharing=False, model=refitted).generate(data))
    assert float((rows(after)[0][1] - rows(old)[0][1]).abs().max()) > 1e-2  # stale keys would have shown
    assert_same_rows(on.generate(data), after)  # the new weights' prefix is cached and reused
    assert on.prefix_cache_counts().hits > hits_before


def test_block_names_chain_the_whole_prefix() -> None:
    cache = PrefixCache(block_size=4, max_bytes=1 << 20)
    a = cache.block_names([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = cache.block_names([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # only full blocks
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first block is another name
    assert cache.block_names([1, 2, 3, 4, 5, 6, 7, 8]) == a
    assert cache.usable(8, a) == 1 and cache.usable(9, a) == 2  # the prompt's last token is always prefilled


def test_budget_evicts_least_recent_and_later_blocks_first() -> None:
    block = torch.zeros(1, 2, 1, 4, 2)  # 64 bytes of float32
    size = block.numel() * block.element_size()
    cache = PrefixCache(block_size=4, max_bytes=3 * size)
    first = cache.block_names(list(range(12)))
    cache.insert(first, [block.clone() for _ in first])
    assert len(cache) == 3 and cache.nbytes == 3 * size
    other = cache.block_names(list(range(100, 104)))
    cache.insert(other, [block.clone()])
    # The chain's last block goes first: its earlier blocks stay usable on their own.
    assert [cache.contains(n) for n in first] == [True, True, False] and cache.contains(other[0])
    assert len(cache.lookup(12, first)) == 2 and cache.counts().hits == 8 and cache.counts().queries == 12
    cache.insert(cache.block_names(list(range(200, 204))), [block.clone()])
    assert not cache.contains(other[0])  # the least recently used block went
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.counts().hits == 8
