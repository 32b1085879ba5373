"""Run folders are untrusted input (issue 42): hostile folders written here, each given to the real command
(``compare``, ``report``, ``rescore``, ``eval --resume``) in a subprocess. Each ends in exactly one stderr line
naming the file, line and field, with exit code 2, without hanging on a FIFO or reading a device; and nothing a
folder names is run: a rescore whose ``run.json`` points a Gym server's entrypoint at a script is refused at read
time, and the script's marker file never appears. Nothing here starts Ray or Gym; the one ``eval --resume`` through
the real command is marked slow (it imports the run loop), and the store's resume is driven directly beside it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gym_bridge.eval.records import row_id
from gym_bridge.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "eval_equivalence_tools.yaml"
LC_CONFIG = "resources_servers/equivalence_rule/configs/lc.yaml"
TOOL_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "lc_equivalence_rule_simple_agent"
SETTINGS = "field 'config.gym_overrides.lc_equivalence_rule.resources_servers.equivalence_rule"
"""The start of a field name inside the equivalence_rule server's settings."""
HANG_S = 60.0
"""A command that has not answered by then hangs (a FIFO read): the test fails instead of waiting for ever."""


# ---- folders ----------------------------------------------------------------------------------


def row(i: int) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"question {i}"}]},
            "agent_ref": {"name": AGENT}, "expected_answer": str(i)}  # fmt: skip


def result_line(i: int, rewards: list[float], **extra: object) -> dict:
    """A result line as ``gym-bridge eval`` writes it, with the fields the readers use."""
    message = {"type": "message", "content": [{"type": "output_text", "text": f"{i}"}]}
    gym = {"responses_create_params": row(i)["responses_create_params"], "expected_answer": str(i),
           "response": {"output": [message]}}  # fmt: skip
    completions = [{"reward": r, "truncated": False, "termination": "stop", "turns": 1, "generated_tokens": 3,
                    "total_tokens": 9, "text": f"{i}", "gym_result": {**gym, "reward": r}}
                   for r in rewards]  # fmt: skip
    return {"prompt_idx": i, "row_id": row_id(row(i)), "line": i + 1, "agent": AGENT, "completions": completions,
            "elapsed_s": 1.0, "finished_at": 100.0 + i, **extra}  # fmt: skip


def write_run(folder: Path, prompts: int = 4, *, run: dict | None = None, lines: list[dict] | None = None) -> Path:
    """A finished run folder: ``run.json`` (``run`` merged over a valid one) and one result line per prompt."""
    folder.mkdir(parents=True)
    base = {"fingerprint": {"dataset_sha256": "data-1", "num_generations_per_prompt": 2,
                            "config_paths": [LC_CONFIG], "gym_overrides": {}},
            "config": {"pass_threshold": 1.0, "config_paths": [LC_CONFIG], "gym_overrides": {}},
            "model": "m", "prompts_total": prompts, "sessions": []}  # fmt: skip
    (folder / "run.json").write_text(json.dumps({**base, **(run or {})}))
    lines = lines if lines is not None else [result_line(i, [1.0, float(i % 2)]) for i in range(prompts)]
    write_lines(folder / "results.jsonl", lines)
    return folder


