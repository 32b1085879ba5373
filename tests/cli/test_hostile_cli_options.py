"""Careless options and numbers that cannot lie, through the real ``gym-bridge`` entry point (``cli.main``, in
process): every numeric option of every subcommand is range-checked where it is parsed (one line naming the
option and its range, exit 2, before anything starts); an error no input explains is one line that says it is a
bug, its traceback kept in a file; and a run folder whose ``row_id`` could collide with a repeat's key
(``x#1``), or whose ``prompt_idx`` lies outside the dataset ``run.json`` records, is refused naming the file
and line by ``compare``, ``report`` and ``eval --resume``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import orjson
import pytest

from gym_bridge import cli
from gym_bridge.eval.records import row_id
from gym_bridge.eval.runs import FAILURES_FILE, RESULTS_FILE, RUN_FILE

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/eval_equivalence_tools.yaml"


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``gym-bridge ARGV`` in process: the exit code (a usage error's too: returned) and stderr."""
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def one_line(err: str, start: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), err
    assert "Traceback" not in err
    return lines[0]


# ---- options: range-checked where they are parsed -------------------------------------------------------------

OPTIONS = [
    (["build-tiny"], "--seed", "[0, 4294967295]", ["-1", "4294967296", "1.5", "x"]),
    (["serve"], "--answer-tokens", "[1, 1048576]", ["0", "-3", "1048577"]),
    (["serve"], "--port", "[0, 65535]", ["-1", "65536", "99999999999999999999"]),
    (["serve"], "--max-new-tokens", "[1, 1048576]", ["0", "10000000000"]),
    (["serve"], "--temperature", "[0, 100]", ["-0.1", "nan", "inf", "1e999"]),
    (["serve"], "--top-p", "(0, 1]", ["0", "1.5", "nan", "-inf"]),
    (["check-endpoint", "http://127.0.0.1:9/v1", "--model", "m"], "--timeout", "(0, 3600]", ["0", "-1", "inf", "1e9"]),
    (["compare", "a", "b"], "--level", "(0, 1)", ["0", "1", "nan", "95"]),
    (["compare", "a", "b"], "--resamples", "[100, 1000000]", ["10^11", "100000000000", "99", "-5", "1" * 5000]),
    (["compare", "a", "b"], "--seed", "[0, 4294967295]", ["-1", "2" * 30, "0x10"]),
    (["compare", "a", "b"], "--fail-if-worse", "[0, inf)", ["-0.01", "nan", "inf", "1e400"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "option", "span", "values"), OPTIONS, ids=[f"{c[0]} {o}" for c, o, _, _ in OPTIONS]
)
def test_a_numeric_option_out_of_its_range_is_one_line_naming_it(capsys, command, option, span, values) -> None:
    for value in values:
        code, err = run_main(capsys, *command, f"{option}={value}")
        assert code == 2, (value, err)
        line = one_line(err, f"gym-bridge {command[0]}: argument {option}: must be ")
        assert f" in {span}, got " in line, line


def test_every_numeric_option_of_every_subcommand_is_range_checked() -> None:
    """Walks the parser: an option whose type takes NaN, infinity, a negative or a 5,000-digit number fails here, so
    an option added without a range fails this test."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    typed = []
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.type is None:
                continue
            typed.append(f"{name} {action.option_strings}")
            for hostile in ("nan", "inf", "-inf", "1e999", "-" + "9" * 40, "1" * 5000, "", "x"):
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type(hostile)
    assert len(typed) == len(OPTIONS), typed


def test_an_option_in_range_is_taken(capsys, tmp_path: Path) -> None:
    """The bounds themselves are allowed: compare reads its folders (and refuses them: missing) once parsed."""
    code, err = run_main(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--seed", "4294967295",
                         "--resamples", "1000000", "--level", "0.999", "--fail-if-worse", "0")  # fmt: skip
    assert code == 2 and "no such run folder" in one_line(err, "gym-bridge compare: "), err


# ---- errors no input explains, OSError, Ctrl-C --------------------------------------------------------------


def test_a_bug_is_one_line_saying_so_with_its_traceback_in_a_file(capsys, monkeypatch, tmp_path: Path) -> None:
    from gym_bridge.rollout import registry

    def broken() -> dict:
        raise ZeroDivisionError("a bug\x1b[31m")

    monkeypatch.setattr(registry, "available_backends", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    code, err = run_main(capsys, "backends")
    line = one_line(err, "gym-bridge backends: internal error, please report it: ZeroDivisionError: a bug\\x1b[31m")
    assert code == cli.EXIT_BUG
    [saved] = tmp_path.glob("gym-bridge-traceback-*.txt")
    assert str(saved) in line
    text = saved.read_text()
    assert text.startswith("Traceback") and "in broken" in text and "ZeroDivisionError: a bug" in text
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["backends"])


@pytest.mark.parametrize(
    ("raised", "code", "says"),
    [
        (PermissionError(13, "Permission denied", "/x/out"), 2, "gym-bridge backends: /x/out: Permission denied"),
        (OSError(28, "No space left on device"), 2, "gym-bridge backends: No space left on device"),
        (KeyboardInterrupt(), 130, "gym-bridge backends: interrupted"),
    ],
    ids=["oserror-path", "oserror", "interrupt"],
)
def test_a_refusal_of_the_system_or_ctrl_c_is_one_line(capsys, monkeypatch, raised, code, says) -> None:
    from gym_bridge.rollout import registry

    def refuse() -> dict:
        raise raised

    monkeypatch.setattr(registry, "available_backends", refuse)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    got, err = run_main(capsys, "backends")
    assert got == code and one_line(err, says), err


def test_text_that_cannot_be_written_to_a_terminal_is_escaped(capsys) -> None:
    """A lone surrogate (an undecodable byte in argv) or a bidi override in a URL: the check's line is escaped,
    never a UnicodeEncodeError (the property test found it)."""
    dead = "http://127.0.0.1:9/v1"
    code, err = run_main(capsys, "check-endpoint", "\udcff", "\u202e" + dead, "--model=m", "--timeout=1")
    assert code == 2, err
    assert "\\udcff: " in err and "\\u202e" in err and "\u202e" not in err and "Traceback" not in err


# ---- numbers that cannot lie -------------------------------------------------------------------------------


def result_line(i: int, rid: str | None, rewards: list[float]) -> dict:
    row = {"responses_create_params": {"input": [{"role": "user", "content": f"question {i}"}]}}
    completions = [{"reward": r, "gym_result": {**row, "reward": r}} for r in rewards]
    line = {"prompt_idx": i, "line": i + 1, "agent": "agent", "completions": completions}
    return {**line, **({"row_id": rid} if rid is not None else {})}


def write_run(folder: Path, lines: list[dict], *, prompts_total: int | None = None, run: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    base = {"fingerprint": {"dataset_sha256": "d", "num_generations_per_prompt": 2}, "config": {}, "model": "m",
            "sessions": [], **({"prompts_total": prompts_total} if prompts_total is not None else {})}  # fmt: skip
    (folder / RUN_FILE).write_text(json.dumps({**base, **(run or {})}))
    (folder / RESULTS_FILE).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return folder


def plain_lines(count: int) -> list[dict]:
    return [result_line(i, row_id({"q": i}), [1.0, float(i % 2)]) for i in range(count)]


def test_a_row_id_that_collides_with_a_repeats_key_is_refused_naming_its_line(capsys, tmp_path: Path) -> None:
    """Rows ``x``, ``x`` (its repeat: key ``x#1``) and ``x#1``: counted as two prompts, or compared against the
    wrong row, unless refused."""
    rid = row_id({"q": "x"})
    for name, hostile in (("hash", f"{rid}#1"), ("idx", "idx:0")):
        lines = [result_line(0, rid, [1.0, 1.0]), result_line(1, rid, [0.0, 0.0]), result_line(2, hostile, [1.0, 0.0])]
        a = write_run(tmp_path / f"a-{name}", lines)
        b = write_run(tmp_path / f"b-{name}", lines)
        for argv in (["compare", str(a), str(b), "--out", str(tmp_path / f"cmp-{name}")], ["report", str(a)]):
            code, err = run_main(capsys, *argv)
            line = one_line(err, f"gym-bridge {argv[0]}: ")
            assert code == 2 and f"{a / RESULTS_FILE}:3: field 'row_id'" in line, line
            assert "the readers' keys for repeated rows" in line, line
        assert not (tmp_path / f"cmp-{name}").exists() and not (a / "report.md").exists()


def test_a_prompt_idx_outside_the_dataset_is_refused_naming_its_line(capsys, tmp_path: Path) -> None:
    lines = plain_lines(4)
    lines[2] = {**lines[2], "prompt_idx": 7}
    a = write_run(tmp_path / "a", lines, prompts_total=4)
    b = write_run(tmp_path / "b", plain_lines(4), prompts_total=4)
    for argv in (["compare", str(b), str(a), "--out", str(tmp_path / "cmp")], ["report", str(a)]):
        code, err = run_main(capsys, *argv)
        line = one_line(err, f"gym-bridge {argv[0]}: ")
        assert code == 2 and f"{a / RESULTS_FILE}:3: field 'prompt_idx': 7 is outside the dataset" in line, line
        assert "prompts_total 4, so 0 to 3" in line, line
    assert not (tmp_path / "cmp").exists() and not (a / "report.md").exists()


def test_a_failure_outside_the_dataset_is_refused_by_report(capsys, tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", plain_lines(3), prompts_total=3)
    failure = {"prompt_idx": 3, "line": 4, "agent": "agent", "error": "X", "message": "m", "class": "infra"}
    (a / FAILURES_FILE).write_bytes(orjson.dumps(failure) + b"\n")
    code, err = run_main(capsys, "report", str(a))
    line = one_line(err, "gym-bridge report: ")
    assert code == 2 and f"{a / FAILURES_FILE}:1: field 'prompt_idx': 3 is outside the dataset" in line, line


def test_a_folder_in_range_is_still_reported(capsys, tmp_path: Path) -> None:
    """The checks refuse only what lies: every prompt inside the dataset, repeated rows' own ids, no row_id."""
    rid = row_id({"q": "x"})
    lines = [
        *plain_lines(3),
        result_line(3, rid, [1.0, 1.0]),
        result_line(4, rid, [0.0, 1.0]),
        result_line(5, None, [1.0]),
    ]
    a = write_run(tmp_path / "a", lines, prompts_total=6)
    code, err = run_main(capsys, "report", str(a))
    assert code == 0, err
    assert json.loads((a / "metrics.json").read_text())["prompts_done"] == 6


def test_eval_resume_refuses_a_prompt_idx_outside_the_dataset(capsys, tmp_path: Path, monkeypatch) -> None:
    """``eval --resume`` on a folder of this very config and dataset whose results hold a ``prompt_idx`` past the
    dataset: one line naming it, before Ray or Gym starts, and the folder is left as it was."""
    from gym_bridge.eval import load_config
    from gym_bridge.eval.dataset import file_sha256, load_dataset

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    config = load_config(str(EXAMPLE), [f"output_dir={out}"])
    rows = load_dataset(config.dataset)
    lines = [{**line, "prompt_idx": i} for i, line in enumerate(plain_lines(2))]
    lines.append({**plain_lines(3)[2], "prompt_idx": len(rows) + 5})
    write_run(out, lines, prompts_total=len(rows), run={"fingerprint": config.fingerprint(file_sha256(config.dataset))})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_main(capsys, "eval", str(EXAMPLE), f"output_dir={out}", "--resume", "--no-progress")
    line = one_line(err, "gym-bridge eval: ")
    assert code == 2 and f"{out / RESULTS_FILE}:3: field 'prompt_idx': {len(rows) + 5} is outside the dataset" in line
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "run.lock"}
    assert after == before
