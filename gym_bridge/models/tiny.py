"""The embedded tiny model: a byte-level BPE tokenizer and a random small Llama, built offline.

Nothing here touches the network. :func:`build_tiny_model` trains the tokenizer on
a corpus embedded in this module, initialises a ``LlamaForCausalLM`` from a fixed
seed, and saves both with ``save_pretrained`` into one folder, so any code that
loads a local Hugging Face model (transformers 4 or 5, our server, vLLM) can load it.

Why Llama and not Qwen2: transformers 5's ``AutoTokenizer`` ignores
``tokenizer_class`` for ``model_type == "qwen2"`` and rebuilds the tokenizer as
``Qwen2Tokenizer`` (NFC normaliser, Qwen's split regex), which would not be the
tokenizer we trained. For a Llama config with ``tokenizer_class:
PreTrainedTokenizerFast`` both transformers 4 and 5 load ``tokenizer.json`` as
saved. The tokenizer itself is Qwen-like (same split regex, byte-level, ChatML
markup, Hermes tool calls) but has no normaliser, so ``decode(encode(text)) == text``
for any text.

The build is deterministic: the same recipe and seed give byte-identical
``tokenizer.json`` and identical weights. The folder name carries
:data:`RECIPE_TAG`, so changing the recipe never reuses a stale build. A build
goes to a private temporary folder that is renamed into place only when
complete, so concurrent builders never see (or leave) a half-written folder.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

#: Bump when anything below changes the built artefacts (corpus, template, sizes).
RECIPE_TAG = "tiny-v1"
#: File written last into a finished build; its presence means "complete".
MARKER_FILE = "gym_bridge_tiny.json"
#: Environment variable naming the default cache folder.
CACHE_ENV = "GYM_BRIDGE_CACHE"

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
#: Added (non-special) tokens: kept when decoding with ``skip_special_tokens=True``, like Qwen's.
EXTRA_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

#: Qwen2's pre-tokenizer split (digits one by one, words with their leading space).
SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
VOCAB_SIZE = 1280  # BPE target, added tokens included
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64: what vLLM's CPU attention kernels support
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# A Qwen2.5 / Hermes style chat template. Differences from Qwen2.5's: a neutral
# default system prompt, tool-call ``arguments`` given as a JSON string are
# written verbatim (not JSON-encoded twice), and list-of-parts contents are
# joined from their text parts.
CHAT_TEMPLATE = (
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
    + DEFAULT_SYSTEM_PROMPT
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
    + DEFAULT_SYSTEM_PROMPT
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

_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Reinforcement learning trains a policy to maximise the reward it receives from an environment.
An agent observes the state of the world, chooses an action, and receives a reward and a new state.
A language model predicts the next token given the tokens that came before it.
The tokenizer splits text into tokens; the model turns tokens into a probability distribution.
Sampling with a temperature below one makes the distribution sharper; above one makes it flatter.
Greedy decoding always picks the most likely token. Top-p sampling keeps the smallest set of tokens
whose probabilities add up to at least p. Top-k sampling keeps the k most likely tokens.
The weather today is sunny with a light breeze from the west. Tomorrow it may rain in the afternoon.
Please read the instructions carefully before you begin. Answer each question with a short sentence.
What is the capital of France? The capital of France is Paris. What is the capital of Japan? Tokyo.
How many days are there in a week? There are seven days in a week: Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday. A year has twelve months, from January to December.
The student solved the problem step by step and then checked the answer twice.
If you are not sure, say that you do not know. Think before you answer, then give the final answer.
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees Celsius.
The library opens at 9 o'clock in the morning and closes at 6 o'clock in the evening.
She wrote a function that returns the sum of two numbers, and he wrote a test for it.
Errors should never pass silently. Simple is better than complex. Readability counts.
The server listens on port 8080 and answers every request with a JSON document.
A rollout is one episode: the model talks to the environment until the episode ends.
The reward is 1.0 when the answer is correct and 0.0 otherwise.
Let me think about this. First, add the two numbers. Then multiply the result by three.
The final answer is 42. The final answer is 7. The final answer is 128.
I will call the calculator tool to compute the result. The tool returned the value.
You are a helpful assistant. You answer questions about mathematics, science and history.
Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, orange, peach, pear.
Colours of the rainbow: red, orange, yellow, green, blue, indigo and violet.
Numbers: zero, one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
"""

