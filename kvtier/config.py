"""Engine configuration: one frozen dataclass per subsystem, composed into `EngineConfig`.

Everything here is what the user asked for. Values derived at start-up from the model and the
memory budget (number of KV blocks, context length) live in `kvtier.engine.runtime.RuntimeInfo`,
never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Imports no torch: a bad transfer config fails before anything heavy loads.
from kvtier.connector.config import KVTransferConfig

DTYPES = ("auto", "bfloat16", "float32", "float16")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16",
                 "half": "float16"}
HASH_ALGOS = ("sha256_cbor", "xxhash")
POLICIES = ("fcfs", "priority")
# Used when neither a byte budget nor a block count is given.
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which model to run and where."""

    # HF directory, .gguf file, or None for the packaged default (SmolLM2-135M-Instruct).
    model: str | None = None
    dtype: str = "auto"
    # "cuda", "cpu", ... or None: cuda when available, else cpu.
    device: str | None = None
    # Cap on the context length; None: the model's own maximum.
    max_model_len: int | None = None
    # Seeds the sampler for requests without their own seed.
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _require(self.dtype in DTYPES,
                 f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len must be >= 1 (or None for the model's), got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged device KV cache and its prefix cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # Size the cache by bytes or by blocks, not both; neither: DEFAULT_KV_CACHE_MEMORY_BYTES.
    kv_cache_memory_bytes: int | None = None
    num_device_blocks: int | None = None
    hash_algo: str = "sha256_cbor"
    # Share of blocks kept free when admitting new requests (the watermark).
    watermark: float = 0.01
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.kv_cache_memory_bytes is None or self.num_device_blocks is None,
                 "give kv_cache_memory_bytes or num_device_blocks, not both")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        # Block 0 is the null block, so one usable block needs two.
        _require(self.num_device_blocks is None or self.num_device_blocks >= 2,
                 f"num_device_blocks must be >= 2, got {self.num_device_blocks}")
        _require(self.hash_algo in HASH_ALGOS,
                 f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}")
        _require(0.0 <= self.watermark < 1.0,
                 f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulingConfig:
    """Batching limits. The scheduler's own SchedulerConfig is built from this plus the derived
    context length (kvtier.engine.runtime)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # None: unbounded; else add_request raises EngineQueueFullError past it (a 503 for servers).
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.policy in POLICIES,
                 f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _require(self.max_waiting_requests is None or self.max_waiting_requests >= 1,
                 f"max_waiting_requests must be >= 1 or None, got {self.max_waiting_requests}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)
    # The KV connector, its options parsed (see KVTransferConfig.options); the one-flag
    # offloading form becomes one of these too (`kv_offload_transfer_config`).
    kv_transfer_config: KVTransferConfig | None = None

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (the LLM() and CLI surface); unknown names are an
        error listing the valid ones."""
        sections = {"model": ModelLoadConfig, "cache": CacheConfig,
                    "scheduler": SchedulingConfig}
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        transfer = options.pop("kv_transfer_config", None)
        flag = options.pop("kv_offload", None)
        for key, value in options.items():
            owner = next((s for s, kls in sections.items()
                          if key in kls.__dataclass_fields__), None)
            if owner is None:
                valid = sorted(k for kls in sections.values() for k in kls.__dataclass_fields__)
                raise ValueError(f"unknown engine option {key!r}; valid options: "
                                 f"{', '.join(valid + ['kv_offload', 'kv_transfer_config'])}")
            grouped[owner][key] = value
        _require(transfer is None or flag is None,
                 "give kv_transfer_config or kv_offload, not both")
        if flag is not None:
            transfer = kv_offload_transfer_config(flag, "kv_offload")
        return cls(**{s: sections[s](**grouped[s]) for s in sections},
                   kv_transfer_config=parse_transfer_config(transfer, "kv_transfer_config"))


def parse_transfer_config(value: Any, where: str) -> KVTransferConfig | None:
    """A KVTransferConfig from itself, a dict, or a JSON string (the CLI form); `where` names
    the option in errors."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        return KVTransferConfig.from_json(value, where)
    return KVTransferConfig.from_dict(value)


def kv_offload_transfer_config(flag: str, where: str) -> KVTransferConfig:
    """The OffloadingConnector config that the one-flag form `flag` ("host=4GiB,disk=/path:50GiB")
    stands for, its options parsed; `where` names the option in errors ("--kv-offload")."""
    # The offload package imports numpy: only when offloading is asked for.
    from kvtier.offload.config import CONNECTOR_NAME, parse_kv_offload
    return KVTransferConfig(kv_connector=CONNECTOR_NAME,
                            kv_connector_extra_config=parse_kv_offload(flag, where))
