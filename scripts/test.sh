#!/usr/bin/env bash
# Installs kvtier with its test extras and runs the default test suite (slow and GPU tests skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest -q "$@"
