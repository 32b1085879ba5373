"""What ``gym-bridge report`` and ``compare`` write, and how they read, when the run folders are hostile: a link
planted at every name a command writes is replaced, never followed (the file outside is unchanged); every JSON
written is strict (rewards near the float limit give no ``Infinity``, no traceback); every text from a folder
reaches a Markdown file or the terminal with ESC, NUL and bidi overrides escaped; a sparse file or a file of
zeros is an error at its line, never an empty report; eval and training folders are told apart in one place;
the training reader and the eval reader keep the same caps and say the same lines. Commands run for real (a
subprocess) where the outcome is the command's; the reader's pieces in process."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import depth, loads_object, raw_depth
from gym_bridge.eval.records import row_id
from gym_bridge.eval.runs import (
    RESULTS_FILE,
    ReadLimits,
    RunReadError,
    decode_line,
    iter_objects,
    load_run,
    run_folder_kind,
)
from gym_bridge.testing.cli import run_cli

HANG_S = 120.0
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HOSTILE = "a\x1b[31mred\x00nul\u202eevil"
"""ESC (a colour), NUL and a right-to-left override: what must never reach a terminal or a Markdown file raw."""
RAW_CONTROLS = ("\x1b", "\x00", "\u202e")
FOLDER = "\x1b[31m\u202e"
"""What of it a folder name can hold (no NUL)."""


# ---- folders ----------------------------------------------------------------------------------


def result_line(i: int, rewards: list[float], agent: str = "math_agent", **extra: object) -> dict:
    row = {"responses_create_params": {"input": [{"role": "user", "content": f"question {i}"}]},
           "agent_ref": {"name": agent}}  # fmt: skip
    completions = [{"reward": r, "truncated": False, "termination": "stop", "turns": 1, "generated_tokens": 3,
                    "total_tokens": 9, "text": f"{i}", "gym_result": {**row, "reward": r}}
                   for r in rewards]  # fmt: skip
    line = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": agent, "completions": completions,
            "elapsed_s": 1.0, "finished_at": 100.0 + i}  # fmt: skip
    return {**line, **extra}


def write_run(folder: Path, lines: list[dict], *, run: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    base = {"fingerprint": {"dataset_sha256": "d", "num_generations_per_prompt": 2, "config_paths": ["a.yaml"],
                            "gym_overrides": {}},
            "config": {"pass_threshold": 1.0, "config_paths": ["a.yaml"], "gym_overrides": {}},
            "model": "m", "sessions": [{"started": 0.0, "rollouts_started": 1.0, "ended": 3.0}]}  # fmt: skip
    (folder / "run.json").write_text(json.dumps({**base, **(run or {})}))
    (folder / RESULTS_FILE).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return folder


def write_training(folder: Path, steps: int = 4) -> Path:
    folder.mkdir(parents=True)
    lines = [
        {"kind": "train", "step": s, "train/mean_reward": 0.1 * s, "train/loss": 1.0 - 0.1 * s} for s in range(steps)
    ]
    lines.append({"kind": "val", "step": steps, "val/accuracy": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    verdicts = [{"set": "held", "step": s, "weight_version": s, "problem": p, "sample": 0, "correct": (p + s) % 2 == 0}
                for s in (0, steps) for p in range(6)]  # fmt: skip
    (folder / "val_results.jsonl").write_text("".join(json.dumps(v) + "\n" for v in verdicts))
    return folder


def ok(*args: str) -> str:
    proc = run_cli(*args, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def refused(command: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = run_cli(command, *args, timeout=HANG_S, env=env)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith(f"gym-bridge {command}: "), proc.stderr[-3000:]
    return lines[0]


def plant_links(folder: Path, names: list[str], outside: Path) -> dict[Path, bytes]:
    """A link at each of ``names`` in ``folder`` to a file of its own outside it; the outside files' bytes."""
    outside.mkdir(parents=True, exist_ok=True)
    targets = {}
    for name in names:
        target = outside / f"precious-{name}"
        target.write_bytes(f"not yours: {name}\n".encode())
        (folder / name).symlink_to(target)
        targets[target] = target.read_bytes()
    return targets


def assert_untouched(targets: dict[Path, bytes], folder: Path, names: list[str]) -> None:
    for target, before in targets.items():
        assert target.read_bytes() == before, f"{target} was written through a planted link"
    for name in names:
        assert not (folder / name).is_symlink() and (folder / name).is_file(), f"{name} is a file of the folder now"