_JSON = """\
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "calculator", "arguments": {"expression": "12 + 7"}}
{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
{"id": "call_0", "result": 19, "status": "ok", "error": null, "items": [1, 2, 3], "ok": true}
{"temperature": 21.5, "humidity": 0.4, "city": "Berlin", "forecast": ["sun", "cloud", "rain"]}
{"role": "user", "content": "What is 3 + 4?"}
{"role": "assistant", "content": "3 + 4 = 7"}
"""

_CHAT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 12 + 7?<|im_end|>
<|im_start|>assistant
<think>
I need to add 12 and 7. 12 + 7 = 19.
</think>
12 + 7 = 19<|im_end|>
<|im_start|>user
What is the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 18, "condition": "cloudy"}
</tool_response><|im_end|>
<|im_start|>assistant
It is 18 degrees and cloudy in Paris.<|im_end|>
<|endoftext|>
"""


def _arithmetic_lines() -> list[str]:
    """Deterministic arithmetic facts (no randomness: plain nested loops)."""
    lines = []
    for a in range(0, 60, 7):
        for b in range(1, 40, 6):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a} * {b} = {a * b}")
            if a >= b:
                lines.append(f"{a} - {b} = {a - b}")
    for n in range(0, 200, 13):
        lines.append(f"The number {n} is {'even' if n % 2 == 0 else 'odd'}; twice {n} is {2 * n}.")
    lines += [f"{i}. item {i}, price {i * 3}.{i % 10}0" for i in range(1, 21)]
    return lines


def corpus() -> list[str]:
    """The embedded training corpus, as lines (a few KB; deterministic)."""
    return _PROSE.splitlines() + _JSON.splitlines() + _CHAT.splitlines() + _arithmetic_lines()


def build_tokenizer() -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(EXTRA_TOKENS),
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Markup tokens are added afterwards so the BPE never learns pieces of them.
    lines = [
        line.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<|endoftext|>", "") for line in corpus()
    ]
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="right",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: Any, *, seed: int = 0) -> Any:
    """A random-initialised float32 ``LlamaForCausalLM`` sized for ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **MODEL_CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    return model


def _pin_tokenizer_class(folder: Path) -> None:
    """Make every transformers version load ``tokenizer.json`` as saved (see the module docstring).

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, unknown to
    transformers 4 (vLLM's environments); ``PreTrainedTokenizerFast`` means the same
    thing to both. The chat template is also copied into ``tokenizer_config.json``
    for loaders that do not read ``chat_template.jinja``.
    """
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def default_cache_dir() -> Path:
    """``$GYM_BRIDGE_CACHE`` or ``~/.cache/gym-bridge``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gym-bridge"


def tiny_model_path(cache_dir: Path | str | None = None, *, seed: int = 0) -> Path:
    """Where :func:`build_tiny_model` puts (or finds) the build for ``seed``."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / f"{RECIPE_TAG}-seed{seed}"


def is_complete(path: Path) -> bool:
    return (path / MARKER_FILE).is_file()


def build_tiny_model(cache_dir: Path | str | None = None, *, seed: int = 0) -> Path:
    """Build the tiny tokenizer + model into the cache (or reuse a finished build); return its folder.

    Safe to call from several processes at once: each builds in a private temporary
    folder and renames it into place; the first rename wins and the others discard
    their copy. A folder without the completion marker (left by something else) is
    moved aside and rebuilt.
    """
    final = tiny_model_path(cache_dir, seed=seed)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=seed)
        tmp.mkdir()
        tokenizer.save_pretrained(tmp)
        _pin_tokenizer_class(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        marker = {"recipe": RECIPE_TAG, "seed": seed, "vocab_size": len(tokenizer)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        for _ in range(3):
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if is_complete(final):
                    return final  # another process finished first; ours is discarded below
                if final.exists():  # incomplete leftover: move it aside, then retry
                    stale = final.parent / f".{final.name}.stale-{uuid.uuid4().hex[:8]}"
                    try:
                        os.rename(final, stale)
                        shutil.rmtree(stale, ignore_errors=True)
                    except OSError:
                        pass
        if is_complete(final):
            return final
        raise RuntimeError(f"could not move the tiny model build into place at {final}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_tiny(cache_dir: Path | str | None = None, seed: int = 0) -> tuple[Any, Any]:
    """Build if needed, then load ``(tokenizer, model)`` (model in eval mode, float32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(cache_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    model.eval()
    return tokenizer, model


def resolve_model_path(name_or_path: str | Path) -> Path:
    """``"tiny"`` → the tiny model's folder (built on demand); anything else must be an existing path."""
    if str(name_or_path) == "tiny":
        return build_tiny_model()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither 'tiny' nor an existing local path "
            "(downloads are not supported: pass a folder saved with save_pretrained)"
        )
    return path
