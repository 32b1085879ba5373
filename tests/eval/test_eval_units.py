"""Unit tests of the eval recipe's parts: pass@k, dataset checks, the run store, the config, the report."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from gym_bridge.eval.config import EvalConfigError, build_config, load_config
from gym_bridge.eval.dataset import DatasetError, load_dataset
from gym_bridge.eval.passk import default_ks, pass_at_k
from gym_bridge.eval.report import build_report
from gym_bridge.eval.store import RunDirError, RunStore, read_jsonl

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "examples" / "data" / "gym_rows.jsonl"
EXAMPLE = REPO / "examples" / "eval_equivalence_tools.yaml"
GOOD_ROW = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}}


# ---- pass@k ----------------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in draw) for draw in draws) / len(draws)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_cases() -> None:
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


def test_pass_at_k_rejects_bad_arguments() -> None:
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    assert default_ks(1) == [1] and default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6]


# ---- dataset ---------------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bundled_dataset_loads() -> None:
    rows = load_dataset(BUNDLED)
    assert [r.prompt_idx for r in rows] == list(range(6))
    assert {r.agent for r in rows} == {"example_single_tool_call_simple_agent", "lc_equivalence_rule_simple_agent"}
    assert len(load_dataset(BUNDLED, limit=2)) == 2


def test_bad_json_is_reported_with_its_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD_ROW), "", json.dumps(GOOD_ROW), "{not json"])
    with pytest.raises(DatasetError, match=r"d\.jsonl:4: not valid JSON"):
        load_dataset(path)


def test_invalid_row_is_reported_with_line_and_field(tmp_path: Path) -> None:
    bad = {"responses_create_params": {"tools": []}, "agent_ref": {"name": "a"}}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD_ROW), json.dumps(bad)])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: .*responses_create_params\.input"):
        load_dataset(path)
    path = write_lines(tmp_path / "e.jsonl", [json.dumps(GOOD_ROW), "[1, 2]"])
    with pytest.raises(DatasetError, match=r"e\.jsonl:2: .*must be a dict"):
        load_dataset(path)


def test_every_bad_line_is_reported_at_once(tmp_path: Path) -> None:
    no_agent = {"responses_create_params": {"input": "hi"}}
    lines = [json.dumps(GOOD_ROW), json.dumps(no_agent), "{bad", json.dumps(GOOD_ROW), json.dumps(no_agent)]
    with pytest.raises(DatasetError) as raised:
        load_dataset(write_lines(tmp_path / "d.jsonl", lines))
    message = str(raised.value)
    assert message.startswith("3 bad line(s):")
    assert "d.jsonl:2: prompt_idx=1: invalid Gym row: agent_ref" in message
    assert "d.jsonl:3: not valid JSON" in message
    assert "d.jsonl:5: prompt_idx=4: invalid Gym row: agent_ref" in message


def test_a_refused_config_or_dataset_stops_before_torch_or_ray(tmp_path: Path) -> None:
    """``gym-bridge eval`` reads the config, the dataset and the run folder, and checks the embedded model's name,
    without importing torch or Ray, so a refused run ends in about a second (only the run loop needs them)."""
    import subprocess
    import sys

    code = (
        "import sys; from gym_bridge import cli; rc = cli.main(sys.argv[1:]); "
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules), file=sys.stderr); sys.exit(rc)"
    )
    bad_rows = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD_ROW), "{bad"])
    for i, (overrides, line) in enumerate((
        (["limit=0"], "limit: Input should be greater than or equal to 1"),
        ([f"dataset={bad_rows}"], "d.jsonl:2: not valid JSON"),
        (["tokenizer=nosuchmodel"], "model 'nosuchmodel' is neither a built-in model"),
    )):
        args = ["eval", str(EXAMPLE), f"output_dir={tmp_path / f'run-{i}'}", *overrides, "--no-progress"]
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 2, done.stderr
        *refusal, imported = done.stderr.strip().splitlines()
        assert line in "\n".join(refusal) and imported == "[]", done.stderr


def test_limit_stops_before_a_later_bad_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD_ROW), "{bad"])
    assert len(load_dataset(path, limit=1)) == 1


def test_eval_command_reports_a_bad_line_before_anything_starts(tmp_path: Path, capsys) -> None:
    from gym_bridge import cli

    data = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD_ROW), json.dumps(GOOD_ROW), "oops"])
    out = tmp_path / "run"
    code = cli.main(["eval", str(EXAMPLE), f"dataset={data}", f"output_dir={out}"])
    assert code == 2
    assert "d.jsonl:3: not valid JSON" in capsys.readouterr().err
    assert not out.exists()  # nothing was opened, let alone dispatched


# ---- store -----------------------------------------------------------------------------------


def test_store_refuses_a_non_empty_folder_without_resume(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("something")
    with pytest.raises(RunDirError, match="not empty.*--resume"):
        RunStore(tmp_path).open({"a": 1}, resume=False)


def test_store_appends_and_resumes_tolerating_a_torn_last_line(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    assert store.open({"n": 2}, resume=False) == set()
    store.append_result({"prompt_idx": 0, "completions": [{"reward": 1.0}, {"reward": 0.25}]})
    store.append_result({"prompt_idx": 2, "completions": [{"reward": 0.5}]})
    with pytest.raises(RunDirError, match="already has a result"):
        store.append_result({"prompt_idx": 2, "completions": []})
    store.close()
    with store.results_path.open("ab") as f:
        f.write(b'{"prompt_idx": 1, "compl')  # a SIGKILL mid-write
    assert [r["prompt_idx"] for r in read_jsonl(store.results_path)] == [0, 2]

    again = RunStore(tmp_path / "run")
    assert again.open({"n": 2}, resume=True) == {0, 2}
    assert again.resumed_rewards == [1.0, 0.25, 0.5], "the finished completions' rewards, read once on resume"
    again.append_result({"prompt_idx": 1, "completions": []})
    again.close()
    assert [r["prompt_idx"] for r in read_jsonl(again.results_path)] == [0, 2, 1]
    assert again.results_path.read_bytes().count(b"\n") == 3


def test_store_raises_on_corruption_before_the_last_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text('{"prompt_idx": 0}\nxx\n{"prompt_idx": 1}\n')
    with pytest.raises(RunDirError, match=r"results\.jsonl:2"):
        read_jsonl(path)


def test_store_refuses_resume_with_a_changed_fingerprint(tmp_path: Path) -> None:
    first = RunStore(tmp_path)
    first.open({"num_generations_per_prompt": 2, "temperature": 1.0}, resume=False)
    first.close()  # the store holds run.lock until it is closed
    with pytest.raises(RunDirError, match=r"num_generations_per_prompt \(2 -> 3\)"):
        RunStore(tmp_path).open({"num_generations_per_prompt": 3, "temperature": 1.0}, resume=True)


# ---- config ----------------------------------------------------------------------------------


def test_example_config_loads_with_overrides() -> None:
    config = load_config(EXAMPLE, ["limit=2", "num_generations_per_prompt=2", "base_urls=[http://h:1/v1]"])
    assert config.limit == 2 and config.num_generations_per_prompt == 2 and not config.embedded
    assert config.embedded_policy == "scripted"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"embedded_policy": "gpt"}, "embedded_policy"),
        ({"base_urls": ["gpu-0:8000"]}, "base_urls.0"),
        ({"num_generation_per_prompt": 2}, "num_generation_per_prompt: unknown key"),
    ],
)
def test_config_errors_name_the_key(data: dict, key: str) -> None:
    base = {"dataset": "d.jsonl", "config_paths": ["c.yaml"], "output_dir": "out"}
    with pytest.raises(EvalConfigError, match=key.replace(".", r"\.")):
        build_config({**base, **data})


def test_missing_keys_and_bad_overrides_are_named(tmp_path: Path) -> None:
    with pytest.raises(EvalConfigError) as info:
        build_config({})
    assert all(k in str(info.value) for k in ("dataset", "output_dir"))
    with pytest.raises(EvalConfigError, match="config_paths: no Gym server config; give config_paths .* or gym_head"):
        build_config({"dataset": "d.jsonl", "output_dir": "o", "model_name": "m", "tokenizer": "t",
                      "base_urls": ["http://127.0.0.1:9/v1"]})  # fmt: skip
    with pytest.raises(EvalConfigError, match="not key=value"):
        load_config(EXAMPLE, ["limit"])
    (tmp_path / "c.yaml").write_text("- a list\n")
    with pytest.raises(EvalConfigError, match="mapping"):
        load_config(tmp_path / "c.yaml")


def test_fingerprint_ignores_what_does_not_matter() -> None:
    a = load_config(EXAMPLE)
    b = load_config(EXAMPLE, ["concurrency=1", "limit=3", "rollout_timeout_s=5", "output_dir=elsewhere"])
    c = load_config(EXAMPLE, ["temperature=0.5"])
    assert a.fingerprint("h") == b.fingerprint("h") != c.fingerprint("h")


# ---- records ---------------------------------------------------------------------------------

HELLO = [39, 313, 75, 78, 305, 127, 114, 81, 525, 220, 19, 17]  # "Hello wörld 42" in the tiny tokenizer
IM_START, IM_END = 1102, 1103  # two of its special tokens


def gym_completion_of(tokenizer, generations: list[list[int]]):
    """A Gym result with one model call per generation, converted as the NemoGym actor converts it."""
    from gym_bridge.gym.protocol.convert import convert_gym_result
    from gym_bridge.rollout.nemo_gym import gym_completion

    output, history = [], [5, 6, 7]
    for generation in generations:
        output.append({"type": "message", "prompt_token_ids": list(history), "generation_token_ids": generation,
                       "generation_log_probs": [-0.5] * len(generation)})  # fmt: skip
        history = history + generation + [8]
    row = convert_gym_result({"reward": 1.0, "response": {"output": output}}, tokenizer)
    return gym_completion(row, max_seq_len=None, mask_env_flagged_samples=True)


@pytest.mark.parametrize(
    "generations",
    [[HELLO + [IM_END]], [HELLO, HELLO[:3] + [IM_END, IM_END]], [HELLO[:4] + [IM_START] + HELLO[4:] + [IM_END]]],
    ids=["trailing-special", "two-calls", "special-inside"],
)
def test_generated_texts_equal_the_decode_without_special_tokens(tiny_tokenizer, generations) -> None:
    from gym_bridge.eval.records import generated_texts

    completion = gym_completion_of(tiny_tokenizer, generations)
    expected = [tiny_tokenizer.decode(ids, skip_special_tokens=True) for ids in generations]
    assert generated_texts(completion, tiny_tokenizer) == expected


def test_generated_texts_use_the_text_the_actor_decoded_and_decode_only_without_it(tiny_tokenizer) -> None:
    from gym_bridge.eval.records import generated_texts

    completion = gym_completion_of(tiny_tokenizer, [HELLO + [IM_END]])
    item = completion.env_extras["response"]["output"][0]
    assert item["generation_str"] == "Hello wörld 42<|im_end|>"
    item["generation_str"] = "as Gym gave it<|im_end|>"
    assert generated_texts(completion, tiny_tokenizer) == ["as Gym gave it"]
    del item["generation_str"]
    assert generated_texts(completion, tiny_tokenizer) == ["Hello wörld 42"]


def test_token_counts_split_prompt_and_generated_tokens(tiny_tokenizer) -> None:
    from gym_bridge.eval.records import completion_record, token_counts

    completion = gym_completion_of(tiny_tokenizer, [HELLO, [IM_END]])
    counts = token_counts(completion.message_log)
    assert (counts.prompt, counts.generated, counts.total) == (3 + 1, len(HELLO) + 1, 4 + len(HELLO) + 1)
    record = completion_record(completion, tiny_tokenizer)
    assert (record["prompt_tokens"], record["generated_tokens"], record["total_tokens"]) == (4, 13, 17)
    assert record["turn_texts"] == ["Hello wörld 42", ""] and record["turns"] == 2


# ---- report ----------------------------------------------------------------------------------


def completion(reward: float, truncated: bool = False) -> dict:
    return {
        "reward": reward,
        "truncated": truncated,
        "termination": "stop",
        "turns": 1,
        "generated_tokens": 5,
        "total_tokens": 20,
        "text": "x",
        "gym_result": {},
    }


def test_report_from_files(tmp_path: Path) -> None:
    import matplotlib.image

    store = RunStore(tmp_path)
    store.open(
        {"num_generations_per_prompt": 4},
        resume=False,
        meta={"config": {"pass_threshold": 1.0}, "prompts_total": 4, "model": "m at http://x/v1"},
    )
    store.append_result(
        {
            "prompt_idx": 0,
            "agent": "a",
            "elapsed_s": 1.0,
            "finished_at": 10.0,
            "completions": [completion(1.0), completion(0.0), completion(0.0), completion(0.0)],
        }
    )
    store.append_result(
        {
            "prompt_idx": 1,
            "agent": "a",
            "elapsed_s": 1.0,
            "finished_at": 11.0,
            "completions": [completion(0.0)] * 3 + [completion(0.0, truncated=True)],
        }
    )
    store.append_result(
        {"prompt_idx": 2, "agent": "b", "elapsed_s": 1.0, "finished_at": 12.0, "completions": [completion(1.0)] * 4}
    )
    store.append_failure(
        {
            "prompt_idx": 3,
            "agent": "b",
            "error": "RolloutTimeout",
            "message": "prompt group exceeded 2.0s | via a\nb",
            "class": "infra",
        }
    )
    store.append_failure(
        {"prompt_idx": 2, "agent": "b", "error": "GymTransportError", "message": "m", "class": "infra"}
    )
    store.record_session(0.0, outcome="finished", rollouts_started=0.0)
    store.close()

    metrics = build_report(tmp_path)
    a = metrics["agents"]["a"]
    assert a["mean_reward"] == pytest.approx(1 / 8)
    assert a["pass_at_k"]["pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert a["pass_at_k"]["pass@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert a["truncation_rate"] == pytest.approx(1 / 8)
    assert metrics["agents"]["b"]["pass_at_k"]["pass@4"] == 1.0
    assert metrics["prompts_failed"] == 1 and metrics["failures"]["by_error"] == {"RolloutTimeout": 1}
    assert json.loads((tmp_path / "metrics.json").read_text())["agents"]["all"]["prompts"] == 3
    assert "| a | 2 |" in (tmp_path / "report.md").read_text()
    assert "| RolloutTimeout | 1 | prompt group exceeded 2.0s \\| via a b |" in (tmp_path / "report.md").read_text()
    assert metrics["model"] == "m at http://x/v1" and "Model: m at http://x/v1" in (tmp_path / "report.md").read_text()
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[2] in (3, 4)


def test_run_store_sink_writes_only_complete_groups_and_one_failure_per_skip(tmp_path: Path, tiny_tokenizer) -> None:
    import torch

    from gym_bridge.eval.dataset import DatasetRow
    from gym_bridge.eval.sink import RunStoreSink
    from gym_bridge.failures import GymTransportError
    from gym_bridge.rollout.sink import RolloutSink
    from gym_bridge.types import Completion, PromptGroupRecord

    store = RunStore(tmp_path / "run")
    store.open({"k": 1}, resume=False)
    rows = [DatasetRow(i, i + 1, {"agent_ref": {"name": "agent"}}) for i in range(2)]
    sink = RunStoreSink(store, rows, tiny_tokenizer)
    assert isinstance(sink, RolloutSink)
    reply = {"role": "assistant", "content": "4", "token_ids": torch.tensor([52], dtype=torch.int64)}
    record = PromptGroupRecord(0, [], None, {}, [Completion([reply], {"reward": 1.0}, False, 1.0)] * 2, {})

    failed = sink.reserve(0)
    sink.discard(failed, GymTransportError("HTTP 503"))
    assert read_jsonl(store.results_path) == [] and read_jsonl(store.failures_path) == []
    sink.commit(sink.reserve(0), record, start_weight_version=3, end_weight_version=4)
    assert sink.rewards[0] == [1.0, 1.0]
    sink.discard(sink.reserve(1), GymTransportError("HTTP 503"))
    sink.record_skip(1)
    store.close()
    [result] = read_jsonl(store.results_path)
    assert result["prompt_idx"] == 0 and len(result["completions"]) == 2 and result["line"] == 1
    assert (result["start_weight_version"], result["end_weight_version"]) == (3, 4)
    [failure] = read_jsonl(store.failures_path)
    assert (failure["prompt_idx"], failure["error"], failure["class"]) == (1, "GymTransportError", "infra")
    with pytest.raises(KeyError, match="not a pending row"):
        sink.reserve(7)


def test_the_report_names_the_model() -> None:
    from gym_bridge.eval.report import describe_model

    smollm2 = build_config({"dataset": "d.jsonl", "config_paths": ["c.yaml"], "output_dir": "o"})
    assert smollm2.embedded_policy == "smollm2" and smollm2.model_name == "smollm2"
    assert describe_model(smollm2.model_dump(mode="json")).startswith("smollm2 (SmolLM2-135M-Instruct), embedded")
    scripted = smollm2.model_copy(update={"embedded_policy": "scripted"})
    assert "scripted rule-based policy (not a language model" in describe_model(scripted.model_dump(mode="json"))
    remote = {"base_urls": ["http://gpu-0:8000/v1"], "model_name": "Qwen/Qwen3-4B"}
    assert describe_model(remote) == "'Qwen/Qwen3-4B' served at http://gpu-0:8000/v1"


def test_termination_reason_reads_gyms_incomplete_reason_then_drift_then_truncation():
    from gym_bridge.eval.records import termination_reason
    from gym_bridge.types import Completion

    def completion(reason=None, *, truncated=False, drift=False):
        return Completion(
            message_log=[], env_extras={}, truncated=truncated, reward=0.0, token_drift=drift, incomplete_reason=reason
        )

    assert termination_reason(completion("max_output_tokens", truncated=True, drift=True)) == "max_output_tokens"
    assert termination_reason(completion(truncated=True, drift=True)) == "token_drift"
    assert termination_reason(completion(truncated=True)) == "max_seq_len"
    assert termination_reason(completion()) == "stop"
