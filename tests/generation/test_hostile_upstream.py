"""Upstream answers and Gym results as untrusted: size caps before and after decompression, checked fields."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.failures import GymResultError, RolloutDataFailure
from gym_bridge.generation.completions_wire import parse_completion
from gym_bridge.generation.upstream_answer import BodyReader
from gym_bridge.gym.protocol.result_fields import gym_row_result

CAP = 1 << 20


def _answer(ids: object, logprobs: object, finish: object = "stop") -> dict[str, object]:
    return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logprobs}, "finish_reason": finish}]}


def test_a_gzip_bomb_is_refused_without_decompressing_past_the_cap() -> None:
    """1 GB of zeros gzipped (~1 MB) fed in 64 KiB chunks: refused once the decoded body passes the cap."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    reader = BodyReader({"content-encoding": "gzip"}, "bomb", max_bytes=CAP)
    with pytest.raises(UntrustedInputError, match="larger than 1 MiB"):
        for _ in range(1 << 14):
            reader.feed(packer.compress(bytes(1 << 16)))
    assert len(reader._out) == 0


def test_a_plain_body_past_the_cap_is_refused_and_a_small_gzip_one_decoded() -> None:
    with pytest.raises(UntrustedInputError, match="larger than"):
        BodyReader({}, "plain", max_bytes=CAP).feed(bytes(CAP + 1))
    with pytest.raises(UntrustedInputError, match="larger than"):
        BodyReader({"content-length": str(CAP + 1)}, "declared", max_bytes=CAP)
    reader = BodyReader({"content-encoding": "gzip"}, "small", max_bytes=CAP)
    reader.feed(gzip.compress(b'{"a": 1}'))
    assert reader.body() == b'{"a": 1}'
    with pytest.raises(UntrustedInputError, match="Content-Encoding"):
        BodyReader({"content-encoding": "gzip, gzip"}, "stacked")


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        (_answer([5, 100], [-0.1, -0.2]), r"token_ids\[1\] = 100"),
        (_answer([2**33], [-0.1]), r"token_ids\[0\]"),
        (_answer([5], [0.5]), r"token_logprobs\[0\] = 0.5"),
        (_answer([5], [-0.1], 42), "finish_reason = 42"),
        (_answer([5, 6], [-0.1]), "1 token_logprobs for 2"),
    ],
)
def test_a_bad_answer_is_a_502_naming_the_field(answer: dict[str, object], field: str) -> None:
    with pytest.raises(RolloutDataFailure, match=field) as caught:
        parse_completion(answer, "http://up/v1", vocab_size=50)
    assert caught.value.http_status == 502


@pytest.mark.parametrize("reward", ["1.0", True, float("inf"), None, [1]])
def test_a_gym_reward_that_is_not_a_finite_number_is_refused(reward: object) -> None:
    with pytest.raises(GymResultError, match="reward"):
        gym_row_result(0, [], {"reward": reward})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _answers(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(0, 4))
    ids = draw(st.lists(st.integers(0, 49), min_size=n, max_size=n))
    logprobs = draw(st.lists(st.floats(max_value=0, allow_nan=False), min_size=n, max_size=n))
    answer = _answer(ids, logprobs, draw(st.sampled_from(["stop", "length"])))
    if draw(st.booleans()):
        choice = answer["choices"][0]  # type: ignore[index]
        key = draw(st.sampled_from(["token_ids", "logprobs", "finish_reason"]))
        choice[key] = draw(_json)
    return answer


@given(_answers())
def test_a_generated_answer_is_parsed_or_one_typed_refusal(answer: dict[str, object]) -> None:
    try:
        ids, logprobs, _ = parse_completion(answer, "http://up/v1", vocab_size=50)
    except RolloutDataFailure as exc:
        assert "\n" not in str(exc)
    else:
        assert all(0 <= i < 50 for i in ids) and all(v <= 0 for v in logprobs) and len(ids) == len(logprobs)


def test_a_gym_token_id_of_2_to_the_33_is_a_typed_refusal(tiny_tokenizer) -> None:
    from gym_bridge.gym.protocol.convert import convert_gym_result

    item = {
        "type": "message",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [2**33],
        "generation_log_probs": [-0.1],
    }
    with pytest.raises(GymResultError, match="token ids hold one the tokenizer cannot decode"):
        convert_gym_result({"reward": 1.0, "response": {"output": [item]}}, tiny_tokenizer)
