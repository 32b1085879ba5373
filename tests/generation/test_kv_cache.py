"""The growing KV cache (gym_bridge/generation/kv_cache.py): its layer against transformers' DynamicLayer, and the
decode loop over it against the loop over DynamicCache on real models.

The reference is the loop as it was, over transformers' ``DynamicCache`` (``DecodeContext.growing_kv_cache=False``):
the growing cache must give every row the same tokens and bit-identical logprobs through every batch operation: rows
joining mid-decode, rows leaving, leading columns trimmed, the N samples copying their leader's rows, cached prefixes,
long prompts. Bit-identical, not merely close: attention reads the views of the buffers in the same order as a
contiguous cache (the masks and cache lengths are the same), so a seeded run's tokens (``make train-demo``'s rollout
hashes) cannot change. ``assert_same`` also checks tokens and a ``LOGPROB_TOL`` for comparisons that are only close
(prefix sharing against none, one threshold against another: different prefill passes round differently).
"""

from __future__ import annotations

import pytest
import torch

from gym_bridge.generation.decode_row import DecodeContext, Row
from gym_bridge.generation.hf_config import HFGenerationStats, RowSampling
from gym_bridge.generation.hf_decode import RunningBatch
from gym_bridge.generation.kv_cache import (
    GrowingLayer,
    capacity_for,
    drop_leading,
    select_rows,
    stack_caches,
)
from gym_bridge.generation.prefix_cache import PrefixCache, cache_supported

LOGPROB_TOL = 1e-5


def random_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    """``n`` ordinary token ids below ``vocab``, drawn with ``seed``."""
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def context(model, tok, *, growing: bool, prefix_cache: PrefixCache | None = None) -> DecodeContext:
    """What HFGeneration gives its decode loop, with no stop ids (rows run to their cap)."""
    return DecodeContext(
        model=model,
        tokenizer=tok,
        device=torch.device("cpu"),
        pad_token_id=0,
        stop_token_ids=frozenset(),
        max_model_len=model.config.max_position_embeddings,
        generator=torch.Generator().manual_seed(0),
        stats=HFGenerationStats(),
        logits_to_keep=True,
        is_closed=lambda: False,
        prefix_cache=prefix_cache,
        growing_kv_cache=growing,
    )


def row(prompt: list[int], cap: int, seed: int) -> Row:
    """A seeded sampled row (temperature 1) that generates ``cap`` tokens."""
    return Row(
        prompt=prompt,
        stop_strings=(),
        greedy=False,
        sampling=RowSampling(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=cap, seed=seed),
        generator=torch.Generator().manual_seed(seed),
    )


def run(ctx: DecodeContext, waves: list[tuple[int, list[tuple[list[int], int, int]]]]) -> tuple[list[Row], list[int]]:
    """Decode ``waves`` of ``(prompt, cap, seed)`` rows, each admitted after its number of steps; returns the rows and
    the cache's length after every step (to show which operations ran)."""
    with torch.inference_mode():  # as the engine runs it
        return _run(ctx, waves)


def _run(ctx: DecodeContext, waves: list[tuple[int, list[tuple[list[int], int, int]]]]) -> tuple[list[Row], list[int]]:
    batch = RunningBatch(ctx, 0)
    rows: list[Row] = []
    lengths: list[int] = []
    steps = 0
    pending = sorted(waves, key=lambda w: w[0])
    while pending or len(batch):
        while pending and pending[0][0] <= steps:
            joining = [row(p, cap, seed) for p, cap, seed in pending.pop(0)[1]]
            rows += joining
            batch.admit(joining)
        if len(batch):
            batch.step()
            lengths.append(batch._cache.get_seq_length() if len(batch) else 0)
        steps += 1
    return rows, lengths


def assert_same(new: list[Row], old: list[Row]) -> int:
    """Equal tokens and logprobs within ``LOGPROB_TOL`` row by row; returns how many rows are bit-identical."""
    exact = 0
    for a, b in zip(new, old, strict=True):
        assert a.result is not None and b.result is not None
        assert a.result.tokens == b.result.tokens
        diff = (torch.tensor(a.result.logprobs) - torch.tensor(b.result.logprobs)).abs().max()
        assert float(diff) <= LOGPROB_TOL
        exact += a.result.logprobs == b.result.logprobs
    return exact


