"""Hostile files given to the real commands: a FIFO or ``/dev/zero`` as the dataset, a YAML alias bomb as an eval or a
training config, dataset lines nested 100,000 deep or holding a 5,000-digit number, a link planted in a run folder
that ``eval --resume`` repairs and appends to, an endpoint that fails preflight. Each ends in one line on stderr,
exit 2, in bounded time and memory, with nothing written outside the folder and no run folder left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from gym_bridge.gym.servers.reaper import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "eval_equivalence_tools.yaml"
TRAIN = REPO / "examples" / "grpo_nemo_gym.yaml"
ROW = '{"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}, "agent_ref": {"name": "a"}}'
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _gym_bridge(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    """The command's result and its own peak memory in MiB (``wait4``: this child's, not every child's so far)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "gym_bridge.cli", *args], cwd=cwd, stdout=out, stderr=err)
        timer = threading.Timer(120, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = {name: f.read().decode(errors="replace") for name, f in (("out", out), ("err", err))}
    done = subprocess.CompletedProcess(proc.args, proc.returncode, text["out"], text["err"])
    return done, usage.ru_maxrss // 1024


def _one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The refusal: exit 2 and no traceback; one ``gym-bridge <command>:`` line (a dataset's refusal lists each bad
    line of the file on a line of its own), returned as one string."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith(f"gym-bridge {command}: ")]
    assert lines, done.stderr[-3000:]
    return " | ".join(lines)


def test_a_dataset_that_is_a_fifo_or_a_device_or_hostile_json_is_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_text("\n".join([ROW, "[" * 100_000 + "]" * 100_000, '{"x": ' + "7" * 5000 + "}", ROW]) + "\n")
    expected = {
        "fifo.jsonl": "not a regular file (a FIFO)",
        "zero.jsonl": "not a regular file (a character device)",
        "hostile.jsonl": "hostile.jsonl:2: ",
    }
    for name, what in expected.items():
        out = tmp_path / f"run-{name}"
        done, _ = _gym_bridge("eval", str(EXAMPLE), f"dataset={tmp_path / name}", f"output_dir={out}", cwd=tmp_path)
        line = _one_line(done, "eval")
        assert what in line, line
        assert not out.exists(), "a refused dataset starts nothing and makes no run folder"
    assert "hostile.jsonl:3: not valid JSON (number is infinity" in done.stderr


def test_a_yaml_alias_bomb_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(BOMB)
    for command in ("eval", "train"):
        done, peak_mib = _gym_bridge(command, str(tmp_path / "bomb.yaml"), cwd=tmp_path)
        line = _one_line(done, command)
        assert "bomb.yaml: its aliases expand to more than 1,000,000 nodes" in line, line
        assert peak_mib < 2048, f"{command}: {peak_mib} MiB"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"]


def test_eval_resume_refuses_a_planted_link_and_never_truncates_its_target(tmp_path: Path) -> None:
    """``eval --resume`` repairs a torn last line of ``failures.jsonl`` and appends to it: a link planted there to a
    file without a final newline (an API token) is refused in one line, and the token keeps every byte."""
    run = tmp_path / "run"
    first, _ = _gym_bridge("eval", str(EXAMPLE), f"output_dir={run}", "limit=1", cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    token = tmp_path / "api-token"
    token.write_bytes(b"sk-secret-without-a-newline")
    (run / "failures.jsonl").unlink(missing_ok=True)
    (run / "failures.jsonl").symlink_to(token)
    done, _ = _gym_bridge("eval", str(EXAMPLE), f"output_dir={run}", "limit=2", "--resume", cwd=REPO)
    line = _one_line(done, "eval")
    assert "failures.jsonl: a link" in line, line
    assert token.read_bytes() == b"sk-secret-without-a-newline"


def test_a_failed_preflight_leaves_no_run_folder(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"
    out = tmp_path / "run"
    done, _ = _gym_bridge("eval", str(EXAMPLE), f"output_dir={out}", f"base_urls=[{dead}]", cwd=REPO)
    assert "nothing answers" in _one_line(done, "eval")
    assert not out.exists()
    again, _ = _gym_bridge("eval", str(EXAMPLE), f"output_dir={out}", f"base_urls=[{dead}]", cwd=REPO)
    assert "not empty" not in again.stderr, "the next run is not refused as 'not empty'"


def test_a_misspelt_agent_is_refused_in_seconds_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done, _ = _gym_bridge(
        "eval", str(EXAMPLE), f"output_dir={out}", "agent_map={_default: lc_equivalence_rule_simple_agnt}", cwd=REPO
    )
    line = _one_line(done, "eval")
    assert "'lc_equivalence_rule_simple_agnt' (named by agent_map._default, line 1" in line, line
    assert "they define: example_single_tool_call_simple_agent, lc_equivalence_rule_simple_agent" in line
    assert not out.exists() and "NeMo-Gym" not in done.stderr, "no Gym set was started"
