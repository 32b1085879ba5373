from __future__ import annotations

import math

import pytest

from gym_bridge.metrics import calculate_single_metric, pct, summarize


def test_calculate_single_metric_keys_and_values():
    out = calculate_single_metric([1, 2, 3, 10], 4, "reward")
    assert set(out) == {
        "reward/mean",
        "reward/max",
        "reward/min",
        "reward/median",
        "reward/stddev",
        "reward/histogram",
    }
    assert out["reward/mean"] == 4.0
    assert out["reward/max"] == 10.0 and out["reward/min"] == 1.0
    assert out["reward/median"] == 2.5
    assert out["reward/stddev"] == pytest.approx(math.sqrt(50 / 3))
    assert out["reward/histogram"] == [1, 2, 3, 10]


def test_values_keep_their_type_as_in_nemo_rl():
    """NeMo-RL casts nothing: an int metric's max, min and histogram stay ints, a bool's max a bool."""
    ints = calculate_single_metric([3, 1, 2], 3, "turns")
    assert type(ints["turns/max"]) is int and type(ints["turns/min"]) is int
    assert [type(v) for v in ints["turns/histogram"]] == [int, int, int]
    assert calculate_single_metric([True, False], 2, "solved")["solved/max"] is True


def test_mean_divides_by_the_batch_size_as_nemo_rl_does():
    # Two of four samples report the metric: NeMo-RL reports 6 / 4 = 1.5, and so do we.
    out = calculate_single_metric([2, 4], 4, "agent/score")
    assert out["agent/score/mean"] == 1.5
    assert out["agent/score/max"] == 4.0 and out["agent/score/stddev"] == pytest.approx(math.sqrt(2))


def test_stddev_is_nan_for_one_value_and_zero_for_identical_values():
    assert math.isnan(calculate_single_metric([5], 1, "k")["k/stddev"])
    assert calculate_single_metric([3, 3, 3], 3, "k")["k/stddev"] == 0.0


def test_median_of_odd_count():
    assert calculate_single_metric([9, 1, 5], 3, "k")["k/median"] == 5.0


def test_empty_values_raise_as_nemo_rl_does():
    with pytest.raises(ValueError):
        calculate_single_metric([], 4, "turns")


def test_pct_empty_is_zero():
    assert pct([], 95) == 0.0


def test_pct_returns_float_and_sorts():
    value = pct([3, 1, 2], 0)
    assert value == 1.0 and isinstance(value, float)
    assert pct([5, 4, 3, 2, 1], 40) == 3.0


def test_pct_clamps_high_percentiles_on_five_items():
    values = [10, 20, 30, 40, 50]
    assert pct(values, 95) == 50.0
    assert pct(values, 99) == 50.0
    assert pct(values, 100) == 50.0


def test_pct_single_value():
    assert pct([7], 50) == 7.0
    assert pct([7], 99) == 7.0


def test_pct_p50_of_four_values_is_the_upper_middle():
    assert pct([1, 2, 3, 4], 50) == 3.0


def test_pct_rejects_out_of_range_percentile():
    with pytest.raises(ValueError):
        pct([1], 101)


def test_summarize_adds_percentiles():
    values = list(range(1, 101))
    out = summarize(values, "tokens")
    assert out["tokens/p95"] == 96.0
    assert out["tokens/p99"] == 100.0
    assert out["tokens/mean"] == 50.5
    out = summarize((v for v in [1, 2]), "g", percentiles=(50, 99.9))
    assert out["g/p50"] == 2.0 and "g/p99.9" in out
