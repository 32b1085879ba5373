"""Chat templates of the built-in models: ChatML with Hermes-style tools (Qwen2.5's format).

vLLM's ``hermes`` tool parser and our server's (:mod:`gym_bridge.serving.parsers`)
read ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; a model
served with this template is offered its tools in a ``<tools>`` block of the system
turn and asked to answer in that form.
"""

from __future__ import annotations

import json
from pathlib import Path

from gym_bridge.boundary.files import read_bytes, write_atomic
from gym_bridge.boundary.json_io import loads_object
from gym_bridge.boundary.text import shown
from gym_bridge.failures import SettingError

MAX_TOKENIZER_CONFIG_BYTES = 16 << 20
"""The largest ``tokenizer_config.json`` re-read after a build (transformers writes a few KB; a chat template and
added tokens take it to a few hundred)."""


def hermes_chat_template(default_system_prompt: str) -> str:
    """A Qwen2.5 / Hermes style ChatML template with tools, and ``default_system_prompt`` when no system turn is given.

    Differences from Qwen2.5's: the default system prompt is the caller's,
    tool-call ``arguments`` given as a JSON string are written verbatim (not
    JSON-encoded twice), and list-of-parts contents are joined from their text parts.
    """
    if "'" in default_system_prompt or "\\" in default_system_prompt:
        raise SettingError(
            f"default_system_prompt may not hold single quotes or backslashes (it is pasted into the template's "
            f"Jinja string literals), got {default_system_prompt!r}"
        )
    return (
        r"""{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part is string -%}{{- part -}}{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- render_content(messages[0]['content']) }}
    {%- else %}
        {{- '"""
        + default_system_prompt
        + r"""' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + render_content(messages[0]['content']) + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\n"""
        + default_system_prompt
        + r"""<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- render_content(message.content) }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
    )


def pin_tokenizer_config(folder: Path, chat_template: str) -> None:
    """Make every transformers version load the saved ``tokenizer.json`` as is, with ``chat_template``.

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, unknown to
    transformers 4 (vLLM's environments); ``PreTrainedTokenizerFast`` means the same
    thing to both. The chat template is also copied into ``tokenizer_config.json``
    for loaders that do not read ``chat_template.jinja``.
    """
    cfg_path = folder / "tokenizer_config.json"
    cfg = loads_object(read_bytes(cfg_path, MAX_TOKENIZER_CONFIG_BYTES), shown(cfg_path))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    write_atomic(cfg_path, json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", root=folder)
