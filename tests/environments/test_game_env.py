"""The number-guessing game, stepped directly (its Ray use is covered by the rollout tests)."""

from __future__ import annotations

import torch

from gym_bridge.environments.guessing import GuessingGameEnvironment, parse_guess


def log(reply):
    return [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": reply}]


def test_parse_guess():
    assert parse_guess("maybe 3, no 42") == 42 and parse_guess("none") is None and parse_guess("-5") == -5


def test_hints_metadata_and_stop_strings_per_turn():
    env = GuessingGameEnvironment(stop_strings_per_turn=[["a"], ["b"]], valid_guess_reward=0.1)
    meta = {"target": 50, "low": 1, "high": 100, "guesses_left": 3}
    ret = env.step([log("20"), log("70"), log("50"), log("?")], [meta, meta, meta, {**meta, "guesses_left": 0}])
    assert ret.rewards.tolist() == [torch.tensor(0.1).item(), torch.tensor(0.1).item(), 1.0, 0.0]
    assert ret.terminateds.tolist() == [False, False, True, True]
    assert "20 is too low. Guess between 21 and 100." in ret.observations[0]["content"]
    assert "70 is too high. Guess between 1 and 69." in ret.observations[1]["content"]
    assert ret.observations[0]["role"] == "user" and ret.observations[2] == {"role": "environment", "content": "You win."}
    assert ret.observations[3]["content"] == "Game over."
    assert ret.metadata[0] == {**meta, "low": 21, "guesses_left": 2, "turn": 1} and ret.metadata[2] is None
    assert ret.next_stop_strings == [["a"], ["a"], None, None]
    assert ret.answers == ["20", "70", "50", None]
    again = env.step([log("30")], [ret.metadata[0]])
    assert again.next_stop_strings == [["b"]] and again.metadata[0]["low"] == 31
    last = env.step([log("x")], [{**again.metadata[0], "turn": 5}])
    assert last.next_stop_strings == [["b"]]  # the last entry repeats
    assert "No number found" in last.observations[0]["content"]
