"""End-to-end ``gym-bridge eval`` runs in subprocesses: real Ray, real Gym, the embedded scripted policy.

One run is SIGKILLed after its first result, resumed and SIGINTed (each with its own Ray), then resumed to the
end (joined to the evals' shared Ray, ``eval_ray_env``) while one of its Gym resources servers is SIGKILLed (Gym
restarts it and every group still finishes):
exactly one record per prompt group, exit code 130 and no process left on SIGINT, and a
report whose PNG is a real image. A resume with a changed N is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gym_bridge.eval.store import read_jsonl
from gym_bridge.testing import wait_until

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "eval_equivalence_tools.yaml"
ROWS = 24


def eval_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gym_bridge.cli", "eval", str(EXAMPLE), *args, "--no-progress"]


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The command with its own Ray, or joined to the Ray ``env`` names (``eval_ray_env``)."""
    env = env or {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def results(run: Path) -> list[dict]:
    return read_jsonl(run / "results.jsonl")


def wait_for_results(proc: subprocess.Popen, run: Path, log: Path, count: int, timeout_s: float = 240) -> None:
    def written() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"eval exited with {proc.returncode} early:\n{log.read_text()[-3000:]}")
        path = run / "results.jsonl"
        return path.exists() and path.read_bytes().count(b"\n") >= count  # complete lines only; no parse per poll

    try:
        wait_until(written, timeout_s, f"{count} results written", poll_s=0.05)
    except TimeoutError:
        proc.kill()
        pytest.fail(f"no {count} results within {timeout_s}s:\n{log.read_text()[-3000:]}")


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def reap(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait for ``procs`` to end; return those still alive."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    lines = [line for line in (REPO / "examples/data/gym_rows.jsonl").read_text().splitlines() if line.strip()]
    path = tmp_path_factory.mktemp("eval-data") / "rows.jsonl"
    path.write_text("\n".join(lines[i % len(lines)] for i in range(ROWS)) + "\n")
    return path


pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_kill_resume_interrupt_resume(dataset: Path, tmp_path: Path, eval_ray_env: dict[str, str]) -> None:
    run = tmp_path / "run"
    args = [f"dataset={dataset}", f"output_dir={run}", "num_generations_per_prompt=2", "concurrency=1"]

    t0 = time.monotonic()
    # 1. SIGKILL after the first result; a torn line as if the kill hit a write.
    log = tmp_path / "1.log"
    proc = start(eval_command(*args), log)
    try:
        wait_for_results(proc, run, log, 1)
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    # Gym's reaper and Ray's raylet notice their driver died within a second or two; Ray's runtime-env
    # and dashboard agents outlive it by more than 20 s, so whatever is left after 3 s is killed here.
    for p in reap(children, 3):
        p.kill()
    print(f"killed after {time.monotonic() - t0:.0f}s")
    killed_at = len(results(run))
    assert 1 <= killed_at < ROWS
    with (run / "results.jsonl").open("ab") as f:
        f.write(b'{"prompt_idx": 999, "line": 1, "completions": [{"rew')

    # 2. A resume with a changed N is refused before anything starts.
    refused = subprocess.run(
        eval_command(*args[:-2], "num_generations_per_prompt=3", "concurrency=1", "--resume"),
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert "num_generations_per_prompt (2 -> 3)" in refused.stderr

    # 3. Resume, then SIGINT once it has written more: exit 130, results kept, nothing left running.
    log = tmp_path / "3.log"
    proc = start(eval_command(*args, "--resume"), log)
    try:
        wait_for_results(proc, run, log, killed_at + 1)
        children = descendants(proc.pid)
        assert children, "expected Ray / Gym processes under the eval command"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(180)
    finally:
        proc.kill()
    assert code == 130, log.read_text()[-3000:]
    assert "--resume" in log.read_text()
    left = reap(children, 60)
    print(f"interrupted after {time.monotonic() - t0:.0f}s")
    assert not left, [(p.pid, p.name(), p.cmdline()[:4]) for p in left]
    interrupted_at = len(results(run))
    assert killed_at < interrupted_at < ROWS
    assert json.loads((run / "run.json").read_text())["sessions"][-1]["outcome"] == "interrupted"

    # 4. Resume to the end: exactly one record per prompt group, and the report. The killed and the interrupted
    # command started their own Ray (what they leave running is checked above); this one joins the evals' Ray.
    # Its equivalence_rule resources server is SIGKILLed once results flow: Gym restarts it and the run goes on.
    log = tmp_path / "4.log"
    proc = start(eval_command(*args, "--resume"), log, eval_ray_env)
    server_log = run / "gym-logs" / "lc_equivalence_rule.log"
    try:
        wait_for_results(proc, run, log, interrupted_at + 1)
        os.kill(int(re.findall(r"Started server process \[(\d+)\]", server_log.read_text())[-1]), signal.SIGKILL)
        assert proc.wait(600) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert "lc_equivalence_rule exited with code -9; restarting it (1 of 3)" in server_log.read_text()
    print(f"finished after {time.monotonic() - t0:.0f}s")
    records = results(run)
    assert sorted(r["prompt_idx"] for r in records) == list(range(ROWS))
    for r in records:
        assert len(r["completions"]) == 2
        for c in r["completions"]:
            assert c["termination"] == "stop" and c["generated_tokens"] > 0 and "reward" in c["gym_result"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["prompts_done"] == ROWS and metrics["prompts_failed"] == 0
    # The scripted policy calls the weather tool (reward 1) and answers "Reply with exactly" rows.
    assert metrics["agents"]["example_single_tool_call_simple_agent"]["mean_reward"] == 1.0
    assert 0.5 < metrics["agents"]["lc_equivalence_rule_simple_agent"]["pass_at_k"]["pass@2"] < 1.0
    assert "pass@2" in (run / "report.md").read_text()
    _check_png(run / "report.png")

    # 5. `gym-bridge report` rebuilds the report from the files.
    (run / "report.png").unlink()
    (run / "metrics.json").unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "gym_bridge.cli", "report", str(run)], cwd=REPO, timeout=120)
    assert rebuilt.returncode == 0
    assert json.loads((run / "metrics.json").read_text())["agents"] == metrics["agents"]
    _check_png(run / "report.png")


def _check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
