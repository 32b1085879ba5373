"""The embedded tiny model: deterministic offline build, cache reuse, tokenizer and chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gym_bridge.models import tiny
from gym_bridge.models.cache import default_cache_dir
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.models.tiny import (
    MARKER_FILE,
    RECIPE_TAG,
    build_tiny_model,
    load_tiny,
    tiny_model_path,
)

# Builds in a fresh interpreter with the hub offline and every socket connect refused,
# so a build that tried to reach the network would fail here.
_OFFLINE_BUILD = """
import socket, sys
def _refuse(*a, **k):
    raise OSError("network access attempted during the tiny model build")
socket.socket.connect = _refuse
socket.create_connection = _refuse
import huggingface_hub.constants as c
assert c.HF_HUB_OFFLINE, "HF_HUB_OFFLINE was not honoured"
from gym_bridge.models.tiny import build_tiny_model
print(build_tiny_model(sys.argv[1]))
"""


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_build_is_deterministic_and_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE_BUILD, str(tmp_path / "other")],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = Path(proc.stdout.strip().splitlines()[-1])
    assert other == tmp_path / "other" / f"{RECIPE_TAG}-seed0"
    assert other != tiny_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (other / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    a, b = _tensors(tiny_model_dir), _tensors(other)
    assert a.keys() == b.keys() and len(a) > 5
    for key in a:
        assert a[key].dtype == torch.float32, key
        assert torch.equal(a[key], b[key]), key
    # The weights really are random, not a constant fill.
    emb = a["model.embed_tokens.weight"]
    assert emb.std() > 0.005 and emb.unique().numel() > 1000


def test_second_build_reuses_the_folder(tiny_model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    inode = tiny_model_dir.stat().st_ino
    again = build_tiny_model(cache_dir=tiny_model_dir.parent)
    assert again == tiny_model_dir
    assert tiny_model_dir.stat().st_ino == inode
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before
    marker = json.loads((tiny_model_dir / MARKER_FILE).read_text())
    assert marker["recipe"] == RECIPE_TAG and marker["seed"] == 0
    # No temporary folders left beside the build.
    assert not [p.name for p in tiny_model_dir.parent.iterdir() if p.name.startswith(".")]


def test_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    target = tiny_model_path(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half written")
    built = build_tiny_model(cache_dir=tmp_path)
    assert built == target
    assert (built / MARKER_FILE).is_file()
    json.loads((built / "config.json").read_text())  # a real config again
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_tiny_model(cache_dir=tmp_path, seed=3))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 3 and len(set(results)) == 1
    assert (results[0] / MARKER_FILE).is_file()
    assert results[0].name == f"{RECIPE_TAG}-seed3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]


def test_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(cache_dir=tmp_path, seed=1)
    assert other.name == f"{RECIPE_TAG}-seed1"
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    a, b = _tensors(tiny_model_dir), _tensors(other)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_default_cache_dir_and_resolve(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    monkeypatch.setenv("GYM_BRIDGE_CACHE", str(tiny_model_dir.parent))
    assert default_cache_dir() == tiny_model_dir.parent
    assert tiny_model_path() == tiny_model_dir
    assert resolve_model_path("tiny") == tiny_model_dir  # reuses, does not rebuild elsewhere
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(str(missing))
    monkeypatch.delenv("GYM_BRIDGE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "gym-bridge"


def test_model_config(tiny_model_dir: Path, tiny_tokenizer) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg.get("head_dim", 64) == 64
    assert cfg["vocab_size"] == len(tiny_tokenizer)
    assert 1000 <= len(tiny_tokenizer) <= 2048
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["eos_token_id"] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") == tiny_tokenizer.eos_token_id
    assert cfg["pad_token_id"] == tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>") == tiny_tokenizer.pad_token_id
    assert cfg["bos_token_id"] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert tiny_tokenizer.eos_token_id in gen["eos_token_id"]
    assert gen["pad_token_id"] == tiny_tokenizer.pad_token_id
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["chat_template"] == tiny.CHAT_TEMPLATE


def test_load_tiny_forward(tiny_model_dir: Path) -> None:
    tok, model = load_tiny(cache_dir=tiny_model_dir.parent)
    assert not model.training
    assert model.config.head_dim == 64
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tok.encode("12 + 7 = 19")])
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12 + 7 = 19\n123456789 * 3 = 370370367",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF  ",
    "Unicode: héllo wörld, naïve café, 日本語, emoji 😀👍🏽, e\u0301 (not NFC), \u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><think>x</think><|endoftext|>",
    "",
    "\x00\x01 control bytes \x7f",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tiny_tokenizer, tiny_model_dir: Path, text: str) -> None:
    from tokenizers import Tokenizer

    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text
    # transformers loads the tokenizer exactly as trained (no model-specific rebuild).
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids


def test_special_and_added_tokens(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *tiny.EXTRA_TOKENS]:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t, t
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    ids = tok.encode("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    # Tool-call markup is not "special": it survives skip_special_tokens, like Qwen's.
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def test_chat_template_with_tools(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "2 + 3 = 5"},
        {"role": "user", "content": "Again, with a JSON string."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}],
        },
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0], ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        '<|im_start|>assistant\nLet me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5<|im_end|>\n"
        "<|im_start|>user\nAgain, with a JSON string.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tiny_tokenizer.decode(ids) == expected


def test_chat_template_without_tools(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        f"<|im_start|>system\n{tiny.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    with_sys = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert with_sys == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert "<tools>" not in with_sys
