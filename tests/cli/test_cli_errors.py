"""The CLI's one error boundary, through the real command in a subprocess: each subcommand given a wrong
model, a missing file, a dead endpoint, a busy port or a bad override ends with exactly one line on stderr,
``gym-bridge <command>: <message>``, and exit code 2; ``--traceback`` shows the whole traceback instead."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/eval_equivalence_tools.yaml"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _cases(tmp: Path, dead_url: str, busy_port: int) -> list[tuple[list[str], str]]:
    """(arguments, the start of the one stderr line)."""
    a_file = tmp / "a-file"
    a_file.write_text("not a folder\n")
    out = str(tmp / "run")
    return [
        (["serve", "--model", "nosuchmodel"], "gym-bridge serve: model 'nosuchmodel' is neither a built-in model"),
        (["serve", "--policy", "instant", "--port", str(busy_port)], f"gym-bridge serve: cannot listen on 127.0.0.1:{busy_port}"),
        (["serve", "--upstream", dead_url], f"gym-bridge serve: upstream {dead_url}: GET /models failed (ConnectError"),
        (["build-tiny", "--cache-dir", str(a_file / "cache")], "gym-bridge build-tiny: cannot write the model cache folder"),
        (["eval", str(tmp / "missing.yaml")], f"gym-bridge eval: cannot read the eval config {tmp / 'missing.yaml'}"),
        (["eval", EXAMPLE, f"output_dir={out}-1", "limit=0"], "gym-bridge eval: invalid eval config: limit: Input should be"),
        (["eval", EXAMPLE, f"output_dir={out}-2", "limit"], "gym-bridge eval: override 'limit' is not key=value"),
        (["eval", EXAMPLE, f"output_dir={out}-3", f"dataset={tmp / 'missing.jsonl'}"], "gym-bridge eval: cannot read the dataset"),
        (["eval", EXAMPLE, f"output_dir={out}-4", f"base_urls=[{dead_url}]"], f"gym-bridge eval: endpoint {dead_url}: nothing answers"),
        (["eval", EXAMPLE, f"output_dir={out}-5", "tokenizer=nosuchmodel"], "gym-bridge eval: model 'nosuchmodel' is neither"),
        (["check-endpoint", dead_url, "--model", "tiny"], f"{dead_url}: nothing answers (connection refused)"),
        (["report", str(tmp / "no-run")], "gym-bridge report: cannot build the report of"),
    ]  # fmt: skip


def test_every_command_ends_a_bad_input_in_one_line_and_exit_code_2(tmp_path, dead_url, busy_port):
    failures = []
    for args, start in _cases(tmp_path, dead_url, busy_port):
        proc = run_cli(*args, cwd=REPO)
        lines = proc.stderr.splitlines()
        if proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith(start):
            failures.append(f"gym-bridge {' '.join(args)}: exit {proc.returncode}, stderr:\n{proc.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_serve_claims_its_port_before_it_loads_a_model(busy_port):
    """``gym-bridge serve`` (the tiny model by default) on a busy port: one line, and torch was never imported."""
    code = (
        "import sys; from gym_bridge.cli import main; code = main(['serve', '--port', sys.argv[1]]); "
        "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(busy_port)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 2 and lines[0].startswith(f"gym-bridge serve: cannot listen on 127.0.0.1:{busy_port}: ")
    assert lines[1] == "torch imported: False"


def test_traceback_shows_the_whole_traceback():
    for args in (
        ["--traceback", "serve", "--model", "nosuchmodel"],
        ["serve", "--model", "nosuchmodel", "--traceback"],
    ):
        proc = run_cli(*args, cwd=REPO)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback (most recent call last)" in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("gym_bridge.models.registry.ModelNotFoundError: model")