# ---- writes: a planted link is replaced, never followed ------------------------------------------------


def test_report_replaces_a_link_planted_at_every_name_it_writes(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [result_line(i, [1.0, float(i % 2)]) for i in range(6)])
    names = ["metrics.json", "report.md", "report.png", "report.html"]
    targets = plant_links(run, names, tmp_path / "outside")
    ok("report", str(run))
    assert_untouched(targets, run, names)
    assert json.loads((run / "metrics.json").read_text())["prompts_done"] == 6


def test_compare_replaces_a_link_planted_at_every_name_it_writes(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [result_line(i, [0.0, 1.0]) for i in range(6)])
    b = write_run(tmp_path / "b", [result_line(i, [1.0, 1.0]) for i in range(6)])
    out = tmp_path / "out"
    out.mkdir()
    names = ["compare.md", "compare.json", "compare.png"]
    targets = plant_links(out, names, tmp_path / "outside")
    ok("compare", str(a), str(b), "--out", str(out))
    assert_untouched(targets, out, names)


def test_training_plots_replace_a_link_planted_at_every_name_they_write(tmp_path: Path) -> None:
    run = write_training(tmp_path / "train")
    names = ["training.png", "training.html"]
    targets = plant_links(run, names, tmp_path / "outside")
    assert "plots: " in ok("report", str(run))
    assert_untouched(targets, run, names)
    assert (run / "training.png").read_bytes()[:4] == b"\x89PNG"


def test_training_metrics_are_appended_as_strict_json_never_through_a_link(tmp_path: Path) -> None:
    import numpy as np

    from gym_bridge.training.metrics import append_metrics, read_metrics

    path = tmp_path / "metrics.jsonl"
    append_metrics(path, {"step": 0, "train/loss": math.nan, "train/kl": np.float64(0.25), "n": np.int64(3)})
    assert read_metrics(path) == [{"n": 3, "step": 0, "train/kl": 0.25, "train/loss": None}]
    outside = tmp_path / "outside.jsonl"
    outside.write_text("mine\n")
    planted = tmp_path / "planted" / "metrics.jsonl"
    planted.parent.mkdir()
    planted.symlink_to(outside)
    with pytest.raises(UntrustedInputError, match="a link"):
        append_metrics(planted, {"step": 1})
    assert outside.read_text() == "mine\n"


# ---- JSON out: strict, whatever the rewards ------------------------------------------------------------


def strict(path: Path) -> object:
    return json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{path.name} holds {name}"))


def test_rewards_at_the_float_limit_give_strict_json_and_no_traceback(tmp_path: Path) -> None:
    huge = 1.7e308
    a = write_run(tmp_path / "a", [result_line(i, [huge, huge]) for i in range(12)])
    b = write_run(tmp_path / "b", [result_line(i, [-huge, -huge]) for i in range(12)])
    ok("report", str(a))
    metrics = strict(a / "metrics.json")
    assert metrics["agents"]["all"]["mean_reward"] == pytest.approx(huge), "a mean of 1.7e308s is 1.7e308"
    ok("compare", str(a), str(b), "--out", str(tmp_path / "out"))
    compared = strict(tmp_path / "out" / "compare.json")
    mean = compared["comparisons"][0]["agents"]["all"]["metrics"]["mean_reward"]
    assert mean["a"] == pytest.approx(huge) and mean["b"] == pytest.approx(-huge)
    assert mean["diff"] is None, "a difference past the float limit is null, not Infinity"
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "n/a" in md and "holds null" in md


# ---- text out: control characters escaped ----------------------------------------------------------------