def write_lines(path: Path, lines: list[dict]) -> None:
    path.write_bytes(b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines))


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def refused(command: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> str:
    """Run ``gym-bridge COMMAND ARGS``; assert exit code 2 and one stderr line, and return that line."""
    proc = run_cli(command, *args, cwd=cwd, env=env, timeout=HANG_S)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith(f"gym-bridge {command}: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


# ---- compare and report: one reader ----------------------------------------------------------


SOME = ("fifo", "dev-zero", "threshold", "config-list", "repeated")
"""The cases every command meets; ``compare`` meets them all (the reader is one)."""


def hostile_folders(tmp: Path, only: tuple[str, ...] | None = None) -> list[tuple[Path, str]]:
    """(a hostile run folder, what the one error line must say); ``only``: these cases by name."""
    cases: list[tuple[Path, str]] = []

    def case(name: str, expected: str, **kwargs: object) -> Path:
        folder = write_run(tmp / name, **kwargs)  # type: ignore[arg-type]
        cases.append((folder, expected.format(dir=folder)))
        return folder

    fifo = case("fifo", "{dir}/results.jsonl: not a regular file (a FIFO)")
    replace_with_fifo(fifo / "results.jsonl")
    zero = case("dev-zero", "{dir}/results.jsonl: not a regular file (a character device)")
    replace_with_link(zero / "results.jsonl", "/dev/zero")
    run_zero = case("run-dev-zero", "{dir}/run.json: not a regular file (a character device)")
    replace_with_link(run_zero / "run.json", "/dev/zero")
    case("threshold", "{dir}/run.json: field 'config.pass_threshold': should be a valid number (got 'abc')",
         run={"config": {"pass_threshold": "abc"}})  # fmt: skip
    case("config-list", "{dir}/run.json: field 'config': ", run={"config": ["not", "a", "mapping"]})
    case("threshold-nan", "{dir}/run.json: not valid JSON", run={"config": {"pass_threshold": float("nan")}})
    case("sessions", "{dir}/run.json: field 'sessions[0].ended': ", run={"sessions": [{"started": 1.0, "ended": "x"}]})
    case("nul-source", "{dir}/run.json: field 'rescore.source': holds a NUL character",
         run={"rescore": {"source": "a\x00b"}})  # fmt: skip
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    case("deep", "{dir}/run.json: nested deeper than 128 levels", run={"config": {"pass_threshold": 1.0, "x": deep}})
    twice = [result_line(i, [1.0, 0.0]) for i in range(4)] + [result_line(2, [0.0, 0.0])]
    case("repeated", "{dir}/results.jsonl:5: field 'prompt_idx': 2 is also on line 3", lines=twice)
    text_reward = [result_line(0, [1.0]), result_line(1, ["1.0"])]  # type: ignore[list-item]
    case("reward-text", "{dir}/results.jsonl:2: field 'completions[0].reward': should be a valid number",
         lines=text_reward)  # fmt: skip
    bool_idx = [result_line(0, [1.0]), {**result_line(1, [1.0]), "prompt_idx": True}]
    case("idx-bool", "{dir}/results.jsonl:2: field 'prompt_idx': should be a valid integer", lines=bool_idx)
    agent = [{**result_line(0, [1.0]), "agent": {"name": "x"}}]
    case("agent-object", "{dir}/results.jsonl:1: field 'agent': should be a valid string", lines=agent)
    prompt = result_line(0, [1.0])
    prompt["completions"][0]["gym_result"]["responses_create_params"] = {"input": 5}
    case("prompt-number", "{dir}/results.jsonl:1: field 'completions[0].gym_result': responses_create_params.input "
         "is neither a string nor a list (int)", lines=[prompt])  # fmt: skip
    return [(folder, expected) for folder, expected in cases if only is None or folder.name in only]


def test_compare_refuses_each_hostile_folder_in_one_line(tmp_path: Path) -> None:
    good = write_run(tmp_path / "good")
    failures = []
    for folder, expected in hostile_folders(tmp_path / "hostile"):
        line = refused("compare", str(good), str(folder), "--out", str(tmp_path / "out"))
        if expected not in line:
            failures.append(f"{folder.name}: expected {expected!r} in\n  {line}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "out").exists(), "nothing is written for a refused folder"


def test_report_refuses_each_hostile_folder_in_one_line(tmp_path: Path) -> None:
    failures = []
    for folder, expected in hostile_folders(tmp_path, SOME):
        line = refused("report", str(folder))
        if not line.startswith(f"gym-bridge report: cannot build the report of {folder}: ") or expected not in line:
            failures.append(f"{folder.name}: expected {expected!r} in\n  {line}")
        if (folder / "report.md").exists() or (folder / "metrics.json").exists():
            failures.append(f"{folder.name}: a report was written")
    assert not failures, "\n".join(failures)


def test_a_repeated_prompt_is_not_counted_twice(tmp_path: Path) -> None:
    """The same prompt_idx with other rewards: ``compare`` kept the first and ``report`` counted both."""
    lines = [result_line(i, [1.0]) for i in range(6)] + [result_line(3, [0.0])]
    folder = write_run(tmp_path / "run", prompts=6, lines=lines)
    line = refused("report", str(folder))
    assert "results.jsonl:7: field 'prompt_idx': 3 is also on line 4" in line


def test_a_file_over_the_size_cap_is_refused_with_the_way_to_raise_it(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "big")
    size = (folder / "results.jsonl").stat().st_size
    env = {**os.environ, "GYM_BRIDGE_RUN_MAX_BYTES": "1000"}
    line = refused("report", str(folder), env=env)
    assert f"results.jsonl: {size:,} bytes or more, over the limit of 1,000 bytes" in line
    assert "set GYM_BRIDGE_RUN_MAX_BYTES to read a larger one" in line
    proc = run_cli("report", str(folder), env={**os.environ, "GYM_BRIDGE_RUN_MAX_BYTES": str(size)}, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr


def test_rows_are_split_on_newlines_only(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 inside a valid row are text, written raw (not escaped): one row, not two."""
    odd = "a\u2028b\u2029c\u0085d"
    lines = [result_line(i, [1.0, 0.0], note=odd) for i in range(4)]
    run_a = write_run(tmp_path / "a", lines=lines)
    run_b = write_run(tmp_path / "b", lines=lines)
    assert "\u2028".encode() in (run_a / "results.jsonl").read_bytes()
    proc = run_cli("compare", str(run_a), str(run_b), "--out", str(tmp_path / "out"), timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("report", str(run_a), timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((run_a / "metrics.json").read_text())
    assert metrics["prompts_done"] == 4


def test_a_folder_name_cannot_split_the_error_line(tmp_path: Path) -> None:
    good = write_run(tmp_path / "good")
    odd = tmp_path / "odd\nname\u2028\x1b[32mOK"
    write_run(odd, run={"config": {"pass_threshold": "abc"}})
    line = refused("compare", str(good), str(odd), "--out", str(tmp_path / "out"))
    assert "odd\\nname\\u2028\\x1b[32mOK/run.json: field 'config.pass_threshold'" in line


def test_a_planted_lock_file_does_not_hang_the_reader(tmp_path: Path) -> None:
    """``run.lock`` as a FIFO: opening it to test the writer's lock must not block."""
    good = write_run(tmp_path / "good")
    planted = write_run(tmp_path / "planted")
    os.mkfifo(planted / "run.lock")
    proc = run_cli("compare", str(good), str(planted), "--out", str(tmp_path / "out"), timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr


# ---- rescore: nothing the folder names is run -------------------------------------------------


@pytest.fixture
def wheel_server_dir() -> Path:
    from gym_bridge.gym.servers.config_files import GymConfigNotFound, wheel_config_path

    try:
        return wheel_config_path(LC_CONFIG).parents[1]
    except GymConfigNotFound:
        pytest.skip(f"the installed nemo-gym has no {LC_CONFIG}")


def evil_script(tmp: Path) -> tuple[Path, Path]:
    """A script that leaves a marker file when it runs, and that marker."""
    script = tmp / "evil" / "app.py"
    script.parent.mkdir(parents=True)
    marker = tmp / "evil" / "RAN"
    script.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    return script, marker


def stored_overrides(folder: Path, overrides: dict) -> Path:
    run = json.loads((folder / "run.json").read_text())
    run["config"]["gym_overrides"] = overrides
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_rescore_never_starts_an_entrypoint_a_run_folder_names(tmp_path: Path, wheel_server_dir: Path) -> None:
    script, marker = evil_script(tmp_path)
    entrypoint = os.path.relpath(script, wheel_server_dir)
    impl = {"equivalence_rule": {"entrypoint": entrypoint}}
    cases = [
        ({"lc_equivalence_rule": {"resources_servers": impl}},
         f"{SETTINGS}.entrypoint' names code"),
        ({"evil": {"resources_servers": {"evil": {"entrypoint": str(script)}}}},
         "field 'config.gym_overrides.evil' names no server that config_paths define"),
        ({"lc_equivalence_rule": {"resources_servers": {"../../evil": {"entrypoint": "app.py"}}}},
         "field 'config.gym_overrides.lc_equivalence_rule.resources_servers.../../evil' names no server"),
        ({"config_paths": [str(script)]}, "field 'config.gym_overrides.config_paths' names no server"),
        ({"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"judge": {"base_url": "http://x"}}}}},
         f"{SETTINGS}.judge.base_url' names code, a path, a command or an address"),
        ({"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"grading_rule": "${oc.env:HOME}"}}}},
         f"{SETTINGS}.grading_rule' is an interpolation"),
        ({"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"_target_": "os.system"}}}},
         f"{SETTINGS}._target_' names code"),
    ]  # fmt: skip
    failures = []
    for i, (overrides, expected) in enumerate(cases):
        source = stored_overrides(write_run(tmp_path / f"run-{i}"), overrides)
        out = tmp_path / f"out-{i}"
        line = refused("rescore", str(source), "--out", str(out))
        if f"{source}/run.json: {expected}" not in line:
            failures.append(f"case {i}: expected {expected!r} in\n  {line}")
        elif "pass your own config with --config" not in line:
            failures.append(f"case {i}: the line does not say what to do: {line}")
        if out.exists():
            failures.append(f"case {i}: the output folder was created")
    assert not failures, "\n".join(failures)
    assert not marker.exists(), "the script a run folder named was run"


def test_rescore_takes_config_paths_only_from_the_installed_gym(tmp_path: Path, wheel_server_dir: Path) -> None:
    """A stored config path that names the folder's own YAML (found through the cwd), an absolute path or one that
    climbs out of the wheel is refused; a user's own config on the command line is taken."""
    script, marker = evil_script(tmp_path)
    evil_yaml = {"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"entrypoint": str(script)}}}}
    cases = []
    for i, name in enumerate(["run-0/evil.yaml", str(tmp_path / "run-1" / "evil.yaml"), f"{LC_CONFIG}/../../x.yaml",
                              "resources_servers/nosuch/configs/x.yaml"]):  # fmt: skip
        source = write_run(tmp_path / f"run-{i}", run={"config": {"pass_threshold": 1.0, "config_paths": [name]}})
        (source / "evil.yaml").write_text(json.dumps(evil_yaml))
        cases.append((source, name))
    for source, name in cases:
        line = refused("rescore", str(source), "--out", str(tmp_path / "out"), cwd=tmp_path)
        assert f"run.json: field 'config.config_paths[0]': {name!r} is not a config of the installed nemo-gym" in line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_with_the_users_config_the_folders_grader_settings_are_not_used(tmp_path: Path, wheel_server_dir: Path) -> None:
    """``--config``: its grader settings replace the folder's, so a hostile ``gym_overrides`` is never read as
    settings; this config has no agent block for the run's agent, which stops the rescore before Gym starts."""
    import yaml

    script, marker = evil_script(tmp_path)
    hostile = {"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {"entrypoint": str(script)}}}}
    source = stored_overrides(write_run(tmp_path / "run"), hostile)
    mine = yaml.safe_load(EXAMPLE.read_text())
    mine.update(config_paths=[TOOL_CONFIG], dataset=str(REPO / mine["dataset"]), output_dir=str(tmp_path / "x"))
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(mine))
    line = refused("rescore", str(source), "--config", str(tmp_path / "mine.yaml"), "--out", str(tmp_path / "out"))
    assert f"config_paths ['{TOOL_CONFIG}'] have no agent block for {AGENT}" in line
    assert not marker.exists()


def test_the_trust_boundary_accepts_grader_settings(wheel_server_dir: Path, tmp_path: Path) -> None:
    """What a run folder may carry: Gym's own configs and changed settings of their servers."""
    from gym_bridge.eval.rescore import _config_blocks
    from gym_bridge.eval.rescore_trust import check_stored_overrides, trusted_config_files

    files = trusted_config_files([LC_CONFIG, TOOL_CONFIG], tmp_path / "run.json")
    assert all(f.is_absolute() and f.is_file() for f in files), "the wheel's files, never a same-named one in the cwd"
    settings = {"grading_rule": "seq_match", "options": [{"x": 1}]}
    overrides = {"lc_equivalence_rule": {"resources_servers": {"equivalence_rule": settings}}}
    check_stored_overrides(overrides, _config_blocks(files, {}), tmp_path / "run.json")


def test_rescore_refuses_a_malformed_source_before_anything_starts(tmp_path: Path) -> None:
    for folder, expected in hostile_folders(tmp_path / "hostile", SOME):
        line = refused("rescore", str(folder), "--out", str(tmp_path / "out"))
        assert expected in line, line
    assert not (tmp_path / "out").exists()


# ---- eval --resume ----------------------------------------------------------------------------


def resumable_run(folder: Path) -> list[str]:
    """A run folder that ``gym-bridge eval EXAMPLE ARGS --resume`` accepts as its own (the same fingerprint);
    returns ARGS."""
    from gym_bridge.eval.config import load_config
    from gym_bridge.eval.dataset import file_sha256

    args = [f"output_dir={folder}", f"dataset={REPO / 'examples' / 'data' / 'gym_rows.jsonl'}"]
    config = load_config(EXAMPLE, args)
    write_run(folder, run={"fingerprint": config.fingerprint(file_sha256(config.dataset))})
    return args


@pytest.mark.slow  # the command imports the run loop (torch): 10-30 s on two busy cores
def test_eval_resume_refuses_a_repeated_prompt_through_the_real_command(tmp_path: Path) -> None:
    args = resumable_run(tmp_path / "repeated")
    lines = [result_line(0, [1.0]), result_line(1, [1.0]), result_line(0, [0.0])]
    write_lines(tmp_path / "repeated" / "results.jsonl", lines)
    line = refused("eval", str(EXAMPLE), *args, "--resume")
    assert f"{tmp_path / 'repeated'}/results.jsonl:3: field 'prompt_idx': 0 is also on line 1" in line


@pytest.mark.slow  # the command imports the run loop (torch)
def test_eval_resume_with_a_smaller_limit_keeps_the_dataset_size_its_results_need(tmp_path: Path) -> None:
    """A finished 6-prompt run resumed with ``limit=2`` runs nothing and keeps ``prompts_total`` at 6: a smaller
    number would put its own results outside the dataset, and every reader would refuse the folder."""
    folder = tmp_path / "run"
    args = resumable_run(folder)
    write_lines(folder / "results.jsonl", [result_line(i, [1.0, 0.0]) for i in range(6)])
    run = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**run, "prompts_total": 6}))
    proc = run_cli("eval", str(EXAMPLE), *args, "limit=2", "--resume", timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((folder / "run.json").read_text())["prompts_total"] == 6
    report = run_cli("report", str(folder), timeout=HANG_S)
    assert report.returncode == 0, report.stderr[-3000:]


def test_rescore_names_a_run_json_without_config_paths(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", run={"config": {"pass_threshold": 1.0, "gym_overrides": {}}})
    line = refused("rescore", str(folder), "--out", str(tmp_path / "out"))
    assert f"{folder}/run.json: config.config_paths is missing or empty" in line, line
    assert not (tmp_path / "out").exists()


def test_eval_resume_reads_the_folder_through_the_same_reader(tmp_path: Path) -> None:
    """The store's resume (what ``eval --resume`` calls before anything starts) on planted files: the boundary's
    refusal (the store reads through it; a :class:`RunReadError` is one too)."""
    from gym_bridge.boundary import UntrustedInputError
    from gym_bridge.eval.runs import RunReadError
    from gym_bridge.eval.store import RunDirError, RunStore

    fingerprint = {"dataset_sha256": "data-1", "num_generations_per_prompt": 2}
    planted_files = [
        ("fifo", "results.jsonl", "results.jsonl: not a regular file (a FIFO)"),
        ("zero", "run.json", "run.json: not a regular file (a character device)"),
    ]
    for name, planted, expected in planted_files:
        folder = write_run(tmp_path / name, run={"fingerprint": fingerprint})
        if name == "fifo":
            replace_with_fifo(folder / planted)
        else:
            replace_with_link(folder / planted, "/dev/zero")
        store = RunStore(folder)
        with pytest.raises(UntrustedInputError, match=re.escape(f"{folder}/{expected}")):
            store.open(fingerprint, resume=True)
        assert store._lock is None, "a refused resume lets go of the folder's lock"

    folder = write_run(tmp_path / "text-reward", run={"fingerprint": fingerprint})
    write_lines(folder / "results.jsonl", [result_line(0, ["0.5"])])  # type: ignore[list-item]
    with pytest.raises(RunReadError, match=re.escape("results.jsonl:1: field 'completions[0].reward'")):
        RunStore(folder).open(fingerprint, resume=True)

    folder = write_run(tmp_path / "lock-fifo", run={"fingerprint": fingerprint})
    os.mkfifo(folder / "run.lock")
    with pytest.raises(RunDirError, match=r"run\.lock: cannot be used as the run's lock"):
        RunStore(folder).open(fingerprint, resume=True)


def test_a_policies_run_checks_its_folders_with_the_same_reader(tmp_path: Path) -> None:
    """``run_policies`` asks each policy's folder whether it is finished before starting anything: a hostile
    ``prompt_idx`` there is a :class:`RunReadError` naming the line, not a traceback."""
    from gym_bridge.eval.config import EvalConfig
    from gym_bridge.eval.dataset import DatasetRow
    from gym_bridge.eval.policies import _finished
    from gym_bridge.eval.runs import RunReadError

    folder = write_run(tmp_path / "policy", lines=[{**result_line(0, [1.0]), "prompt_idx": "zero"}])
    config = EvalConfig.model_validate({"dataset": "d.jsonl", "config_paths": [LC_CONFIG], "output_dir": str(folder)})
    with pytest.raises(RunReadError, match=re.escape("results.jsonl:1: field 'prompt_idx'")):
        _finished(config, [DatasetRow(prompt_idx=0, line=1, row=row(0))])
