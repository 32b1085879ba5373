"""Hostile values in eval and training configs, through the real ``gym-bridge eval`` / ``gym-bridge train`` entry point
(``cli.main``, in process): a non-finite number (``temperature: inf``, ``rollout_timeout_s: .inf``,
``pass_threshold: .nan``), a YAML ``!!binary`` or unquoted date in ``gym_overrides``, an override key with an empty
part (``++=1``), a key or value nested 3,000 deep, an integer of 5,000 digits: each is one line naming the key, exit
2, before Ray starts, with no run folder left. The values NeMo-RL's own Gym recipes hold (``-1`` for "never",
10^10 scheduler iterations) are still taken. A Hypothesis test sends generated overrides (keys, YAML tags, dates,
deep nesting, non-finite numbers) through both override parsers and the config models: a typed config or one config
error line, nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from test_hostile_cli_options import one_line, run_main

import gym_bridge.ray_utils
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.values import MAX_CONFIG_DEPTH, check_values
from gym_bridge.eval.config import EvalConfig, EvalConfigError, build_config, load_config

REPO = Path(__file__).resolve().parents[2]
EVAL = REPO / "examples" / "eval_equivalence_tools.yaml"
TRAIN = REPO / "examples" / "grpo_nemo_gym.yaml"
RECIPE_VALUES = REPO / "tests" / "data" / "nemo_rl_gym_recipe_keys.yaml"
DEEP_VALUE = "[" * 3000 + "]" * 3000
DEEP_KEY = ".".join(["a"] * 3000)
HUGE_INT = "7" * 5000

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``init_ray`` replaced by a recorder: a refusal that came after Ray started shows up as a call."""
    calls: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise RuntimeError("Ray started before the config was refused")

    monkeypatch.setattr(gym_bridge.ray_utils, "init_ray", refuse)
    return calls


EVAL_OVERRIDES = [
    ("temperature=inf", "override temperature: 'inf' is not a finite number"),
    ("temperature=.inf", "override temperature: inf is not a finite number"),
    ("rollout_timeout_s=inf", "override rollout_timeout_s: 'inf' is not a finite number"),
    ("rollout_timeout_s=1e300", "rollout_timeout_s: Input should be less than or equal to 2592000"),
    ("pass_threshold=.nan", "override pass_threshold: nan is not a finite number"),
    ("retry.backoff_base_s=-.inf", "override retry.backoff_base_s: -inf is not a finite number"),
    ("admission.drain_timeout_s=1e999", "override admission.drain_timeout_s: '1e999' is not a finite number"),
    ("gym_overrides.judge.threshold=.nan", "override gym_overrides.judge.threshold: nan is not a finite number"),
    ("gym_overrides.x=!!binary aGVsbG8=", "override gym_overrides.x: key (top): bytes (!!binary), not a JSON value"),
    ("gym_overrides.x={when: 2026-12-01}", "override gym_overrides.x: key when: a date, not a JSON value"),
    ("++=1", "override ++: eval overrides are key=value"),
    ("a..b=1", "override a..b: the key has an empty part"),
    (".=1", "override .: the key has an empty part"),
    (f"gym_overrides.{DEEP_KEY}=1", "characters long (at most 1,000)"),
    (f"gym_overrides.{'.'.join(['a'] * 40)}=1", "the key has 41 dotted parts (at most 32)"),
    (f"gym_overrides.x={DEEP_VALUE}", "override gym_overrides.x: nested too deeply to read"),
    (f"gym_overrides.x={'[' * 80}{']' * 80}", f"nested deeper than {MAX_CONFIG_DEPTH} levels"),
    (f"seed={HUGE_INT}", "override seed: a value that cannot be read (Exceeds the limit (4300 digits)"),
    ("seed=18446744073709551616", "override seed: an integer of 65 bits, past 64 bits"),
    ("concurrency=10000000000000", "concurrency: Input should be less than or equal to 1000000"),
    ("temperature=101", "temperature: Input should be less than or equal to 100"),
    ("top_p=0", "top_p: Input should be greater than 0"),
]  # fmt: skip


@pytest.mark.parametrize(("override", "says"), EVAL_OVERRIDES, ids=[o[:40] for o, _ in EVAL_OVERRIDES])
def test_eval_refuses_a_hostile_override_in_one_line_before_anything_starts(capsys, tmp_path, no_ray, override, says):
    out = tmp_path / "run"
    code, err = run_main(capsys, "eval", str(EVAL), f"output_dir={out}", override)
    line = one_line(err, "gym-bridge eval: ")
    assert code == 2 and says in line, line
    assert not out.exists() and no_ray == [], "nothing started, no run folder"


