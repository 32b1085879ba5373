"""Hostile chat templates and JSON inside strings (issue 57).

A model folder's chat template is code from the folder: it renders in Jinja's sandbox within a time and output
bound (:mod:`gym_bridge.boundary.chat_template`), in a worker thread. Through the real server over the tiny
model's tokenizer: a runaway template fails its own request (a 400 naming the template and the bound) while 8
innocent chats sent beside it are answered, and the real ``gym-bridge serve --model DIR`` rendering one stops on
SIGTERM. Our renderer is text- and token-identical to ``apply_chat_template`` on the tiny and SmolLM2 templates (named
chats with tools and several turns, and Hypothesis chats). Tool-call ``arguments`` nested 50,000 deep are a 400
naming the field, never a RecursionError.

Time bounds here are generous liveness waits, never speed claims.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import AutoTokenizer

from gym_bridge.data import datum_from_chat
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym_model.translate import TranslationError, responses_to_chat
from gym_bridge.serving import OpenAIServer
from gym_bridge.serving.chat import build_chat_prompt, render_ids
from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.parsers import parse_tool_calls
from gym_bridge.boundary.chat_template import (
    DEFAULT_BOUNDS,
    RENDER_THREADS,
    RenderBounds,
    TemplateBoundError,
    render_chat_template,
    render_template,
)
from gym_bridge.testing import wait_until

REPO = Path(__file__).resolve().parents[2]
RUNAWAY = "{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}"
"""10^10 iterations that print nothing and call nothing: only the per-iteration check stops them."""
TRIGGER = "run away"
TRAPPED = "{% if messages[-1].content == '" + TRIGGER + "' %}" + RUNAWAY + "{% endif %}"
DEEP = 50_000
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CHATS: dict[str, list[dict[str, Any]]] = {
    "one turn": [{"role": "user", "content": "What is 12 + 7?"}],
    "system and turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather in Paris? {{ not jinja }} <|im_end|>"},
    ],
    "tool round trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny, 21 C."},
        {"role": "user", "content": "And tomorrow?"},
    ],
}


def _tokenizer(folder: Path) -> Any:
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def trapped_server(tiny_model_dir: Path) -> Iterator[OpenAIServer]:
    """Our server over the tiny tokenizer whose template runs away when the last message says ``run away``."""
    tokenizer = _tokenizer(tiny_model_dir)
    tokenizer.chat_template = TRAPPED + tokenizer.chat_template
    served = OpenAIServer(ScriptedGeneration(tokenizer), tokenizer, served_model_name="tiny")
    served.start_in_thread()
    yield served
    served.stop_thread()


def _chat(url: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    with httpx.Client(timeout=120) as client:
        return client.post(f"{url}/chat/completions", json=body)


# ---------------------------------------------------------------- a runaway template beside innocent requests


def test_a_runaway_template_fails_alone_while_eight_chats_beside_it_are_answered(trapped_server, tiny_model_dir):
    url = trapped_server.base_url
    finished: dict[str, float] = {}

    def hostile() -> httpx.Response:
        response = _chat(url, TRIGGER)
        finished["hostile"] = time.monotonic()
        return response

    with ThreadPoolExecutor(9) as pool:
        runaway = pool.submit(hostile)
        time.sleep(0.5)  # the runaway render is under way (it runs for its 5 s bound)
        innocent = [pool.submit(_chat, url, f"What is {k} + 7?") for k in range(8)]
        answers = [future.result() for future in innocent]
        innocent_done = time.monotonic()
        refused = runaway.result()
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert innocent_done < finished["hostile"], "the innocent chats waited for the runaway template"
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert f"the chat template of {tiny_model_dir}" in message
    assert f"time bound of {DEFAULT_BOUNDS.deadline_s:g} s" in message
    assert _chat(url, "What is 1 + 1?").status_code == 200  # still serving
    with httpx.Client(timeout=30) as client:
        assert client.get(url.removesuffix("/v1") + "/health").status_code == 200


def test_runaway_templates_filling_the_render_pool_leave_the_other_worker_threads_free(trapped_server):
    """As many runaway renders as the render pool has threads: a text completion (its tokenizing and its answer run
    on asyncio's default threads) is answered while every one of them still renders."""
    url = trapped_server.base_url
    body = {"model": "tiny", "prompt": "What is 2 + 2?", "max_tokens": 4}
    with ThreadPoolExecutor(RENDER_THREADS) as pool:
        hostile = [pool.submit(_chat, url, TRIGGER) for _ in range(RENDER_THREADS)]
        time.sleep(0.5)  # every render thread is held (each for its 5 s bound)
        with httpx.Client(timeout=120) as client:
            text = client.post(f"{url}/completions", json=body)
        assert not any(f.done() for f in hostile), "the text completion waited for the runaway renders"
        refused = [f.result() for f in hostile]
    assert text.status_code == 200, text.text
    assert [r.status_code for r in refused] == [400] * RENDER_THREADS


def test_datum_from_chat_renders_through_the_same_bound(tiny_model_dir):
    """Training's prompts render as the server renders them: a template building text past its output bound is a
    ``TemplateBoundError`` naming the template, refused before the text is built."""
    tokenizer = _tokenizer(tiny_model_dir)
    tokenizer.chat_template = "{{ 'x' * 100000000 }}" + tokenizer.chat_template
    with pytest.raises(TemplateBoundError, match=f"the chat template of {tiny_model_dir}.*output bound"):
        datum_from_chat(tokenizer, [{"role": "user", "content": "hi"}], idx=0)


def test_tokenize_renders_through_the_same_bound(trapped_server):
    root = trapped_server.base_url.removesuffix("/v1")
    body = {"model": "tiny", "messages": [{"role": "user", "content": TRIGGER}]}
    with httpx.Client(timeout=120) as client:
        refused = client.post(f"{root}/tokenize", json=body)
    assert refused.status_code == 400
    assert "time bound" in refused.json()["error"]["message"]


# ---------------------------------------------------------------- SIGTERM while a runaway template renders


@pytest.mark.e2e
def test_gym_bridge_serve_rendering_a_runaway_template_stops_on_sigterm(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(RUNAWAY + "{{ messages[0].content }}")
    port = free_port("127.0.0.1")
    log = tmp_path / "serve.log"
    args = [sys.executable, "-m", "gym_bridge.cli", "serve", "--model", str(folder), "--policy", "scripted"]
    args += ["--served-model-name", "tiny"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, "--port", str(port)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        root = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{root}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 180, "gym-bridge serve answering /health", poll_s=0.2)
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: answer.setdefault("r", _chat(f"{root}/v1", "hi")), daemon=True)
        sender.start()
        time.sleep(1.0)  # the render is under way
        assert sender.is_alive(), "the runaway template answered before it was stopped"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)  # the bound: a generous wait, not a speed claim
        stopped_after = time.monotonic() - signalled
        sender.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    print(f"gym-bridge serve stopped {stopped_after:.2f} s after SIGTERM")
    assert code == 0, log.read_text()
    assert answer["r"].status_code == 400 and "time bound" in answer["r"].json()["error"]["message"]
    assert "Traceback" not in log.read_text()


