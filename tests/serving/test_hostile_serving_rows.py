"""Issue 49 (items 5, 6): a row of the engine's running batch that fails, fails alone.

Row sampling is bounded where a row is built (``hf_rows``), as vLLM bounds a request's; and when choosing one
row's token, checking its stop strings or prefilling it still raises (or gives a NaN logprob), only that row
leaves the batch with a ``RowFailure``: the rows decoding beside it finish. The real tiny model throughout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from gym_bridge.failures import SettingError
from gym_bridge.generation.decode_row import Row, RowFailure, RowResult
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig, RowSampling
from gym_bridge.generation.hf_decode import RunningBatch, decode_to_end
from gym_bridge.generation.hf_rows import MIN_TEMPERATURE, row_sampling, row_top_k

MAX_NEW = 6
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def gen(tiny_lm) -> Iterator[HFGeneration]:
    tok, model = tiny_lm
    engine = HFGeneration(
        HFGenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, seed=0), model=model, tokenizer=tok
    )
    yield engine
    engine.shutdown()


def row(prompt: list[int], *, temperature: float = 1.0, seed: int | None = None, stops: tuple[str, ...] = ()) -> Row:
    """A sampled row of ``MAX_NEW`` tokens; seeded rows draw from their own generator."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return Row(
        prompt=list(prompt),
        stop_strings=stops,
        greedy=False,
        sampling=RowSampling(temperature, 1.0, None, MAX_NEW, seed),
        generator=generator,
    )


def decode(gen: HFGeneration, rows: list[Row]) -> dict[int, RowResult | BaseException]:
    """Every row through one running batch (worker style: each row's outcome is delivered); index -> outcome."""
    outcomes: dict[int, RowResult | BaseException] = {}
    for i, r in enumerate(rows):
        r.deliver = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    batch = RunningBatch(gen._ctx, 0)
    with torch.inference_mode():
        batch.admit(rows)
        while len(batch):
            batch.step()
    return outcomes


def assert_alone(outcomes: dict[int, RowResult | BaseException], bad: int, why: str) -> None:
    """Row ``bad`` failed with a RowFailure saying ``why``; every other row finished with its tokens."""
    assert set(outcomes) == set(range(len(outcomes)))
    failure = outcomes[bad]
    assert isinstance(failure, RowFailure) and why in str(failure), failure
    for i, outcome in outcomes.items():
        if i != bad:
            assert isinstance(outcome, RowResult), outcome
            assert 1 <= len(outcome.tokens) <= MAX_NEW and all(math.isfinite(v) for v in outcome.logprobs)


# ---- bounded where the row is built ----------------------------------------------------------------------


def test_row_sampling_is_bounded_as_vllm_bounds_it() -> None:
    cfg = HFGenerationConfig(temperature=1.0)
    assert row_sampling(cfg, {"temperature": 1e-300}, row=0).temperature == MIN_TEMPERATURE
    assert row_sampling(cfg, {"temperature": 0.0}, row=0).greedy
    assert row_sampling(cfg, {"top_k": 2**70}, row=0, vocab_size=300).top_k is None, "beyond the vocabulary: all"
    assert row_sampling(cfg, {"top_k": 299}, row=0, vocab_size=300).top_k == 299
    assert row_top_k(-1, 300, row=0) is None and row_top_k(0, 300, row=0) is None
    assert row_sampling(cfg, {"max_new_tokens": 4.0}, row=0).max_new_tokens == 4
    for override, field in [
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"temperature": True}, "temperature must be a number"),
        ({"temperature": "0.5"}, "temperature must be a number"),
        ({"top_p": float("nan")}, "top_p must be finite"),
        ({"top_k": -2}, "top_k must be -1, 0"),
        ({"top_k": True}, "top_k must be an int"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"max_new_tokens": False}, "max_new_tokens must be an int"),
    ]:
        with pytest.raises(SettingError, match=f"row 3: {field}"):
            row_sampling(cfg, override, row=3, vocab_size=300)


