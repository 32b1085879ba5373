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

from pathlib import Path
from typing import TYPE_CHECKING

from gym_bridge.json_types import JsonObject
from gym_bridge.models import cache
from gym_bridge.models.templates import hermes_chat_template, pin_tokenizer_config

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast


#: Bump when anything below changes the built artefacts (corpus, template, sizes).
RECIPE_TAG = "tiny-v1"
#: File written last into a finished build; its presence means "complete".
MARKER_FILE = "gym_bridge_tiny.json"

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
#: Added (non-special) tokens: kept when decoding with ``skip_special_tokens=True``, like Qwen's.
EXTRA_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

#: Qwen2's pre-tokenizer split (digits one by one, words with their leading space).
SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
VOCAB_SIZE = 1280  # BPE target, added tokens included
MODEL_CONFIG: JsonObject = {
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

CHAT_TEMPLATE = hermes_chat_template(DEFAULT_SYSTEM_PROMPT)

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
{"type": "function", "function": {"name": "search", "description": "Search the web.", \
"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"type": "function", "function": {"name": "add", "description": "Add two integers.", \
"parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, \
"required": ["a", "b"]}}}
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


def build_tokenizer() -> PreTrainedTokenizerFast:
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


def _id_of(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token (transformers types ``convert_tokens_to_ids`` for a list of tokens too)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"the tiny tokenizer gave {token_id!r} for the single token {token!r}")
    return token_id


def build_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> LlamaForCausalLM:
    """A random-initialised float32 ``LlamaForCausalLM`` sized for ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    pad_id = _id_of(tokenizer, PAD_TOKEN)
    eos_id = _id_of(tokenizer, EOS_TOKEN)
    bos_id = _id_of(tokenizer, BOS_TOKEN)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **MODEL_CONFIG,
    )
    torch.manual_seed(seed)
    model: LlamaForCausalLM = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # typeshed types functools.wraps'd .to as unbound
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


def tiny_model_path(cache_dir: Path | str | None = None, *, seed: int = 0) -> Path:
    """Where :func:`build_tiny_model` puts (or finds) the build for ``seed``."""
    return cache.cache_base(cache_dir) / f"{RECIPE_TAG}-seed{seed}"


def is_complete(path: Path) -> bool:
    return cache.is_complete(path, MARKER_FILE)


def build_tiny_model(cache_dir: Path | str | None = None, *, seed: int = 0) -> Path:
    """Build the tiny tokenizer + model into the cache (or reuse a finished build); return its folder.

    Safe to call from several processes at once (see :func:`gym_bridge.models.cache.build_atomically`).
    """

    def write(folder: Path) -> JsonObject:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=seed)
        tokenizer.save_pretrained(folder)
        pin_tokenizer_config(folder, CHAT_TEMPLATE)
        model.save_pretrained(folder, safe_serialization=True)
        return {"recipe": RECIPE_TAG, "seed": seed, "vocab_size": len(tokenizer)}

    return cache.build_atomically(tiny_model_path(cache_dir, seed=seed), MARKER_FILE, write)


def load_tiny(cache_dir: Path | str | None = None, seed: int = 0) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Build if needed, then load ``(tokenizer, model)`` (model in eval mode, float32, CPU)."""
    from gym_bridge.models.folder_check import load_checked_causal_lm

    tokenizer, model = load_checked_causal_lm(build_tiny_model(cache_dir, seed=seed), "float32")
    model.eval()
    return tokenizer, model
