"""A copy of the tiny model whose chat template opens a ``<think>`` block when ``enable_thinking`` is true, as
thinking templates (Qwen3's, NeMo-RL's Gym recipes') branch on it: prompts then differ by the template argument."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
THINKING = "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}"


def thinking_model(tiny_model_dir: Path, folder: Path) -> Path:
    """``tiny_model_dir`` copied to ``folder`` with the thinking branch after the generation prompt."""
    shutil.copytree(tiny_model_dir, folder)
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text()
    assert template.count(GENERATION_PROMPT) == 1, "the tiny template's generation prompt moved"
    template = template.replace(GENERATION_PROMPT, GENERATION_PROMPT + THINKING)
    template_file.write_text(template)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if "chat_template" in config:
        config["chat_template"] = template
        config_file.write_text(json.dumps(config))
    return folder
