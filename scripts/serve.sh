#!/usr/bin/env bash
# README quick start: install kvtier, then serve the default model (SmolLM2-135M-Instruct) on
# 127.0.0.1 with the host-memory and disk KV tiers on. Usage: scripts/serve.sh [serve options]
# Port: KVTIER_PORT (default 8000). Disk tier: ~/.cache/kvtier, 4 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
port="${KVTIER_PORT:-8000}"
disk_dir="$HOME/.cache/kvtier"
mkdir -p "$disk_dir"
cat <<MSG
Starting kvtier on http://127.0.0.1:${port}. Once it logs "Application startup complete", try:

  curl http://127.0.0.1:${port}/v1/completions -H 'Content-Type: application/json' \\
    -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

MSG
exec .venv/bin/kvtier serve --host 127.0.0.1 --port "$port" \
    --kv-offload "host=1GiB,disk=${disk_dir}:4GiB" "$@"
