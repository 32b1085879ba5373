"""HFGeneration on the real tiny model: output contract, logprob fidelity, stops, caps, async batching.

``engine`` and ``stop_string_case`` are shared with tests/generation/test_openai_http.py, whose servers run this engine.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import EngineShutDownError, SettingError
from gym_bridge.generation.decode_row import Row
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig, RowSampling
from gym_bridge.generation.hf_decode import RunningBatch
from gym_bridge.generation.token_choice import check_distribution, pick_tokens, restricted
from gym_bridge.testing import async_wait_until
from gym_bridge.testing.generation import (
    MIXED_PROMPTS,
    assert_output_contract,
    generated,
    prompt_batch,
    reference_logprobs,
    unpadded,
)

MAX_NEW = 12


def engine(tiny_lm, **cfg) -> HFGeneration:
    """An HFGeneration over the shared tiny model, ``MAX_NEW`` tokens unless ``cfg`` says otherwise."""
    tok, model = tiny_lm
    cfg.setdefault("max_new_tokens", MAX_NEW)
    return HFGeneration(HFGenerationConfig(**cfg), model=model, tokenizer=tok)


def stop_string_case(tok, base: BatchedDataDict, data: BatchedDataDict) -> tuple[int, str, list[int], int]:
    """``(row, stop, tokens, kept)``: a stop string cut from the middle of one row's greedy ``tokens`` in ``base``.

    The row's text is valid UTF-8 (random byte tokens need not be); ``kept`` is the length of the shortest
    prefix whose text contains ``stop``, which is what a row stopped by it generates.
    """
    row = next(i for i in (1, 0, 3, 2) if "\ufffd" not in tok.decode(generated(base, data, i)))
    tokens = generated(base, data, row)
    text = tok.decode(tokens, skip_special_tokens=False)
    stop = text[len(text) // 3 : len(text) // 2 + 1]
    assert stop
    kept = next(n for n in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:n], skip_special_tokens=False))
    assert kept < len(tokens)
    return row, stop, tokens, kept


def test_output_contract(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm)
    data = prompt_batch(tok, MIXED_PROMPTS)
    out = gen.generate(data, greedy=True)
    keys = {"output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated", "weight_version"}
    # Nothing stops the random model within 12 tokens, so every row hits the cap.
    assert_output_contract(out, data, tok, keys=keys, max_new_tokens=12)
    assert out["weight_version"].dtype == torch.int64 and out["weight_version"].tolist() == [0] * len(MIXED_PROMPTS)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_match_full_forward(tiny_lm, greedy: bool) -> None:
    tok, model = tiny_lm
    temperature = 1.0 if greedy else 0.7
    gen = engine(tiny_lm, temperature=temperature, seed=123)
    data = prompt_batch(tok, MIXED_PROMPTS)
    out = gen.generate(data, greedy=greedy)
    for i in range(len(MIXED_PROMPTS)):
        seq, lps = unpadded(out, i)
        n_in = int(data["input_lengths"][i])
        ref_lp, pred_logits = reference_logprobs(model, seq, n_in, temperature)
        torch.testing.assert_close(lps[n_in:], ref_lp, atol=1e-4, rtol=0)
        if greedy:
            assert torch.equal(pred_logits.argmax(-1), seq[n_in:])


def test_per_row_sampling_overrides(tiny_lm) -> None:
    """Rows of one batch may carry their own temperature, top_k and max_new_tokens."""
    tok, model = tiny_lm
    gen = engine(tiny_lm, temperature=0.7, seed=7)
    data = prompt_batch(
        tok,
        MIXED_PROMPTS[:3],
        temperature=[None, 1.5, 0.0],
        top_k=[None, 1, None],
        max_new_tokens=[5, None, 3],
    )
    out = gen.generate(data)
    assert out["generation_lengths"].tolist() == [5, 12, 3]
    for i, temperature in enumerate([0.7, 1.5, 1.0]):
        seq, lps = unpadded(out, i)
        n_in = int(data["input_lengths"][i])
        ref_lp, pred_logits = reference_logprobs(model, seq, n_in, temperature)
        torch.testing.assert_close(lps[n_in:], ref_lp, atol=1e-4, rtol=0)
        if i > 0:  # top_k=1 and temperature 0 both pick the argmax
            assert torch.equal(pred_logits.argmax(-1), seq[n_in:])
    with pytest.raises(SettingError, match="max_new_tokens has 1 rows"):
        gen.generate(prompt_batch(tok, MIXED_PROMPTS[:2], max_new_tokens=[3]))
    with pytest.raises(SettingError, match="row 0: invalid sampling"):
        gen.generate(prompt_batch(tok, MIXED_PROMPTS[:1], top_p=[0.0]))


def test_greedy_is_deterministic_and_independent_of_batching(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_batch_size=3)
    data = prompt_batch(tok, MIXED_PROMPTS)
    before = gen.stats.batches_run
    a = gen.generate(data, greedy=True)
    assert gen.stats.batches_run - before == 2  # 4 rows, max_batch_size 3
    b = gen.generate(data, greedy=True)
    assert torch.equal(a["output_ids"], b["output_ids"]) and torch.equal(a["logprobs"], b["logprobs"])
    for i in range(len(MIXED_PROMPTS)):  # left padding inside the batch does not change a row
        single = gen.generate(data.slice(i, i + 1), greedy=True)
        assert torch.equal(unpadded(single, 0)[0], unpadded(a, i)[0])
        torch.testing.assert_close(unpadded(single, 0)[1], unpadded(a, i)[1], atol=1e-5, rtol=0)


def test_sampling_is_seeded_and_filters_only_restrict_choice(tiny_lm) -> None:
    tok, model = tiny_lm
    data = prompt_batch(tok, MIXED_PROMPTS)
    kw = {"temperature": 0.9, "top_k": 20, "top_p": 0.5, "max_new_tokens": 10}
    a = engine(tiny_lm, seed=7, **kw).generate(data)
    b = engine(tiny_lm, seed=7, **kw).generate(data)
    c = engine(tiny_lm, seed=8, **kw).generate(data)
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert not torch.equal(a["output_ids"], c["output_ids"])
    greedy = engine(tiny_lm, **kw).generate(data, greedy=True)
    assert not torch.equal(a["output_ids"], greedy["output_ids"])
    for i in range(len(MIXED_PROMPTS)):
        seq, lps = unpadded(a, i)
        n_in = int(data["input_lengths"][i])
        ref_lp, pred_logits = reference_logprobs(model, seq, n_in, 0.9)
        # Reported logprobs are from the unrestricted log_softmax(logits / T) ...
        torch.testing.assert_close(lps[n_in:], ref_lp, atol=1e-4, rtol=0)
        # ... while the sampled tokens respect top-k (ties aside, rank < 20).
        rank = (pred_logits > pred_logits.gather(-1, seq[n_in:, None])).sum(-1)
        assert (rank < 20).all()


def test_stop_strings(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=12)
    data = prompt_batch(tok, MIXED_PROMPTS)
    base = gen.generate(data, greedy=True)
    row, stop, tokens, n_expected = stop_string_case(tok, base, data)

    stops = [None] * len(MIXED_PROMPTS)
    stops[row] = [stop]
    out = gen.generate(prompt_batch(tok, MIXED_PROMPTS, stop_strings=stops), greedy=True)
    assert generated(out, data, row) == tokens[:n_expected]
    assert not bool(out["truncated"][row])
    assert tok.decode(generated(out, data, row), skip_special_tokens=False).find(stop) >= 0
    for i in range(len(MIXED_PROMPTS)):  # other rows are unaffected
        if i != row:
            assert generated(out, data, i) == generated(base, data, i)

    # The same stop string from the config applies to every row and merges with row ones.
    cfg_gen = engine(tiny_lm, max_new_tokens=12, stop_strings=[stop])
    out2 = cfg_gen.generate(
        prompt_batch(tok, MIXED_PROMPTS, stop_strings=[["zzzz-never"]] * len(MIXED_PROMPTS)), greedy=True
    )
    assert generated(out2, data, row) == tokens[:n_expected]
    assert not bool(out2["truncated"][row])


def test_stop_token_ids(tiny_lm) -> None:
    tok, _ = tiny_lm
    data = prompt_batch(tok, MIXED_PROMPTS)
    base = engine(tiny_lm).generate(data, greedy=True)
    row = 1
    tokens = generated(base, data, row)
    stop_tok = tokens[4]
    first = tokens.index(stop_tok)
    out = engine(tiny_lm, stop_token_ids=[stop_tok]).generate(data, greedy=True)
    assert generated(out, data, row) == tokens[: first + 1]  # the stop token is included
    assert int(out["generation_lengths"][row]) == first + 1
    assert not bool(out["truncated"][row])


def test_default_stop_ids_are_eos(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm)
    assert tok.eos_token_id in gen.stop_token_ids
    assert engine(tiny_lm, stop_token_ids=[]).stop_token_ids == frozenset()


def test_max_model_len_cap(tiny_lm) -> None:
    tok, _ = tiny_lm
    data = prompt_batch(tok, ["Hello there", "The final answer is 12 + 7 = 19 and then some more words"])
    lens = data["input_lengths"].tolist()
    limit = lens[0] + 5
    assert lens[1] >= limit
    out = engine(tiny_lm, max_new_tokens=12, max_model_len=limit).generate(data, greedy=True)
    assert out["generation_lengths"].tolist() == [5, 0]
    assert out["truncated"].tolist() == [True, True]
    assert out["unpadded_sequence_lengths"].tolist() == [limit, lens[1]]
    ref = engine(tiny_lm, max_new_tokens=12).generate(data, greedy=True)
    assert generated(out, data, 0) == generated(ref, data, 0)[:5]
    assert torch.equal(out["output_ids"][1, : lens[1]], data["input_ids"][1, : lens[1]])


def test_invalid_inputs(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm)
    data = prompt_batch(tok, MIXED_PROMPTS)
    with pytest.raises(SettingError, match="every input length must be in"):
        gen.generate(BatchedDataDict({"input_ids": data["input_ids"], "input_lengths": torch.tensor([0, 1, 1, 1])}))
    with pytest.raises(SettingError, match="input_lengths has 2 rows"):
        gen.generate(BatchedDataDict({"input_ids": data["input_ids"], "input_lengths": torch.tensor([1, 2])}))
    with pytest.raises(SettingError, match="row 0 holds token ids outside"):
        gen.generate(BatchedDataDict({"input_ids": torch.tensor([[10**6]]), "input_lengths": torch.tensor([1])}))
    with pytest.raises(SettingError, match="row 0: seed must be an int or None, got True"):
        gen.generate(prompt_batch(tok, MIXED_PROMPTS[:1], seed=[True]))


async def test_generate_async_yields_every_row_once(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)
        ref = gen.generate(data, greedy=True)
        seen: list[int] = []
        async for i, out in gen.generate_async(data, greedy=True):
            seen.append(i)
            assert out["output_ids"].shape == (1, data["input_ids"].shape[1] + int(out["generation_lengths"][0]))
            assert out["output_ids"].dtype == torch.int64 and out["logprobs"].dtype == torch.float32
            assert torch.equal(unpadded(out, 0)[0], unpadded(ref, i)[0])
            torch.testing.assert_close(unpadded(out, 0)[1], unpadded(ref, i)[1], atol=1e-5, rtol=0)
            assert bool(out["truncated"][0]) == bool(ref["truncated"][i])
        assert sorted(seen) == list(range(len(MIXED_PROMPTS)))
    finally:
        gen.shutdown()


async def test_concurrent_requests_are_batched(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=8)
    try:
        prompts = [f"Request number {i}: what is {i} + {i}?" for i in range(16)]
        expected = [gen.generate(prompt_batch(tok, [p]), greedy=True) for p in prompts]
        assert gen.stats.async_batches_run == 0

        async def one(p: str):
            results = [item async for item in gen.generate_async(prompt_batch(tok, [p]), greedy=True)]
            assert len(results) == 1 and results[0][0] == 0
            return results[0][1]

        outs = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=120)
        for out, exp in zip(outs, expected):
            assert torch.equal(unpadded(out, 0)[0], unpadded(exp, 0)[0])
            torch.testing.assert_close(unpadded(out, 0)[1], unpadded(exp, 0)[1], atol=1e-4, rtol=0)
        assert 1 <= gen.stats.async_batches_run < 16
        assert gen.stats.max_rows_in_batch > 1
    finally:
        gen.shutdown()


async def test_event_loop_stays_responsive(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=96, stop_token_ids=[], max_batch_size=8)
    try:
        data = prompt_batch(tok, MIXED_PROMPTS * 2)
        ticks = 0
        running = True

        async def ticker() -> None:
            nonlocal ticks
            while running:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        ticks_at_rows = [ticks async for _ in gen.generate_async(data, greedy=True)]
        running = False
        await task
        assert len(ticks_at_rows) == 8
        # The loop ran other work while the rows were decoding: a blocked loop would reach the first row at 0.
        assert ticks_at_rows[0] > 0, ticks_at_rows
    finally:
        gen.shutdown()


async def test_cancellation_does_not_break_worker(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=300, stop_token_ids=[])
    try:
        data = prompt_batch(tok, MIXED_PROMPTS)

        async def consume():
            return [i async for i, _ in gen.generate_async(data, greedy=True)]

        task = asyncio.create_task(consume())
        await async_wait_until(lambda: gen.stats.forward_passes > 0, 60, "a forward pass")  # the batch is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker keeps serving: a new request completes and matches the blocking path.
        short = prompt_batch(tok, ["Hello there"])
        got = await asyncio.wait_for(_collect(gen, short), timeout=120)
        assert gen._worker is not None and gen._worker.is_alive()
        # The cancelled rows were dropped mid-batch, never finished.
        assert gen.stats.rows_generated == 1
        ref = gen.generate(short, greedy=True)
        assert torch.equal(unpadded(got[0], 0)[0], unpadded(ref, 0)[0])
        assert int(got[0]["generation_lengths"][0]) == 300
    finally:
        gen.shutdown()


async def _collect(gen: HFGeneration, data: BatchedDataDict) -> dict[int, BatchedDataDict]:
    return {i: out async for i, out in gen.generate_async(data, greedy=True)}


async def test_shutdown_is_idempotent_and_fails_waiters(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=2000, max_model_len=2048, stop_token_ids=[])
    data = prompt_batch(tok, MIXED_PROMPTS)

    async def consume():
        return [i async for i, _ in gen.generate_async(data, greedy=True)]

    task = asyncio.create_task(consume())
    await async_wait_until(lambda: gen.stats.forward_passes > 0, 60, "a forward pass")  # the batch is running
    worker = gen._worker
    assert worker is not None and worker.is_alive()
    done = threading.Event()
    await asyncio.to_thread(lambda: (gen.shutdown(), done.set()))
    assert done.is_set() and not worker.is_alive()
    with pytest.raises(EngineShutDownError):
        await asyncio.wait_for(task, timeout=30)  # the waiter is failed, not left hanging
    assert gen.shutdown() is True and gen.shutdown() is True
    with pytest.raises(EngineShutDownError):
        gen.generate(data, greedy=True)
    with pytest.raises(EngineShutDownError):
        async for _ in gen.generate_async(data):
            pass


async def test_a_failure_in_the_first_step_of_a_new_batch_reaches_its_waiters(tiny_lm, monkeypatch) -> None:
    """The batch is created and fails inside one worker turn: its rows still get the error."""
    from gym_bridge.generation import hf_decode

    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=8)

    def broken_step(self) -> None:
        raise RuntimeError("decode step failed")

    monkeypatch.setattr(hf_decode.RunningBatch, "step", broken_step)
    with pytest.raises(RuntimeError, match="decode step failed"):
        await asyncio.wait_for(_collect(gen, prompt_batch(tok, MIXED_PROMPTS[:2])), timeout=30)
    monkeypatch.undo()
    outs = await asyncio.wait_for(
        _collect(gen, prompt_batch(tok, MIXED_PROMPTS[:2])), timeout=60
    )  # the worker lives on
    assert sorted(outs) == [0, 1]
    gen.shutdown()


def test_loads_from_config_path(tiny_model_dir: Path, tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = HFGeneration({"model": str(tiny_model_dir), "max_new_tokens": 4})
    try:
        assert gen.tokenizer.pad_token_id == tok.pad_token_id
        assert gen.max_model_len == 2048
        data = prompt_batch(tok, ["Hello there"])
        a = gen.generate(data, greedy=True)
        b = engine(tiny_lm, max_new_tokens=4).generate(data, greedy=True)
        assert torch.equal(a["output_ids"], b["output_ids"])
    finally:
        assert gen.shutdown() and gen.shutdown()


def test_config_from_generation_config() -> None:
    gen_cfg = {
        "backend": "hf",
        "model_name": "tiny",
        "max_new_tokens": 33,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 5,
        "val_temperature": 0.0,
        "stop_token_ids": None,
        "stop_strings": ["</answer>"],
    }
    cfg = HFGenerationConfig.from_generation_config(gen_cfg, max_batch_size=4)
    assert (cfg.model, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k) == ("tiny", 33, 0.8, 0.9, 5)
    assert cfg.stop_token_ids is None and cfg.stop_strings == ["</answer>"] and cfg.max_batch_size == 4
    val = HFGenerationConfig.from_generation_config(gen_cfg, validation=True)
    assert val.temperature == 0.0 and val.top_p == 0.9
    with pytest.raises(ValueError):
        HFGenerationConfig(temperature=-1.0)


def _own_copy(tiny_lm) -> tuple[HFGeneration, dict[str, torch.Tensor], torch.nn.Module]:
    """An engine over a private copy of the tiny model, new weights for it, and a model holding those weights."""
    import copy

    tok, model = tiny_lm
    gen = HFGeneration(HFGenerationConfig(max_new_tokens=12), model=copy.deepcopy(model), tokenizer=tok)
    torch.manual_seed(1)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    refitted = copy.deepcopy(model)
    refitted.load_state_dict(new_weights)
    return gen, new_weights, refitted


def test_update_weights_reaches_the_engine(tiny_lm) -> None:
    tok, model = tiny_lm
    gen, new_weights, refitted = _own_copy(tiny_lm)
    data = prompt_batch(tok, MIXED_PROMPTS, temperature=[0.8] * len(MIXED_PROMPTS))
    before = gen.generate(data)
    assert gen.weight_version == 0 and before["weight_version"].tolist() == [0] * len(MIXED_PROMPTS)

    gen.update_weights(new_weights, 1)
    after = gen.generate(data)
    assert gen.weight_version == 1 and after["weight_version"].tolist() == [1] * len(MIXED_PROMPTS)
    for i in range(len(MIXED_PROMPTS)):
        seq, lps = unpadded(after, i)
        n_in = int(data["input_lengths"][i])
        new_lp, _ = reference_logprobs(refitted, seq, n_in, 0.8)
        old_lp, _ = reference_logprobs(model, seq, n_in, 0.8)
        torch.testing.assert_close(lps[n_in:], new_lp, atol=1e-4, rtol=0)
        assert (lps[n_in:] - old_lp).abs().max() > 1e-3  # the old weights would not explain them

    with pytest.raises(SettingError, match="older than"):
        gen.update_weights(new_weights, 0)
    with pytest.raises(RuntimeError, match="Missing key"):
        gen.update_weights({k: v for k, v in list(new_weights.items())[1:]}, 2)
    assert gen.weight_version == 1


async def test_a_request_in_flight_at_a_refit_finishes_on_one_version(tiny_lm) -> None:
    tok, model = tiny_lm
    gen, new_weights, refitted = _own_copy(tiny_lm)
    try:
        long = prompt_batch(tok, ["Hello there"], max_new_tokens=[200])
        in_flight = asyncio.create_task(_collect(gen, long))
        await async_wait_until(lambda: gen.stats.forward_passes > 0, 60, "the row decoding")
        assert not in_flight.done()
        refit = asyncio.create_task(asyncio.to_thread(gen.update_weights, new_weights, 1))
        old = (await asyncio.wait_for(in_flight, timeout=120))[0]
        await asyncio.wait_for(refit, timeout=120)
        later = (await asyncio.wait_for(_collect(gen, prompt_batch(tok, ["Hello there"])), timeout=120))[0]
    finally:
        gen.shutdown()
    assert int(old["generation_lengths"][0]) == 200 and old["weight_version"].tolist() == [0]
    assert later["weight_version"].tolist() == [1]
    n_in = int(long["input_lengths"][0])
    for out, weights in ((old, model), (later, refitted)):
        seq, lps = unpadded(out, 0)
        expected, _ = reference_logprobs(weights, seq, n_in, 1.0)
        torch.testing.assert_close(lps[n_in:], expected, atol=1e-4, rtol=0)


async def test_rows_joining_a_running_batch_decode_as_alone(tiny_lm) -> None:
    tok, _ = tiny_lm
    gen = engine(tiny_lm, max_new_tokens=40, stop_token_ids=[], batch_wait_s=0.0)
    try:
        prompts = [f"Request number {i}: what is {i} + {i}?" for i in range(6)]
        alone = [gen.generate(prompt_batch(tok, [p]), greedy=True) for p in prompts]
        passes = gen.stats.forward_passes
        first = asyncio.create_task(_collect(gen, prompt_batch(tok, prompts[:1])))
        await async_wait_until(lambda: gen.stats.forward_passes > passes + 2, 60, "the first row decoding")
        assert not first.done()
        late = [asyncio.create_task(_collect(gen, prompt_batch(tok, [p]))) for p in prompts[1:]]
        outs = [(await asyncio.wait_for(t, timeout=120))[0] for t in [first, *late]]
        # The late rows joined the running batch instead of waiting for it to end ...
        assert gen.stats.rows_joined_running_batch >= 1 and gen.stats.max_rows_in_batch >= 2
        assert gen.stats.async_batches_run == 1
        # ... and decoded exactly what they decode alone.
        for out, ref in zip(outs, alone):
            assert torch.equal(unpadded(out, 0)[0], unpadded(ref, 0)[0])
            torch.testing.assert_close(unpadded(out, 0)[1], unpadded(ref, 0)[1], atol=1e-4, rtol=0)
    finally:
        gen.shutdown()


# ---- the token choice and the worker's threads ---------------------------------------------------------------


def reference_pick(logits: torch.Tensor, rows: list[Row], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The token choice as it was: one ``torch.multinomial`` over the rows without a generator (greedy ones too),
    then one exponential draw per seeded sampled row, each row's division and argmax apart."""
    greedy = torch.tensor([r.greedy for r in rows])
    temps = torch.tensor([1.0 if r.greedy else r.sampling.temperature for r in rows])
    scaled = logits / temps[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        probs = torch.softmax(restricted(scaled, rows), dim=-1)
        sampled = tokens.clone()
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            index = torch.tensor(shared)
            sampled[index] = torch.multinomial(probs[index], 1, generator=generator).squeeze(-1)
        for j, r in enumerate(rows):
            if not r.greedy and r.generator is not None:
                q = torch.empty_like(probs[j]).exponential_(generator=r.generator)
                sampled[j] = torch.argmax(probs[j] / q)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def choice_rows(kinds: list[tuple[float, float, int | None, int | None]]) -> list[Row]:
    """One row per ``(temperature, top_p, top_k, seed)``; temperature 0 is greedy, a seed gives the row its generator."""
    return [
        Row(
            prompt=[1],
            stop_strings=(),
            greedy=t == 0.0,
            sampling=RowSampling(temperature=t, top_p=p, top_k=k, max_new_tokens=8, seed=s),
            generator=None if s is None else torch.Generator().manual_seed(s),
        )
        for t, p, k, s in kinds
    ]


MIXED_ROWS = [(0.0, 1.0, None, 3), (1.0, 1.0, None, None), (0.7, 1.0, None, 11), (1.0, 1.0, 5, None),
              (1.3, 0.5, None, 12), (0.0, 1.0, None, None), (1.0, 1.0, None, 13), (0.5, 0.9, 40, None)]  # fmt: skip


@pytest.mark.parametrize(
    "kinds",
    [
        MIXED_ROWS,
        [(1.0, 1.0, None, None)] * 4,  # the arith eval's rows: unseeded, temperature 1, no filter
        [(1.0, 1.0, None, 7), (1.0, 1.0, None, 8)],  # seeded only
        [(0.0, 1.0, None, None), (0.0, 1.0, None, 4)],  # greedy only: no draw at all
    ],
    ids=["mixed", "unseeded", "seeded", "greedy"],
)
def test_the_token_choice_draws_what_multinomial_drew(kinds) -> None:
    """``pick_tokens`` (one division and one argmax for the batch, no logits copy at temperature 1) gives the tokens
    and bit-identical logprobs of the choice it replaced, step after step, and takes the same draws from every
    generator."""
    old_rows, new_rows = choice_rows(kinds), choice_rows(kinds)
    old_gen, new_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for step in range(4):
        logits = 3 * torch.randn(len(kinds), 300, generator=torch.Generator().manual_seed(step))
        want_tokens, want_lp = reference_pick(logits, old_rows, old_gen)
        tokens, lp = pick_tokens(logits, new_rows, new_gen)
        assert torch.equal(tokens, want_tokens), step
        assert torch.equal(lp, want_lp), step
    assert torch.equal(torch.rand(4, generator=old_gen), torch.rand(4, generator=new_gen))
    for old, new in zip(old_rows, new_rows, strict=True):
        if old.generator is not None and new.generator is not None:
            assert torch.equal(torch.rand(4, generator=old.generator), torch.rand(4, generator=new.generator))


def test_a_distribution_that_is_not_one_is_refused_as_multinomial_refuses_it() -> None:
    rows = choice_rows([(1.0, 1.0, None, None)])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            pick_tokens(torch.full((1, 10), bad), rows, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        check_distribution(torch.zeros(1, 10))


def test_the_worker_decodes_with_its_own_thread_count(tiny_lm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker thread decodes with ``num_threads``; the caller's count and the count of threads started later
    stay as they were (a trainer in the same process keeps its threads)."""
    tok, _ = tiny_lm
    before = torch.get_num_threads()
    seen: list[int] = []
    real_step = RunningBatch.step

    def step(self: RunningBatch) -> None:
        seen.append(torch.get_num_threads())
        real_step(self)

    monkeypatch.setattr(RunningBatch, "step", step)
    gen = engine(tiny_lm, num_threads=before + 1, max_new_tokens=3)
    try:
        asyncio.run(_collect(gen, prompt_batch(tok, ["Say hi."])))
    finally:
        gen.shutdown()
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen and set(seen) == {before + 1}
    assert torch.get_num_threads() == before and later == [before]