EVAL_FILES = [
    ("temperature: inf\n", "temperature: 'inf' is not a finite number"),
    ("rollout_timeout_s: .inf\n", "rollout_timeout_s: inf is not a finite number"),
    ("pass_threshold: .nan\n", "pass_threshold: nan is not a finite number"),
    ("gym_overrides:\n  x: !!binary aGVsbG8=\n", "key gym_overrides.x: bytes (!!binary), not a JSON value"),
    ("gym_overrides:\n  judge:\n    since: 2026-12-01\n", "key gym_overrides.judge.since: a date, not a JSON value"),
    ("gym_overrides:\n  x: !!set {a, b}\n", "key gym_overrides.x: a set, not a JSON value"),
]


@pytest.mark.parametrize(("lines", "says"), EVAL_FILES, ids=[says.split(":")[0] for _, says in EVAL_FILES])
def test_eval_refuses_a_hostile_value_in_its_config_file(capsys, tmp_path, no_ray, lines, says):
    config = tmp_path / "eval.yaml"
    config.write_text(EVAL.read_text() + lines)
    out = tmp_path / "run"
    code, err = run_main(
        capsys, "eval", str(config), f"output_dir={out}", f"dataset={REPO / 'examples/data/gym_rows.jsonl'}"
    )
    line = one_line(err, "gym-bridge eval: ")
    assert code == 2 and says in line, line
    assert not out.exists() and no_ray == []


def test_eval_takes_greedy_sampling_and_finite_extremes():
    config = load_config(EVAL, ["temperature=0", "pass_threshold=-1e300", "rollout_timeout_s=2592000", "seed=0"])
    assert (config.temperature, config.pass_threshold, config.rollout_timeout_s) == (0.0, -1e300, 2592000.0)


def test_the_eval_model_refuses_non_finite_numbers_given_in_python():
    data = {**yaml.safe_load(EVAL.read_text()), "pass_threshold": float("nan")}
    with pytest.raises(Exception, match=r"pass_threshold: nan is not a finite number"):
        EvalConfig.model_validate(data)


TRAIN_OVERRIDES = [
    ("policy.generation.temperature=inf", "the command line: policy.generation.temperature: inf is not a finite"),
    ("grpo.pass_threshold=nan", "the command line: grpo.pass_threshold: nan is not a finite number"),
    ("++env.nemo_gym.rollout_timeout_s=inf", "the command line: env.nemo_gym.rollout_timeout_s: inf is not a finite"),
    ("policy.generation.top_p='-inf'", "policy.generation.top_p: '-inf' is not a finite number"),
    ("++=1", "override ++=1: the key is empty"),
    ("+=1", "override +=1: the key is empty"),
    (f"+x={DEEP_VALUE}", "override: nested too deeply to read"),
    (f"+x={'[' * 80}{']' * 80}", f"nested deeper than {MAX_CONFIG_DEPTH} levels"),
    (f"+{DEEP_KEY}=1", "characters long (at most 1,000)"),
    (f"+{'.'.join(['a'] * 40)}=1", "the key has 40 dotted parts (at most 32)"),
    (f"+x={HUGE_INT}", "Exceeds the limit (4300 digits)"),
    ("++x=18446744073709551616", "the command line: x: an integer of 65 bits, past 64 bits"),
    ("grpo.num_generations_per_prompt=10000000", "grpo.num_generations_per_prompt must be an integer from 1 to"),
    ("policy.generation.temperature=hot", "policy.generation.temperature"),
]  # fmt: skip


@pytest.mark.parametrize(("override", "says"), TRAIN_OVERRIDES, ids=[o[:40] for o, _ in TRAIN_OVERRIDES])
def test_train_refuses_a_hostile_override_in_one_line_before_anything_starts(capsys, tmp_path, no_ray, override, says):
    out = tmp_path / "run"
    code, err = run_main(capsys, "train", str(TRAIN), "--out", str(out), override)
    line = one_line(err, "gym-bridge train: ")
    assert code == 2 and says in line, line
    assert not out.exists() and no_ray == [], "nothing started, no run folder"


TRAIN_FILES = [
    ("env:\n  nemo_gym:\n    x: !!binary aGVsbG8=\n", "key env.nemo_gym.x: bytes (!!binary), not a JSON value"),
    ("env:\n  nemo_gym:\n    judge:\n      since: 2026-12-01\n", "key env.nemo_gym.judge.since: a date, not a JSON"),
    ("policy:\n  generation:\n    temperature: inf\n", "policy.generation.temperature: 'inf' is not a finite number"),
    ("grpo:\n  pass_threshold: .nan\n", "grpo.pass_threshold: nan is not a finite number"),
    ("loss_fn:\n  ratio_clip_c: ${mul:1e300,1e300}\n", "loss_fn.ratio_clip_c: inf is not a finite number"),
]


