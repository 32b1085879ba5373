"""Cascade attention in the engine's decode steps (generation/cascade_attention.py): rows that hold one copy of a long
prefix attend to it once, and get what per-row attention gives them, up to float rounding.

The merge of two softmax halves by their log-sum-exps is exact in real arithmetic, so the plan is held to SDPA over
each row's whole mask on generated layouts (Hypothesis), and the engine on the real tiny model to the same tokens and
logprobs with cascade attention on and off, and to the trainer's forward pass."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from gym_bridge.generation.cascade_attention import DecodePlan, Group, choose_group
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig

BLOCK = 4
ATTEND_TOL = 1e-5
LOGPROB_TOL = 1e-5


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Group, list[int], torch.Tensor, int]:
    """A decode step's layout: ``n`` rows right-aligned in ``W`` columns, a group sharing ``blocks`` blocks at its
    own start column each, gaps of masked columns, rows outside the group starting anywhere."""
    n = draw(st.integers(2, 6))
    members = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
    blocks = draw(st.integers(1, 4))
    length = blocks * BLOCK
    width = length + draw(st.integers(2, 24))
    attention = torch.zeros((n, width), dtype=torch.long)
    starts = []
    for j in range(n):
        start = draw(st.integers(0, width - length - 1 if j in members else width - 1))
        starts.append(start)
        attention[j, start:] = 1
        if j in members and start + length < width - 1 and draw(st.booleans()):  # a gap after the cached prefix
            gap = draw(st.integers(start + length, width - 2))
            attention[j, start + length : gap + 1] = 0
        elif j not in members and start < width - 2 and draw(st.booleans()):
            attention[j, draw(st.integers(start, width - 2))] = 0
    return Group(members, blocks), starts, attention, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_the_plan_attends_as_sdpa_over_each_rows_whole_mask(layout) -> None:
    group, starts, attention, seed = layout
    n, width = attention.shape
    kv, rep, dim = 2, 3, 8
    gen = torch.Generator().manual_seed(seed)
    key, value = torch.randn((n, kv, width, dim), generator=gen), torch.randn((n, kv, width, dim), generator=gen)
    length = group.blocks * BLOCK
    source = group.members[0]
    for j in group.members:  # the group's rows hold one copy of the prefix, each at its own columns
        key[j, :, starts[j] : starts[j] + length] = key[source, :, starts[source] : starts[source] + length]
        value[j, :, starts[j] : starts[j] + length] = value[source, :, starts[source] : starts[source] + length]
    query = torch.randn((n, kv * rep, 1, dim), generator=gen)
    plan = DecodePlan.build(group, starts, attention, BLOCK, torch.float32)
    got = plan.attend(query, key, value, dim**-0.5)
    mask = attention.bool()[:, None, None, :]
    want = F.scaled_dot_product_attention(query.reshape(n, kv, rep, dim), key, value, attn_mask=mask, scale=dim**-0.5)
    assert got.shape == (n, 1, kv * rep, dim)
    assert torch.allclose(got, want.reshape(n, kv * rep, 1, dim).transpose(1, 2), atol=ATTEND_TOL, rtol=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6)), min_size=1, max_size=7), st.integers(1, 3))
def test_the_group_shares_block_objects_and_saves_the_most(chains, min_blocks) -> None:
    """Rows draw their chains from three families of block objects (two computations of one prefix are two
    families); the chosen group's rows share their first blocks by identity, and no other choice saves more."""
    families = [[torch.zeros(1) for _ in range(6)] for _ in range(3)]
    provenance = [tuple(families[f][:k]) for f, k in chains]
    group = choose_group(provenance, min_blocks)

    def saving(members: tuple[int, ...], blocks: int) -> int:
        ok = all(len(provenance[j]) >= blocks for j in members) and all(
            provenance[a][b] is provenance[members[0]][b] for a in members for b in range(blocks)
        )
        return (len(members) - 1) * blocks if ok and blocks >= min_blocks else 0

    best = max(
        (saving(m, b) for size in range(2, len(chains) + 1) for m in itertools.combinations(range(len(chains)), size)
         for b in range(1, 7)),
        default=0,
    )  # fmt: skip
    if best == 0:
        assert group is None
    else:
        assert group is not None and saving(tuple(group.members), group.blocks) == best


def _engine(tiny_lm, cascade: bool) -> HFGeneration:
    tok, model = tiny_lm
    config = HFGenerationConfig(max_new_tokens=12, stop_token_ids=[], shared_prefix_attention=cascade)
    return HFGeneration(config, model=model, tokenizer=tok)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_engine_gives_per_row_attentions_tokens_and_the_trainers_logprobs(tiny_lm) -> None:
    """Seeded rows over a 400-token preamble (Gym's tool list stands before every turn): once cached, later rows'
    decode steps attend to it once. Same tokens as per-row attention, logprobs within rounding of it and of a full
    forward pass over each finished row."""
    from gym_bridge.batched import BatchedDataDict

    preamble = _ids(400, seed=1)
    prompts = [preamble + _ids(k, seed=10 + k) for k in (3, 9, 9, 17, 30)]
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    data = BatchedDataDict(
        {"input_ids": ids, "input_lengths": torch.tensor(list(map(len, prompts))), "seed": list(range(len(prompts)))}
    )
    on, off = _engine(tiny_lm, cascade=True), _engine(tiny_lm, cascade=False)
    try:
        results = {}
        for name, engine in (("on", on), ("off", off)):
            engine.generate(data)  # the preamble's blocks enter the prefix cache
            results[name] = engine.generate(data)
        assert on.stats.cascade_steps > 0 and off.stats.cascade_steps == 0
        _, model = tiny_lm
        for i, n in enumerate(results["on"]["unpadded_sequence_lengths"].tolist()):
            tokens = results["on"]["output_ids"][i, :n]
            assert torch.equal(tokens, results["off"]["output_ids"][i, :n])
            got, per_row = results["on"]["logprobs"][i, :n], results["off"]["logprobs"][i, :n]
            prompt = len(prompts[i])
            assert (got[prompt:] - per_row[prompt:]).abs().max() <= LOGPROB_TOL
            with torch.inference_mode():
                logits = model(input_ids=tokens[None]).logits[0].float()
            trainer = torch.log_softmax(logits, -1)[prompt - 1 : n - 1].gather(-1, tokens[prompt:, None])[:, 0]
            assert (got[prompt:] - trainer).abs().max() <= LOGPROB_TOL
    finally:
        on.shutdown()
        off.shutdown()


def test_a_model_without_sdpa_attention_keeps_its_attention(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    engine = HFGeneration(HFGenerationConfig(), model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    try:
        assert model.config._attn_implementation == "eager" and not engine._ctx.shared_prefix
    finally:
        engine.shutdown()


@pytest.mark.parametrize("size", [BLOCK])
def test_no_group_below_the_minimum(size: int) -> None:
    chain = tuple(torch.zeros(1) for _ in range(3))
    assert choose_group([chain, chain], min_blocks=size) is None
    assert choose_group([chain, chain[:2]], min_blocks=2) == Group([0, 1], 2)