def both(model, tok, waves, *, sharing: bool = False) -> tuple[list[Row], list[Row], list[int]]:
    """The same waves over the growing cache and over DynamicCache; the growing run's cache lengths."""
    caches = [PrefixCache(16, 1 << 30) if sharing else None for _ in range(2)]
    new, lengths = run(context(model, tok, growing=True, prefix_cache=caches[0]), waves)
    old, _ = run(context(model, tok, growing=False, prefix_cache=caches[1]), waves)
    return new, old, lengths


# ----------------------------------------------------------------------------------------- the layer on its own


def kv(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, width, 8, generator=torch.Generator().manual_seed(seed))


def test_an_append_writes_in_place_and_the_buffer_grows_geometrically() -> None:
    layer = GrowingLayer()
    reference = kv(2, 5, 0)
    keys, _ = layer.update(reference, -reference)
    buffers: set[int] = set()
    for step in range(1, 400):
        new = kv(2, 1, step)
        reference = torch.cat([reference, new], dim=2)
        keys, values = layer.update(new, -new)
        buffers.add(layer._k.data_ptr())
        assert torch.equal(keys, reference) and torch.equal(values, -reference)
    # 404 columns: a new buffer only when a full one grows by GROWTH, never per step.
    assert len(buffers) <= 5 and layer.capacity >= 404 and layer.capacity <= capacity_for(404)
    assert not keys.is_contiguous()  # attention reads the filled part of the buffer, not a copy


def test_batch_operations_match_dynamic_layers() -> None:
    """Rows leave (in order and in place), rows repeat, columns are trimmed, rows join: the same keys and values as
    transformers' layers after the same operations."""
    from transformers import DynamicCache

    def cache(growing: bool, rows: int, width: int, seed: int) -> DynamicCache:
        made = DynamicCache()  # DynamicLayers, added as the layers are first updated
        if growing:
            made.layers = [GrowingLayer(), GrowingLayer()]
        for i in range(2):
            made.update(kv(rows, width, seed + i), kv(rows, width, seed + 10 + i), i)
        return made

    growing, plain = cache(True, 4, 40, 0), cache(False, 4, 40, 0)
    joining = [cache(True, 2, 70, 20), cache(False, 2, 70, 20)]
    for made, other in ((growing, joining[0]), (plain, joining[1])):
        select_rows(made, torch.tensor([0, 2, 3]))  # a row leaves
        drop_leading(made, 5)
        select_rows(made, torch.tensor([0, 1, 2, 1, 1]))  # copies of row 1 join
        stack_caches(made, other, 80)
        made.update(kv(7, 1, 40), kv(7, 1, 41), 0)
        made.update(kv(7, 1, 40), kv(7, 1, 41), 1)
    for g, p in zip(growing.layers, plain.layers, strict=True):
        assert isinstance(g, GrowingLayer) and g.keys.shape == (7, 3, 81, 8)
        assert torch.equal(g.keys, p.keys) and torch.equal(g.values, p.values)
    assert cache_supported(growing)


# ------------------------------------------------------------------------------------ the decode loop, tiny model

PREFIX = random_ids(200, seed=1)


def test_rows_joining_leaving_and_trimmed_decode_as_over_dynamic_cache(tiny_lm) -> None:
    tok, model = tiny_lm
    waves = [
        (0, [(random_ids(300, 2), 3, 0), (random_ids(20, 3), 40, 1), (random_ids(35, 4), 12, 2)]),
        (5, [(random_ids(60, 5), 30, 3), (random_ids(7, 6), 25, 4)]),  # join mid-decode, after the long row left
        (20, [(random_ids(500, 7), 10, 5)]),  # a long row joins late
    ]
    new, old, lengths = both(model, tok, waves)
    assert assert_same(new, old) == len(new)
    # The 300-token row left at the third step and its leading columns were trimmed.
    assert lengths[1] > 300 and lengths[2] < 100