@pytest.mark.parametrize(("lines", "says"), TRAIN_FILES, ids=[says.split(":")[0] for _, says in TRAIN_FILES])
def test_train_refuses_a_hostile_value_in_its_config_file(capsys, tmp_path, no_ray, lines, says):
    config = tmp_path / "train.yaml"
    config.write_text(f"defaults: {TRAIN}\n{lines}")
    out = tmp_path / "run"
    code, err = run_main(capsys, "train", str(config), "--out", str(out))
    line = one_line(err, "gym-bridge train: ")
    assert code == 2 and says in line, line
    assert not out.exists() and no_ray == []


def test_every_value_of_nemo_rls_gym_recipes_is_still_taken():
    """-1 for "never" (``grpo.val_period``), 2^39-byte buffers, 10^10 scheduler iterations: NeMo-RL's own values."""
    recipes = yaml.safe_load(RECIPE_VALUES.read_text())["keys"]
    check_values(recipes, "NeMo-RL's recipes")
    assert -1 in recipes["grpo.val_period"] and 549755813888 in recipes["data_plane.global_segment_size"]
    config = load_with_overrides(TRAIN, ["grpo.max_num_steps=1000000", "++grpo.val_start_at=-1"])
    assert config["grpo"]["max_num_steps"] == 1000000 and config["grpo"]["val_start_at"] == -1


# ---- generated overrides: a typed config or one config error line, nothing else ------------------------------------

KEY_PART = st.sampled_from(["temperature", "seed", "gym_overrides", "retry", "x", "", " ", "a-b", "+", "~", "é", "0"])
KEYS = st.lists(KEY_PART, min_size=1, max_size=6).map(".".join) | st.sampled_from(["++", "+x", "~x", "", DEEP_KEY])
SCALARS = st.sampled_from(
    [
        "inf", "-inf", ".inf", "-.Inf", ".nan", "NaN", "nan", "1e999", "-1e999", "1.0e400", "'inf'", "0", "-1", "1.5",
        "2026-12-01", "2026-12-01T10:00:00Z", "12:30:00", "!!binary aGk=", "!!set {a}", "!!timestamp 2026-01-01",
        "!!python/object:os.system x", "!!str 1", "!!float inf", "~", "null", "true", "yes", "0x10", "0o7", "1_000",
        HUGE_INT, "18446744073709551616", "&a [*a]", "*a", "{a: 1", "[1, 2", "? a", "'", "", "x: y", "\x00", "\x1b[2J",
    ]
)  # fmt: skip
NESTED = st.builds(lambda depth, inner: "[" * depth + inner + "]" * depth, st.integers(0, 3000), SCALARS)
VALUES = SCALARS | NESTED | st.text(max_size=20)


def refused_in_one_line(exc: BaseException) -> None:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message


@PROPERTY
@given(key=KEYS, value=VALUES)
def test_a_generated_eval_override_is_a_config_or_one_config_error(key, value):
    base = yaml.safe_load(EVAL.read_text())
    try:
        config = build_config(base, [f"{key}={value}"])
    except EvalConfigError as exc:
        refused_in_one_line(exc)
        return
    assert isinstance(config, EvalConfig)
    check_values(config.model_dump(mode="python"), "the config taken")


@pytest.fixture(scope="module")
def small_training_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training config of a few keys: the override path without the demo's parents read on every example."""
    path = tmp_path_factory.mktemp("train") / "small.yaml"
    path.write_text("grpo:\n  seed: 0\n  pass_threshold: 1.0\npolicy:\n  generation:\n    temperature: 1.0\n")
    return path


TRAIN_KEYS = st.lists(KEY_PART, min_size=1, max_size=6).map(".".join)
TRAIN_FORMS = st.sampled_from(["", "+", "++", "~"])


@PROPERTY
@given(form=TRAIN_FORMS, key=TRAIN_KEYS | st.sampled_from(["grpo.seed", "policy.generation.temperature"]), value=VALUES)
def test_a_generated_training_override_is_a_config_or_one_config_error(small_training_config, form, key, value):
    override = f"{form}{key}" if form == "~" else f"{form}{key}={value}"
    try:
        config = load_with_overrides(small_training_config, [override])
    except TrainingConfigError as exc:
        refused_in_one_line(exc)
        return
    assert isinstance(config, dict)
    check_values(config, "the config taken")
