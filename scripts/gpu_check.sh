#!/usr/bin/env bash
# The GPU checks in one run: the `-m gpu` tests (model parity on CUDA, an fp8 KV cache on CUDA,
# the offloading connector's and the P2P connector's copies between CUDA blocks and host memory,
# end to end against HF; LoRA adapters on CUDA against the CPU).
#
#   bash scripts/gpu_check.sh --fetch-wheels   # on a machine with PyPI: the packages a CUDA
#                                              # machine's image lacks, as wheels into .whl/
#   bash scripts/gpu_check.sh                  # on the CUDA machine, from the repository root
#
# The second form uses the machine's own python3 and PyTorch (a CUDA build) and installs the
# wheels in .whl/, if any, into a scratch directory on PYTHONPATH; nothing is downloaded there.
# The log goes to standard output and, when $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# What kvtier and its gpu tests import that a CUDA image with PyTorch and transformers lacks
# (and pytest with its timeout plugin, in case the image has no pytest).
WHEELS=(cbor2 xxhash msgpack pyzmq prometheus_client llguidance pytest pluggy iniconfig
        pytest-timeout)
PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    rm -rf .whl && mkdir .whl
    platforms=()
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    exec python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "$PYTHON_VERSION" "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "gpu_check: torch here sees no CUDA device; run this on a machine with one" >&2
    exit 2
}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvtier-site .whl/*.whl || exit
    export PYTHONPATH=/tmp/kvtier-site
fi
log=${OUT:-/tmp}/gpu_check.log
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__,
      "transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
    # Only the modules with gpu tests: the others import the stores' and the server's packages,
    # which such an image lacks. `-m gpu` replaces the default marker expression.
    mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
    PYTHONUNBUFFERED=1 python3 -m pytest -p no:cacheprovider -m gpu -rs -v --timeout=300 \
        "${files[@]}"
} 2>&1 | tee "$log"