def test_shared_prefixes_and_copied_samples_decode_as_over_dynamic_cache(tiny_lm) -> None:
    """Prefix sharing over both caches: blocks read back from the growing cache, prefixes filled into it, the N
    samples of a prompt copying their leader's rows."""
    tok, model = tiny_lm
    waves = [
        (0, [(PREFIX, 20, s) for s in range(3)] + [(PREFIX + random_ids(k, 10 + k), 20, 5 + k) for k in (9, 40)]),
        (4, [(PREFIX + random_ids(30, 50), 15, 9), (PREFIX, 10, 11)]),  # join and find the prefix cached
    ]
    new, old, _ = both(model, tok, waves, sharing=True)
    assert assert_same(new, old) == len(new)
    alone, _ = run(context(model, tok, growing=False), waves)
    assert_same(new, alone)  # and as without sharing


def test_a_long_prompt_decodes_as_over_dynamic_cache(tiny_lm) -> None:
    tok, model = tiny_lm
    waves = [(0, [(random_ids(1800, 8), 40, 0), (random_ids(1500, 9), 60, 1)])]
    new, old, _ = both(model, tok, waves)
    assert assert_same(new, old) == len(new)


@pytest.mark.slow
def test_smollm2_decodes_as_over_dynamic_cache(smollm2_model_dir) -> None:
    """SmolLM2 groups 3 query heads per KV head, so a decode step's attention reads the cache views directly
    (transformers packs the query instead of repeating keys), unlike the tiny model's."""
    from gym_bridge.models.loading import load_causal_lm

    tok, model = load_causal_lm(str(smollm2_model_dir))
    model.eval()
    vocab = int(model.config.vocab_size)
    prefix = random_ids(200, 11, vocab)
    first = [(random_ids(400, 12, vocab), 4, 0), (prefix, 10, 1), (prefix, 10, 2), (random_ids(40, 13, vocab), 8, 3)]
    waves = [(0, first), (3, [(prefix + random_ids(20, 14, vocab), 6, 4), (random_ids(100, 15, vocab), 5, 5)])]
    new, old, lengths = both(model, tok, waves, sharing=True)
    assert assert_same(new, old) == len(new)
    assert lengths[2] > 400 and lengths[3] < 400  # the 400-token row left and its columns were trimmed


# ---------------------------------------------------------------------------------- the wait threshold of waves


def test_a_row_waits_for_a_shared_part_only_when_it_is_long_enough() -> None:
    short, long_ = random_ids(32, 1), random_ids(96, 2)
    prompts = [short + random_ids(20, 3), short + random_ids(20, 4), [*long_, 7, 8], [*long_, 9, 9], [*long_, 7, 8]]
    prompts += [short + random_ids(5, 5), short + random_ids(5, 5)]
    # Waiting, rows 1, 3, 5 and 6 find 32 + 96 + 32 + 32 tokens that rows 0 and 2 compute. Row 4 repeats row 2's
    # prompt and copies its rows with no second pass, at any threshold; with no second pass, row 5 computes its own
    # prompt and row 6, which repeats it, copies row 5's rows.
    for threshold, waiting in ((0, [1, 3, 4, 5, 6]), (192, [1, 3, 4, 5, 6]), (193, [4, 6])):
        cache = PrefixCache(16, 1 << 20, wait_min_tokens=threshold)
        first, second = cache.waves(prompts, [cache.block_names(p) for p in prompts])
        assert second == waiting and first == [i for i in range(7) if i not in waiting]


def test_every_threshold_gives_the_same_rows(tiny_lm) -> None:
    tok, model = tiny_lm
    waves = [(0, [(PREFIX[:40] + random_ids(30, s), 12, s) for s in range(4)] + [(PREFIX[:40], 12, 9)] * 2)]
    results = []
    for threshold in (0, 10_000):
        cache = PrefixCache(16, 1 << 30, wait_min_tokens=threshold)
        ctx = context(model, tok, growing=True, prefix_cache=cache)
        results.append(run(ctx, waves)[0])
        passes = ctx.stats.forward_passes - 11  # 12 tokens: one prefill pass per wave, then 11 decode steps
        assert passes == (2 if threshold == 0 else 1)
    assert_same(results[0], results[1])