def test_control_characters_from_a_run_folder_never_reach_a_file_or_the_terminal_raw(tmp_path: Path) -> None:
    lines = [result_line(i, [1.0, float(i % 2)], agent=HOSTILE, row_id=f"{HOSTILE}{i}") for i in range(12)]
    hostile = {"model": HOSTILE, "config": {"pass_threshold": 1.0, "config_paths": ["a.yaml"], "gym_overrides": {},
                                            "model_name": HOSTILE}}  # fmt: skip
    a = write_run(tmp_path / f"a{FOLDER}", lines, run=hostile)
    b_lines = [result_line(i, [1.0, 1.0], agent=HOSTILE, row_id=f"{HOSTILE}{i}") for i in range(12)]
    b = write_run(tmp_path / f"b{FOLDER}", b_lines, run=hostile)
    (a / "failures.jsonl").write_text(json.dumps({"prompt_idx": 40, "agent": HOSTILE, "error": HOSTILE,
                                                  "message": HOSTILE, "class": "data"}) + "\n")  # fmt: skip
    said = ok("report", str(a))
    out = tmp_path / "out"
    said += ok("compare", str(a), str(b), "--out", str(out), "--fail-if-worse", "0.0")
    proc = run_cli("compare", str(b), str(a), "--out", str(tmp_path / "gate"), "--fail-if-worse", "0.0", timeout=HANG_S)
    assert proc.returncode == 1, proc.stderr
    said += proc.stdout + proc.stderr
    texts = {
        "terminal": said,
        "report.md": (a / "report.md").read_text(),
        "compare.md": (out / "compare.md").read_text(),
    }
    for name, text in texts.items():
        for char in RAW_CONTROLS:
            assert char not in text, f"{char!r} reached {name} raw"
    assert "\\\\x1b" in texts["report.md"] and "\\\\u202e" in texts["report.md"], "shown escaped, not dropped"
    assert "\\x1b" in texts["terminal"] and "worse" in proc.stderr


# ---- reading: bounded, a file of zeros is an error at its line --------------------------------------------


def test_a_sparse_file_of_zeros_is_an_error_at_its_first_line_not_an_empty_report(tmp_path: Path) -> None:
    run = write_run(tmp_path / "sparse", [])
    with (run / RESULTS_FILE).open("wb") as f:
        f.truncate(64 << 20)  # 64 MB of zeros, no disk
    line = refused("report", str(run))
    assert f"{run / RESULTS_FILE}:1: not valid JSON (a NUL byte at byte 0 of the line)" in line
    assert not (run / "report.md").exists() and not (run / "metrics.json").exists()


@pytest.mark.parametrize("tail", [b"\x00" * 4096, b'{"prompt_idx": 9\x00'], ids=["zeros", "nul-in-torn-line"])
def test_zeros_after_the_last_line_are_an_error_not_a_torn_line(tmp_path: Path, tail: bytes) -> None:
    """A file a crash left zero-filled past its last line: the report names the line, never skips it."""
    run = write_run(tmp_path / "run", [result_line(i, [1.0]) for i in range(3)])
    with (run / RESULTS_FILE).open("ab") as f:
        f.write(tail)
    with pytest.raises(RunReadError, match=re.escape(f"{run / RESULTS_FILE}:4: not valid JSON (a NUL byte")):
        load_run(run, finished=False)


def test_a_line_over_its_cap_is_refused_at_its_number(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [result_line(0, [1.0]), result_line(1, [1.0], note="x" * 5000)])
    limits = ReadLimits(max_line_bytes=4096)
    with pytest.raises(RunReadError, match=re.escape(f"{run / RESULTS_FILE}:2: a line of more than 4,096 bytes")):
        load_run(run, limits=limits)


def test_each_line_is_read_again_when_asked_for_and_a_changed_line_is_refused(tmp_path: Path) -> None:
    lines = [result_line(i, [1.0, 0.0]) for i in range(3)]
    run = write_run(tmp_path / "run", lines)
    loaded = load_run(run)
    assert loaded.groups[1].record == lines[1] and loaded.groups[1].result.completions[1].reward == 0.0
    text = (run / RESULTS_FILE).read_bytes()
    (run / RESULTS_FILE).write_bytes(text.replace(b'"question 1"', b'"question X"'))
    with pytest.raises(RunReadError, match=re.escape(f"{run / RESULTS_FILE}:2: changed since it was read")):
        _ = loaded.groups[1].record


