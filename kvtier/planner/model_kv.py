"""A model's KV cache layout for planning: the engine's own KV cache groups and block count,
from the model's config alone (an HF config.json needs no weights beside it, so one can plan for
a model this machine could never load)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.kv import KVCacheConfig, KVCacheGroupSpec
from kvtier.models.config import ModelConfig

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
# --kv-cache-dtype: bytes of a stored K or V element (auto: the dtype's).
KV_CACHE_DTYPE_SIZES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The simulation runs the engine's block pool, which builds an object per device block (about
# 110 bytes and a microsecond each): past this many a huge --device-kv would allocate until the
# machine runs out of memory. 4M blocks (64M tokens at 16 a block) build in a few seconds.
MAX_SIMULATED_BLOCKS = 1 << 22


@dataclass(frozen=True)
class ModelKV:
    """The KV cache groups of a model at one block size and dtype, and its context limit."""

    name: str
    groups: tuple[KVCacheGroupSpec, ...]
    max_model_len: int

    @property
    def block_size(self) -> int:
        return self.groups[0].kv_cache_spec.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of every layer takes (what a device block or an offload chunk of one
        block costs)."""
        return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in self.groups)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def num_device_blocks(self, device_bytes: int) -> int:
        """Blocks of the device pool `device_bytes` holds, the null block included, as the
        engine counts them (every layer holds one page per block). ValueError naming
        --device-kv unless 2 <= blocks <= MAX_SIMULATED_BLOCKS."""
        num_blocks = device_bytes // self.bytes_per_block
        holds = (f"--device-kv {device_bytes} bytes holds {num_blocks} KV blocks of "
                 f"{self.bytes_per_block} bytes")
        if num_blocks < 2:
            raise ValueError(f"{holds}; give at least {2 * self.bytes_per_block} bytes")
        if num_blocks > MAX_SIMULATED_BLOCKS:
            limit = MAX_SIMULATED_BLOCKS * self.bytes_per_block
            raise ValueError(f"{holds}; the planner simulates at most {MAX_SIMULATED_BLOCKS} "
                             f"device blocks, so give at most {limit} bytes "
                             f"({limit / 2**30:.1f} GiB)")
        return num_blocks

    def kv_cache_config(self, device_bytes: int) -> KVCacheConfig:
        """The device pool `device_bytes` holds (see num_device_blocks)."""
        return KVCacheConfig(self.num_device_blocks(device_bytes), list(self.groups))


def read_model_config(model: str | None) -> ModelConfig:
    """ModelConfig of an HF directory (or its config.json), a .gguf file, or None for the
    engine's default model. Raises ModelLoadError naming the file."""
    from kvtier.models.errors import ModelLoadError
    from kvtier.models.hf_config import parse_hf_config
    from kvtier.models.loader import DEFAULT_MODEL_FILE, default_model_path

    if model is None:
        return _gguf_config(default_model_path(), DEFAULT_MODEL_FILE)
    path = os.path.expanduser(model)
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path) or "."
    if os.path.isdir(path):
        return parse_hf_config(path, model)
    if path.endswith(".gguf") and os.path.exists(path):
        return _gguf_config(path, model)
    raise ModelLoadError(path, "expected an HF model directory (config.json is enough), its "
                               "config.json, or a .gguf file")


def _gguf_config(path: str, name: str) -> ModelConfig:
    from kvtier.models.gguf_file import GGUFModelFile

    return GGUFModelFile(path).model_config(name)


def model_kv(model: str | None, block_size: int = 16, dtype: str = "bfloat16",
             max_model_len: int | None = None, kv_cache_dtype: str = "auto") -> ModelKV:
    """The engine's KV cache groups for `model` (see read_model_config)."""
    from kvtier.worker.kv_cache import build_kv_cache_groups

    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPE_SIZES:
        raise ValueError(f"kv_cache_dtype must be auto or one of "
                         f"{sorted(KV_CACHE_DTYPE_SIZES)}, got {kv_cache_dtype!r}")
    config = read_model_config(model)
    limit = config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        # The engine refuses it too (kvtier/engine/runtime.py): no plan for a setup that
        # cannot start.
        raise ValueError(f"max_model_len={max_model_len} is longer than the model's "
                         f"max_position_embeddings ({limit}); use at most {limit}")
    groups = build_kv_cache_groups(config, block_size=block_size, dtype_size=DTYPE_SIZES[dtype],
                                   kv_dtype_size=KV_CACHE_DTYPE_SIZES.get(kv_cache_dtype))
    return ModelKV(config.name, tuple(groups), max_model_len or limit)