# ---- a row that fails inside the batch fails alone -------------------------------------------------------


def test_a_seeded_row_with_a_nan_distribution_fails_alone(gen) -> None:
    """Seeded rows draw by argmax, which does not raise: the NaN logprob is what gives the row away."""
    rows = [row(p, seed=i) for i, p in enumerate(PROMPTS)]
    rows[2] = row(PROMPTS[2], temperature=float("nan"), seed=2)
    assert_alone(decode(gen, rows), 2, "not finite")


def test_an_unseeded_row_whose_draw_raises_fails_alone(gen) -> None:
    """Unseeded rows draw together with one multinomial; a NaN row makes it raise, and the rows are chosen again
    one by one."""
    rows = [row(p) for p in PROMPTS]
    rows[1] = row(PROMPTS[1], temperature=float("nan"))
    assert_alone(decode(gen, rows), 1, "choosing its next token failed: RuntimeError")


def test_a_row_whose_stop_check_raises_fails_alone(gen, monkeypatch) -> None:
    real = RunningBatch._hit_stop_string

    def hit(self: RunningBatch, r: Row) -> bool:
        if "BOOM" in r.stop_strings:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode this row")
        return real(self, r)

    monkeypatch.setattr(RunningBatch, "_hit_stop_string", hit)
    rows = [row(p, seed=i, stops=("zz",)) for i, p in enumerate(PROMPTS)]
    rows[0] = row(PROMPTS[0], seed=0, stops=("BOOM",))
    assert_alone(decode(gen, rows), 0, "its stop check failed: UnicodeDecodeError")


def test_a_row_whose_prefill_raises_fails_alone(gen, monkeypatch) -> None:
    """The group's prefill raises: each row is prefilled by itself, and only the one that fails alone fails."""
    real = RunningBatch._prefill_forward
    poison = PROMPTS[3]

    def prefill(self: RunningBatch, joining: list[Row], names: list[list[bytes]]) -> object:
        if any(r.prompt == poison for r in joining):
            raise RuntimeError("CUDA out of memory (pretend)")
        return real(self, joining, names)

    monkeypatch.setattr(RunningBatch, "_prefill_forward", prefill)
    rows = [row(p, seed=i) for i, p in enumerate(PROMPTS)]
    assert_alone(decode(gen, rows), 3, "its prefill failed: RuntimeError: CUDA out of memory (pretend)")


def test_a_failed_row_joins_no_copy_of_its_prompt(gen, monkeypatch) -> None:
    """With the prefix cache, the N samples of one prompt copy their leader's prefill: when the leader's fails,
    the copies are prefilled themselves instead and finish."""
    real = RunningBatch._prefill_forward
    calls: list[int] = []

    def prefill(self: RunningBatch, joining: list[Row], names: list[list[bytes]]) -> object:
        calls.append(len(joining))
        if len(joining) > 1 or calls.count(1) == 1:  # the group, then the first row alone
            raise RuntimeError("first try fails")
        return real(self, joining, names)

    monkeypatch.setattr(RunningBatch, "_prefill_forward", prefill)
    prompt = list(range(5, 5 + 40))  # two full prefix-cache blocks: the samples wait for their leader's
    rows = [row(prompt, seed=i) for i in range(3)]
    outcomes = decode(gen, rows)
    assert isinstance(outcomes[0], RowFailure) and all(isinstance(outcomes[i], RowResult) for i in (1, 2)), outcomes


def test_a_blocking_call_raises_the_failure_after_the_others_finish(gen) -> None:
    rows = [row(p, seed=i) for i, p in enumerate(PROMPTS)]
    rows[0] = row(PROMPTS[0], temperature=float("nan"), seed=0)
    with pytest.raises(RowFailure, match="not finite"), torch.inference_mode():
        decode_to_end(gen._ctx, rows, 0)
    assert all(r.result is not None and len(r.result.tokens) >= 1 for r in rows[1:])