# ---------------------------------------------------------------- each way a template can run away


@pytest.mark.parametrize(
    "source",
    [
        RUNAWAY,
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
        "{{ 'x' * 10**12 }}",
        "{{ [0] * 10**12 }}",
        "{{ 7 ** 100000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
        "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('a') }}",
        "{{ 'x'|center(10**10) }}",
        "{{ 'a'.ljust(10**10) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ range(100000)|join('x' * 1000) }}",
        "{{ ('a' * 10000).replace('a', 'b' * 10000) }}",
        "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    ],
)
def test_each_runaway_shape_raises_within_its_bound(source):
    bounds = RenderBounds(deadline_s=1.0, max_chars=1_000_000)
    with pytest.raises(TemplateBoundError, match=r"^the chat template of hostile\.jinja (ran past|built) "):
        render_template(source, {}, name="hostile.jinja", bounds=bounds)


def test_a_template_within_its_bounds_renders_every_construct():
    source = (
        "{% for m in [1, 2] %}{{ loop.index }}/{{ loop.length }}{{ loop.last }}{% endfor %}"
        "{% for k, v in {'x': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
        "{% for x in [1, 2, 3] if x > 1 %}{{ x }}{% else %}none{% endfor %}"
        "{% generation %}G{% endgeneration %}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{{ {'a': '<b>'}|tojson }}{{ '%3d' % 7 }}{{ '{}-{}'.format('a', 1) }}{{ ['p', 'q']|join(', ') }}"
    )
    assert render_template(source, {}, name="t") == '1/2False2/2Truex123G012{"a": "<b>"}  7a-1p, q'


# ---------------------------------------------------------------- identical to apply_chat_template


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def real_tokenizer(request: pytest.FixtureRequest) -> Any:
    fixture = "tiny_model_dir" if request.param == "tiny" else "smollm2_model_dir"
    return _tokenizer(request.getfixturevalue(fixture))


def _expected_ids(tokenizer: Any, chat: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["prompt", "no prompt"])
def test_our_render_is_token_identical_to_apply_chat_template(real_tokenizer, name, tools, generation_prompt):
    chat = CHATS[name]
    expected = real_tokenizer.apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = render_chat_template(
        real_tokenizer, chat, tools=tools, add_generation_prompt=generation_prompt, template_kwargs={}
    )
    assert ours == expected
    assert render_ids(real_tokenizer, chat, tools, generation_prompt, None) == _expected_ids(
        real_tokenizer, chat, tools, generation_prompt
    )


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>assistant", "{{ x }}", "{% raw %}", "<tool_call>", "\n\n", " "]
)
_call = st.fixed_dictionaries(
    {
        "id": st.text("abc123", min_size=1, max_size=6),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f"]), "arguments": st.dictionaries(_text, _text, max_size=3)}
        ),
    }
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": _text}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none() | _text},
        optional={"tool_calls": st.lists(_call, min_size=1, max_size=2), "reasoning_content": _text},
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chat=st.lists(_message, min_size=1, max_size=6),
    tools=st.none() | st.just(TOOLS),
    generation_prompt=st.booleans(),
)
def test_generated_chats_render_as_apply_chat_template_renders_them(real_tokenizer, chat, tools, generation_prompt):
    try:
        expected: str | None = real_tokenizer.apply_chat_template(
            chat, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # a template may refuse a chat: ours must refuse it too
        expected, failure = None, type(exc)
    if expected is None:
        with pytest.raises(failure):
            render_chat_template(
                real_tokenizer, chat, tools=tools, add_generation_prompt=generation_prompt, template_kwargs={}
            )
        return
    ours = render_chat_template(
        real_tokenizer, chat, tools=tools, add_generation_prompt=generation_prompt, template_kwargs={}
    )
    assert ours == expected


# ---------------------------------------------------------------- JSON inside strings


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_tool_call_chat(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


@pytest.mark.parametrize("arguments", [_nested(DEEP), '{"a":' * DEEP + "1" + "}" * DEEP], ids=["lists", "objects"])
def test_tool_call_arguments_nested_50000_deep_are_a_400_naming_the_field(trapped_server, arguments):
    field = "messages[1].tool_calls[0].function.arguments"
    body = {"model": "tiny", "messages": _deep_tool_call_chat(arguments), "max_tokens": 4}
    root = trapped_server.base_url.removesuffix("/v1")
    with httpx.Client(timeout=120) as client:
        chat = client.post(f"{root}/v1/chat/completions", json=body)
        tokenized = client.post(f"{root}/tokenize", json={"model": "tiny", "messages": body["messages"]})
    for refused in (chat, tokenized):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field} nests deeper than")


def test_arguments_that_are_not_json_still_render_as_text(tiny_tokenizer):
    prompt = build_chat_prompt(tiny_tokenizer, _deep_tool_call_chat("{not json"))
    assert "{not json" in tiny_tokenizer.decode(prompt.token_ids)


def test_a_models_tool_call_nested_50000_deep_stays_text():
    text = '<tool_call>{"name": "f", "arguments": ' + _nested(DEEP) + "}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_responses_arguments_and_metadata_nested_50000_deep_name_the_field(tiny_tokenizer):
    deep_call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": _nested(DEEP)}
    turn = responses_to_chat({"input": [{"role": "user", "content": "hi"}, deep_call]}, uses_reasoning_parser=False)
    with pytest.raises(ServingError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments nests deeper"):
        build_chat_prompt(tiny_tokenizer, turn.messages)
    metadata = {"chat_template_kwargs": '{"a": ' + _nested(DEEP) + "}"}
    with pytest.raises(TranslationError, match=r"^metadata\.chat_template_kwargs is not JSON we accept"):
        responses_to_chat({"input": "hi", "metadata": metadata}, uses_reasoning_parser=False)
