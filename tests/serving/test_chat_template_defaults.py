"""NeMo-RL's chat-template arguments reach every render: our server renders each chat with its
``default_chat_template_kwargs`` (a request's own keys over them, as vLLM merges them), ``/tokenize`` the same, and
a training config's two keys for them (``policy.tokenizer.chat_template_kwargs``, the vLLM server's
``default_chat_template_kwargs``) become that one mapping. A real HTTP server over the tiny model with a thinking
template; the expected ids come from the tokenizer's own ``apply_chat_template``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from thinking_model import thinking_model
from transformers import AutoTokenizer

from gym_bridge.config.chat_template import chat_template_kwargs
from gym_bridge.config.keys import TrainingConfigError

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
SERVING = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from gym_bridge.generation.hf import HFGeneration
    from gym_bridge.generation.hf_config import HFGenerationConfig
    from gym_bridge.serving import OpenAIServer

    folder = thinking_model(tiny_model_dir, tmp_path_factory.mktemp("thinking") / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation = HFGeneration(HFGenerationConfig(model=str(folder), max_new_tokens=2, seed=0))
    server = OpenAIServer(
        generation, tokenizer, served_model_name="tiny", default_chat_template_kwargs={"enable_thinking": True}
    )
    server.start_in_thread()
    yield server, tokenizer
    server.stop_thread()
    generation.shutdown()


def rendered(tokenizer, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **kwargs)  # fmt: skip


def test_the_server_renders_with_its_defaults_and_a_request_overrides_them(thinking_server):
    server, tokenizer = thinking_server
    thinking, plain = rendered(tokenizer, enable_thinking=True), rendered(tokenizer, enable_thinking=False)
    assert thinking != plain and tokenizer.decode(thinking).endswith("<think>\n")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        by_default = client.post("/chat/completions", json=body).json()["choices"][0]["message"]
        off = client.post("/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        tokenized = client.post(
            f"{server.root_url}/tokenize", json={"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True}
        )
    assert by_default["prompt_token_ids"] == thinking
    assert off.json()["choices"][0]["message"]["prompt_token_ids"] == plain
    assert tokenized.json()["tokens"] == thinking


def test_a_training_configs_two_keys_become_one_mapping_the_servers_over_the_tokenizers():
    tokenizer_only = {"policy": {"tokenizer": {"chat_template_kwargs": {"enable_thinking": True, "x": 1}}}}
    assert chat_template_kwargs(tokenizer_only) == {"enable_thinking": True, "x": 1}
    both = {"policy": {"tokenizer": {"chat_template_kwargs": {"enable_thinking": True, "x": 1}},
                       "generation": {"vllm_cfg": {"http_server_serving_chat_kwargs": {
                           "default_chat_template_kwargs": {"enable_thinking": False},
                           "chat_template_kwargs": {"y": 2}}}}}}  # fmt: skip
    assert chat_template_kwargs(both) == {"enable_thinking": False, "x": 1}, "vLLM's spelling first, the older unread"
    legacy = {
        "policy": {"generation": {"vllm_cfg": {"http_server_serving_chat_kwargs": {"chat_template_kwargs": {"y": 2}}}}}
    }
    assert chat_template_kwargs(legacy) == {"y": 2}
    assert chat_template_kwargs({}) == {}
    with pytest.raises(
        TrainingConfigError, match=r"policy\.tokenizer\.chat_template_kwargs may not set \['tokenize'\]"
    ):
        chat_template_kwargs({"policy": {"tokenizer": {"chat_template_kwargs": {"tokenize": False}}}})
    with pytest.raises(TrainingConfigError, match=rf"{SERVING}\.default_chat_template_kwargs must be a mapping"):
        chat_template_kwargs({"policy": {"generation": {"vllm_cfg": {"http_server_serving_chat_kwargs": {
            "default_chat_template_kwargs": ["enable_thinking"]}}}}})  # fmt: skip
