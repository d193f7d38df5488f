"""Values derived at start-up from the config and the loaded model (never written back into
the config), and the connector halves built from the transfer config."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvtier.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from kvtier.connector.base import (
    ConnectorContext,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtier.connector.config import KVTransferConfig
from kvtier.kv import KVCacheConfig, KVIdentity, MambaSpec, SlidingWindowSpec
from kvtier.models.config import ModelConfig
from kvtier.models.weight_identity import model_files, weights_digest
from kvtier.worker.kv_cache import (
    block_bytes,
    build_kv_cache_groups,
    device_memory_bytes,
    plan_num_blocks,
)

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float16": torch.float16}
# vLLM's names: "fp8" is e4m3 (3 mantissa bits, to +-448); e5m2 has 2, to +-57,344.
_KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                          "fp8_e5m2": torch.float8_e5m2}
# Names the device KV layout; part of the KV identity of every key written outside.
KV_LAYOUT = "paged:(2,num_blocks,block_size,num_kv_heads,head_dim)"


@dataclass(frozen=True)
class RuntimeInfo:
    device: torch.device
    dtype: torch.dtype
    # How attention layers store K and V (dtype, or an fp8 format).
    kv_cache_dtype: torch.dtype
    max_model_len: int
    kv_cache_config: KVCacheConfig
    # What this engine's KV bytes depend on (weights, dtype, block size, layout, specs).
    kv_identity: KVIdentity

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    @property
    def namespace(self) -> bytes:
        """Prefixes keys written outside the process."""
        return self.kv_identity.namespace


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bf16 by default: half the memory of fp32 and fast on current CPUs and GPUs.
    return torch.bfloat16 if name == "auto" else _TORCH_DTYPES[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `name` under model dtype `dtype`."""
    return dtype if name == "auto" else _KV_CACHE_TORCH_DTYPES[name]


def kv_cache_dtype_name(dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str:
    """What the KV identity and the cache metrics call the stored format: the model dtype, and
    the fp8 format K and V are rounded to from it (e.g. bfloat16+float8_e4m3fn)."""
    name = str(dtype).removeprefix("torch.")
    if kv_cache_dtype != dtype:
        name += "+" + str(kv_cache_dtype).removeprefix("torch.")
    return name


def derive_runtime(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   dtype: torch.dtype) -> RuntimeInfo:
    limit = model_config.max_position_embeddings
    asked = config.model.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} is longer than the model's "
                         f"max_position_embeddings ({limit}); use at most {limit}")
    max_model_len = asked or limit
    cache = config.cache
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype)
    groups = build_kv_cache_groups(model_config, block_size=cache.block_size,
                                   dtype_size=dtype.itemsize, kv_dtype_size=kv_dtype.itemsize)
    num_blocks = plan_num_blocks(
        block_bytes=block_bytes(groups), block_size=cache.block_size,
        memory_bytes=_memory_budget(config),
        num_blocks=cache.num_device_blocks, max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=max_model_len, available_bytes=device_memory_bytes(device))
    max_model_len = _fit_max_model_len(max_model_len, asked is not None, num_blocks,
                                       len(groups), cache.block_size)
    kinds = tuple(_spec_kind(group.kv_cache_spec) for group in groups)
    identity = KVIdentity(model_name=model_config.name,
                          weights_digest=weights_digest(model_files(config.model.model)),
                          dtype=kv_cache_dtype_name(dtype, kv_dtype),
                          block_size=cache.block_size, kv_layout=KV_LAYOUT, spec_kinds=kinds)
    return RuntimeInfo(device, dtype, kv_dtype, max_model_len,
                       KVCacheConfig(num_blocks, groups), identity)


def _fit_max_model_len(max_model_len: int, asked: bool, num_blocks: int, num_groups: int,
                       block_size: int) -> int:
    """The longest context one request can hold alone in the device cache; a longer one would
    be accepted, never admitted, and hold up every request queued behind it.

    Admission wants a block table for the whole sequence in every KV cache group (a sliding
    window drops blocks only once they are computed); the null block is never handed out."""
    fitting = min(max_model_len, (num_blocks - 1) // num_groups * block_size)
    if fitting == max_model_len:
        return max_model_len
    if fitting == 0:
        raise ValueError(f"the device KV cache ({num_blocks} blocks) holds no block for a "
                         "request; give it more room with --kv-cache-memory-bytes / "
                         "--num-device-blocks")
    if asked:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the device KV cache, which holds "
            f"{fitting} tokens of one request ({num_blocks} blocks of {block_size}); lower "
            f"--max-model-len to at most {fitting}, or give the cache more room with "
            "--kv-cache-memory-bytes / --num-device-blocks")
    logger.warning("the device KV cache holds %d tokens of one request, fewer than the "
                   "model's context length %d: max_model_len is lowered to %d (raise "
                   "--kv-cache-memory-bytes / --num-device-blocks for more)",
                   fitting, max_model_len, fitting)
    return fitting


def _memory_budget(config: EngineConfig) -> int | None:
    if config.cache.num_device_blocks is not None:
        return None
    return config.cache.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES


def _spec_kind(spec: object) -> str:
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window:{spec.sliding_window}"
    if isinstance(spec, MambaSpec):
        # The state pages' shape is part of what their bytes mean.
        return f"mamba:{spec.state_shapes}"
    return type(spec).__name__


def build_connectors(transfer: KVTransferConfig | None, context: ConnectorContext
                     ) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
    """Both halves of the configured connector, each given what the connector's
    `create_shared` made (once) in its context."""
    if transfer is None:
        return None, None
    from kvtier.connector.registry import get_connector_class
    connector = get_connector_class(transfer)
    context = dataclasses.replace(context, shared=connector.create_shared(transfer, context))
    scheduler = connector.create(KVConnectorRole.SCHEDULER, transfer, context)
    try:
        return scheduler, connector.create(KVConnectorRole.WORKER, transfer, context)
    except BaseException:
        scheduler.shutdown()  # it may hold files, ports and threads
        raise
