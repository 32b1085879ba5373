"""Preflight against real servers: our OpenAIServer set up like each misconfigured vLLM, a port where
nothing listens, a socket that never answers, the CLI command, and `gym-bridge eval` stopping before Ray."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.preflight import (
    VLLM_TOOL_FLAGS,
    EndpointProblem,
    PreflightError,
    check_endpoint,
    check_endpoints,
    preflight_endpoints,
    rows_use_tools,
)
from gym_bridge.serving import AUTO_TOOL_CHOICE_REFUSED, OpenAIServer, ServerFeatures

REPO = Path(__file__).resolve().parents[2]


def _serve(tokenizer, features: ServerFeatures) -> Iterator[str]:
    from gym_bridge.generation.scripted import ScriptedGeneration

    server = OpenAIServer(
        ScriptedGeneration(tokenizer, max_new_tokens=8), tokenizer, served_model_name="tiny", features=features
    )
    url = server.start_in_thread()
    try:
        yield url
    finally:
        server.stop_thread()


@pytest.fixture(scope="module")
def good_url(tiny_tokenizer) -> Iterator[str]:
    yield from _serve(tiny_tokenizer, ServerFeatures())


@pytest.fixture(scope="module")
def no_tools_url(tiny_tokenizer) -> Iterator[str]:
    yield from _serve(tiny_tokenizer, ServerFeatures(auto_tool_choice=False))


@pytest.fixture(scope="module")
def no_logprobs_url(tiny_tokenizer) -> Iterator[str]:
    yield from _serve(tiny_tokenizer, ServerFeatures(logprobs=False))


@pytest.fixture(scope="module")
def no_token_ids_url(tiny_tokenizer) -> Iterator[str]:
    yield from _serve(tiny_tokenizer, ServerFeatures(token_ids=False))



@pytest.fixture()
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port("127.0.0.1")}/v1"


def test_a_good_server_passes_every_check_tools_included(good_url):
    check = check_endpoint(good_url, "tiny", tools=True)
    assert check.ok, check.line
    assert "tiny" in check.served_models
    assert check.line.startswith(f"{good_url}: ok (serves 'tiny', token ids and logprobs, tools accepted;")


def test_a_wrong_model_name_lists_the_served_names(good_url):
    check = check_endpoint(good_url, "Qwen/Qwen3-4B")
    assert check.problem is EndpointProblem.MODEL_NOT_SERVED
    names = ", ".join(repr(n) for n in check.served_models)
    assert check.served_models[0] == "tiny"
    assert check.line == (
        f"{good_url}: does not serve model 'Qwen/Qwen3-4B'; it serves {names} (set model_name to the served name)"
    )


def test_a_server_without_logprobs_is_named(no_logprobs_url):
    check = check_endpoint(no_logprobs_url, "tiny")
    assert check.problem is EndpointProblem.NO_LOGPROBS
    assert check.line == (
        f"{no_logprobs_url}: the server returns no logprobs (choices[0].logprobs.content is empty for logprobs=true); "
        "Gym needs per-token logprobs: serve the model with vLLM or `gym-bridge serve`"
    )


def test_a_server_without_token_ids_is_named(no_token_ids_url):
    check = check_endpoint(no_token_ids_url, "tiny")
    assert check.problem is EndpointProblem.NO_TOKEN_IDS
    assert check.line == (
        f"{no_token_ids_url}: the server returns no token ids "
        "(no choices[0].token_ids for return_token_ids=true; vLLM >= 0.10.2 has it)"
    )


def test_a_server_refusing_tools_gets_the_vllm_flags(no_tools_url):
    assert check_endpoint(no_tools_url, "tiny").ok  # without tools in the data it is fine
    check = check_endpoint(no_tools_url, "tiny", tools=True)
    assert check.problem is EndpointProblem.TOOLS_REFUSED
    assert check.line == (
        f"{no_tools_url}: refuses chats with tools (HTTP 400: {AUTO_TOOL_CHOICE_REFUSED}); start vLLM with "
        "--enable-auto-tool-choice --tool-call-parser hermes"
    )
    assert VLLM_TOOL_FLAGS in check.line


def test_nothing_listening_is_said_at_once(dead_url):
    check = check_endpoint(dead_url, "tiny", timeout_s=5.0)
    assert check.problem is EndpointProblem.UNREACHABLE
    assert check.line == f"{dead_url}: nothing answers (connection refused)"


def test_a_server_that_never_answers_times_out_within_the_bound():
    with socket.socket() as sock:  # accepts connections (the backlog) but never reads or answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        check = check_endpoint(url, "tiny", timeout_s=1.0)
    assert check.problem is EndpointProblem.TIMEOUT
    assert check.line in (
        f"{url}: no answer to GET /v1/models within the timeout (ReadTimeout)",
        f"{url}: the checks did not finish within 1 s",
    )


def test_preflight_raises_one_line_per_failed_endpoint(good_url, no_tools_url, dead_url):
    assert [c.ok for c in check_endpoints([good_url, no_tools_url], "tiny", tools=True)] == [True, False]
    with pytest.raises(PreflightError) as info:
        preflight_endpoints([good_url, no_tools_url, dead_url], "tiny", tools=True)
    lines = str(info.value).splitlines()
    assert lines == [
        f"endpoint {no_tools_url}: refuses chats with tools (HTTP 400: {AUTO_TOOL_CHOICE_REFUSED}); "
        f"start vLLM with {VLLM_TOOL_FLAGS}",
        f"endpoint {dead_url}: nothing answers (connection refused)",
    ]
    assert [c.base_url for c in info.value.failed] == [no_tools_url, dead_url]
    assert preflight_endpoints([good_url], "tiny", tools=True)[0].ok


def test_rows_use_tools():
    rows = [json.loads(line) for line in (REPO / "examples/data/gym_rows.jsonl").read_text().splitlines() if line]
    assert rows_use_tools(rows)
    assert not rows_use_tools([r for r in rows if not r["responses_create_params"].get("tools")])


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.mark.e2e
def test_check_endpoint_command(good_url, no_tools_url, dead_url):
    ok = _cli("check-endpoint", good_url, "--model", "tiny", "--tools")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{good_url}: ok (serves 'tiny'")
    bad = _cli("check-endpoint", good_url, no_tools_url, dead_url, "--model", "tiny", "--tools")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        f"{no_tools_url}: refuses chats with tools (HTTP 400: {AUTO_TOOL_CHOICE_REFUSED}); "
        f"start vLLM with {VLLM_TOOL_FLAGS}",
        f"{dead_url}: nothing answers (connection refused)",
    ]


@pytest.mark.e2e
def test_eval_with_bad_endpoints_stops_before_ray_or_gym(tmp_path, good_url, dead_url):
    """The run exits 2 with one line per bad endpoint, no traceback, and never imports Ray nor starts Gym: the
    endpoints are checked before their tokenizer loads, so neither torch nor transformers is imported either."""
    out = tmp_path / "run"
    code = (
        "import sys; from gym_bridge import cli; rc = cli.main(sys.argv[1:]); "
        "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules), file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "eval",
            "examples/eval_equivalence_tools.yaml",
            f"output_dir={out}",
            f"base_urls=[{good_url},{dead_url}]",
            "model_name=served-elsewhere",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gym-bridge eval: ")]
    assert lines[0].startswith(f"gym-bridge eval: endpoint {good_url}: does not serve model 'served-elsewhere'; it serves 'tiny'")
    assert lines[1] == f"gym-bridge eval: endpoint {dead_url}: nothing answers (connection refused)"
    assert len(lines) == 2
    assert proc.stderr.splitlines()[-1] == "[]", "none of Ray, torch or transformers is imported"
    assert not (out / "gym-logs").exists()