def test_a_folder_that_is_neither_an_eval_nor_a_training_run_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    line = refused("report", str(tmp_path / "empty"))
    assert "neither an eval run folder (no run.json) nor a training run folder (no metrics.jsonl)" in line
    assert run_folder_kind(write_training(tmp_path / "train")) == "training"
    fifo = tmp_path / "fifo-train"
    fifo.mkdir()
    os.mkfifo(fifo / "metrics.jsonl")
    assert run_folder_kind(fifo) == "training", "a FIFO at the name is a training folder the reader refuses"
    assert "metrics.jsonl: not a regular file (a FIFO)" in refused("report", str(fifo))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{bad json\n", "metrics.jsonl:3: not valid JSON"),
        (b'{"kind": "train", "loss": 1.0}\n', "metrics.jsonl:3: field 'step' is missing"),
        (b'{"kind": "train", "step": "2"}\n', "metrics.jsonl:3: field 'step': should be a valid number"),
        (b"[1, 2]\n", "metrics.jsonl:3: not a JSON object"),
        (b'{"step": NaN}\n', "metrics.jsonl:3: not valid JSON"),
    ],
)
def test_a_malformed_training_line_is_an_error_at_its_line_not_skipped(
    tmp_path: Path, line: bytes, expected: str
) -> None:
    run = write_training(tmp_path / "train")
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    (run / "metrics.jsonl").write_bytes(b"\n".join([*lines[:2], line.rstrip(b"\n"), *lines[2:]]))
    said = refused("report", str(run))
    assert said.startswith(f"gym-bridge report: cannot build the report of {run}: ") and expected in said
    assert not (run / "training.png").exists()


def test_a_held_out_verdict_of_the_wrong_type_is_an_error_at_its_line(tmp_path: Path) -> None:
    from gym_bridge.training.plots import read_training_run

    run = write_training(tmp_path / "train")
    with (run / "val_results.jsonl").open("a") as f:
        f.write(json.dumps({"set": "held", "step": 4, "problem": 9, "sample": 0, "correct": "yes"}) + "\n")
    with pytest.raises(UntrustedInputError, match=r"val_results\.jsonl:13: field 'correct': should be a valid boolean"):
        read_training_run(run)


HOSTILE_FILES = {
    "nul": b'{"a": 1}\n{"b"\x00: 2}\n',
    "not-json": b'{"a": 1}\n{nope\n',
    "not-object": b'{"a": 1}\n"text"\n',
    "deep": b'{"a": 1}\n' + b'{"a":' * 140 + b"1" + b"}" * 140 + b"\n",
    "huge-int": b'{"a": 1}\n{"a": ' + b"9" * 400 + b"}\n",
    "nan": b'{"a": 1}\n{"a": NaN}\n',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_the_training_reader_and_the_eval_reader_say_the_same_line(tmp_path: Path, name: str) -> None:
    """One loop (boundary/jsonl.py) under two readers' caps: the same caps, and the same words for the same bytes."""
    from gym_bridge.training import metrics as training

    assert (ReadLimits().max_jsonl_bytes, ReadLimits().max_line_bytes) == (
        training.MAX_JSONL_BYTES,
        training.MAX_LINE_BYTES,
    )
    assert training.MAX_BYTES_ENV == "GYM_BRIDGE_RUN_MAX_BYTES"
    path = tmp_path / "lines.jsonl"
    path.write_bytes(HOSTILE_FILES[name])
    with pytest.raises(UntrustedInputError) as eval_error:
        list(iter_objects(path, ReadLimits(), finished=False))
    with pytest.raises(UntrustedInputError) as training_error:
        list(training.iter_jsonl(path))
    assert str(eval_error.value) == str(training_error.value)
    assert str(eval_error.value).startswith(f"{path}:2: ")


def test_the_readers_refuse_a_fifo_and_an_oversized_file_alike(tmp_path: Path, monkeypatch) -> None:
    from gym_bridge.training import metrics as training

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"a": 1}\n' * 200)
    monkeypatch.setenv("GYM_BRIDGE_RUN_MAX_BYTES", "1000")
    for path in (fifo, big):
        with pytest.raises(UntrustedInputError) as eval_error:
            list(iter_objects(path, ReadLimits.from_env(), finished=False))
        with pytest.raises(UntrustedInputError) as training_error:
            list(training.iter_jsonl(path))
        assert str(eval_error.value) == str(training_error.value)
    assert "set GYM_BRIDGE_RUN_MAX_BYTES to read a larger one" in str(eval_error.value)


# ---- the one decoder: the boundary's, with the depth measured on the bytes --------------------------------


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**64 - 1)
    | st.text(alphabet=st.sampled_from('ab"\\[]{}\n\x00\u202e\u2028é'), max_size=12),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(alphabet='k"\\[{', max_size=4), inner, max_size=3),
    max_leaves=40,
)  # fmt: skip


@FUZZ
@given(value=JSON_VALUES, ascii_only=st.booleans(), indent=st.booleans())
def test_the_depth_measured_on_the_bytes_is_the_boundarys_depth(value: object, ascii_only: bool, indent: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only, indent=1 if indent else None).encode()
    assert raw_depth(raw) == depth(value)


@st.composite
def json_lines(draw: st.DrawFn) -> bytes:
    """A line that is JSON of any depth, or nearly JSON: cut, NaN-like tokens, huge numbers, raw bytes."""
    kind = draw(st.sampled_from(["value", "nested", "cut", "token", "bytes"]))
    if kind == "value":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "nested":
        n = draw(st.integers(55, 75))
        opener = draw(st.sampled_from([b"[", b'{"k":']))
        return opener * n + b"1" + (b"]" if opener == b"[" else b"}") * n
    if kind == "cut":
        raw = json.dumps({"a": draw(JSON_VALUES)}).encode()
        return raw[: draw(st.integers(0, len(raw)))]
    if kind == "token":
        token = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 400, b"-0", b"1E400"]))
        return b'{"x": ' + token + b"}"
    return draw(st.binary(max_size=40))


@FUZZ
@given(raw=json_lines())
def test_decode_line_refuses_and_accepts_exactly_what_the_boundary_does(raw: bytes) -> None:
    try:
        expected = loads_object(raw, "f.jsonl:3")
    except UntrustedInputError as exc:
        with pytest.raises(RunReadError) as refused_here:
            decode_line(raw, "f.jsonl:3")
        assert str(refused_here.value) == str(exc)
    else:
        assert decode_line(raw, "f.jsonl:3") == expected


# ---- bounded: the viewer's page, parallel reads ------------------------------------------------------------


def test_the_viewer_page_is_bounded_and_the_report_says_what_it_holds(tmp_path: Path, monkeypatch) -> None:
    from gym_bridge.eval import viewer

    run = write_run(tmp_path / "run", [result_line(i, [1.0, 0.0], note="n" * 2000) for i in range(60)])
    monkeypatch.setattr(viewer, "MAX_DETAIL_BYTES", 8_000)
    monkeypatch.setattr(viewer, "MAX_PAGE_BYTES", 30_000)
    from gym_bridge.eval.report import build_report

    build_report(run)
    html = (run / "report.html").read_text()
    data = json.loads(re.search(r'id="run-data">(.*?)</script>', html, re.S).group(1))  # type: ignore[union-attr]
    whole = [g for g in data["groups"] if g["completions"][0]["trace"] is not None or g["completions"][0]["grader"]]
    slim = [g for g in data["groups"] if "not embedded" in g["completions"][0]["text"]]
    assert whole and slim and len(whole) + len(slim) == len(data["groups"]) < 60
    assert len(html.encode()) < 30_000 + 30_000, "the data within its budget, plus the page"
    md = (run / "report.md").read_text()
    assert f"report.html holds {len(whole)} prompt groups whole, {len(slim)} without their traces" in md
    assert f"{60 - len(whole) - len(slim)} left out" in md
    assert json.loads((run / "metrics.json").read_text())["prompts_done"] == 60, "the metrics count every group"


def test_runs_read_in_parallel_give_what_one_process_gives(tmp_path: Path, monkeypatch) -> None:
    from gym_bridge.eval import compare

    a = write_run(tmp_path / "a", [result_line(i, [float(i % 2), 1.0]) for i in range(30)])
    b = write_run(tmp_path / "b", [result_line(i, [1.0, float(i % 3 == 0)]) for i in range(30)])
    alone = compare.compare_runs([a, b], tmp_path / "one").report
    monkeypatch.setattr(compare, "PARALLEL_BYTES", 0)
    assert compare.compare_runs([a, b], tmp_path / "two").report == alone
    bad = write_run(tmp_path / "bad", [result_line(0, [1.0]), {**result_line(1, [1.0]), "prompt_idx": "one"}])
    with pytest.raises(RunReadError, match=re.escape(f"{bad / RESULTS_FILE}:2: field 'prompt_idx'")):
        compare.compare_runs([a, bad, b], tmp_path / "three")
    assert not (tmp_path / "three").exists()
