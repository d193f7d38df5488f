"""Engine configuration: one frozen dataclass per subsystem, composed into `EngineConfig`.

Everything here is what the user asked for. Values derived at start-up from the model and the
memory budget (number of KV blocks, context length) live in `kvtier.engine.runtime.RuntimeInfo`,
never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Imports no torch at module level: a bad transfer config fails before anything heavy loads
# (the device check imports it, only when a device is named).
from kvtier.common.memory import available_memory_bytes, format_bytes
from kvtier.connector.config import KVTransferConfig
from kvtier.sampling_params import SEED_RANGE
from kvtier.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float32", "float16")
# How attention layers store K and V: "auto" as the model computes them (--dtype); the fp8
# formats at one byte an element (fp8 = fp8_e4m3, vLLM's names), twice the tokens per byte.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16",
                 "half": "float16"}
HASH_ALGOS = ("sha256_cbor", "xxhash")
POLICIES = ("fcfs", "priority")
# Used when neither a byte budget nor a block count is given.
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_seed(seed: object, where: str) -> None:
    """The engine's sampler seeds a torch generator with it, which takes [-2**63, 2**64)."""
    _require(isinstance(seed, int) and not isinstance(seed, bool)
             and SEED_RANGE[0] <= seed < SEED_RANGE[1],
             f"{where} must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def check_device(name: str, where: str) -> None:
    """A device torch parses and this build of it can use: found here, before the model loads,
    not by the first tensor moved there."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{where} {name!r} is not a device PyTorch knows ({exc}); give cpu, "
                         "cuda or cuda:N") from None
    if device.type == "cuda":
        _require(torch.version.cuda is not None or torch.version.hip is not None,
                 f"{where} {name}: this PyTorch build has no CUDA (torch {torch.__version__}); "
                 f"give {where} cpu, or install a CUDA build of PyTorch")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _require(count > 0, f"{where} {name}: no CUDA device is visible "
                            f"(torch.cuda.is_available() is False); give {where} cpu")
        _require(device.index is None or device.index < count,
                 f"{where} {name}: only {count} CUDA device(s) are visible (cuda:0 .. "
                 f"cuda:{count - 1})")
        return
    # Other accelerators (mps, xpu) say through their torch module; meta and the like run
    # no model.
    is_available = getattr(getattr(torch, device.type, None), "is_available", None)
    _require(device.type == "cpu" or (callable(is_available) and is_available()),
             f"{where} {name}: this PyTorch build cannot run a model on {device.type} "
             f"(no torch.{device.type}.is_available()); give {where} cpu or cuda")


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
        check_seed(self.seed, "seed")
        if self.device is not None:
            check_device(self.device, "device")


@dataclass(frozen=True)
class CacheConfig:
    """The paged device KV cache and its prefix cache."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"
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
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                 f"{self.kv_cache_dtype!r}")
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
class LoRAConfig:
    """LoRA adapters (kvtier/lora), vLLM's option names."""

    enable_lora: bool = False
    # Most distinct adapters in one step; requests of another adapter wait for a seat.
    max_loras: int = 1
    # Largest adapter rank accepted.
    max_lora_rank: int = 16
    # Most adapters kept loaded (least recently used dropped, loaded again from its path when
    # asked); None: every adapter loaded stays until unloaded.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_lora, bool),
                 f"enable_lora must be True or False, got {self.enable_lora!r}")
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1,
                 f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras must be >= max_loras ({self.max_loras}) or None, got "
                 f"{self.max_cpu_loras}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # The KV connector, its options parsed (see KVTransferConfig.options); the one-flag
    # offloading form becomes one of these too (`kv_offload_transfer_config`).
    kv_transfer_config: KVTransferConfig | None = None
    # Speculative decoding (kvtier/spec_decode); None: none.
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (the LLM() and CLI surface); unknown names are an
        error listing the valid ones."""
        sections = {"model": ModelLoadConfig, "cache": CacheConfig,
                    "scheduler": SchedulingConfig, "lora": LoRAConfig}
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        transfer = options.pop("kv_transfer_config", None)
        flag = options.pop("kv_offload", None)
        speculative = SpeculativeConfig.parse(options.pop("speculative_config", None),
                                              "speculative_config")
        for key, value in options.items():
            owner = next((s for s, kls in sections.items()
                          if key in kls.__dataclass_fields__), None)
            if owner is None:
                valid = sorted(k for kls in sections.values() for k in kls.__dataclass_fields__)
                extra = ["kv_offload", "kv_transfer_config", "speculative_config"]
                raise ValueError(f"unknown engine option {key!r}; valid options: "
                                 f"{', '.join(valid + extra)}")
            grouped[owner][key] = value
        _require(transfer is None or flag is None,
                 "give kv_transfer_config or kv_offload, not both")
        if flag is not None:
            transfer = kv_offload_transfer_config(flag, "kv_offload")
        return cls(**{s: sections[s](**grouped[s]) for s in sections},
                   kv_transfer_config=parse_transfer_config(transfer, "kv_transfer_config"),
                   speculative_config=speculative)


def parse_transfer_config(value: Any, where: str) -> KVTransferConfig | None:
    """A KVTransferConfig from itself, a dict, or a JSON string (the CLI form); `where` names
    the option in errors."""
    if value is None:
        return value
    if isinstance(value, str):
        value = KVTransferConfig.from_json(value, where)
    elif not isinstance(value, KVTransferConfig):
        value = KVTransferConfig.from_dict(value)
    _check_host_budget(value, f"{where} kv_connector_extra_config.cpu_bytes_to_use")
    return value


def kv_offload_transfer_config(flag: str, where: str) -> KVTransferConfig:
    """The OffloadingConnector config that the one-flag form `flag` ("host=4GiB,disk=/path:50GiB")
    stands for, its options parsed; `where` names the option in errors ("--kv-offload")."""
    # The offload package imports numpy: only when offloading is asked for.
    from kvtier.offload.config import CONNECTOR_NAME, parse_kv_offload
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME,
                              kv_connector_extra_config=parse_kv_offload(flag, where))
    _check_host_budget(config, f"{where} host")
    return config


def _check_host_budget(config: KVTransferConfig, where: str) -> None:
    """An engine's host tier is allocated (and populated) at start-up: a budget past the memory
    available would fail there with a bare "Cannot allocate memory", after the model loads.
    Checked here, not in OffloadConfig: the planner sizes tiers for other machines."""
    budget = getattr(config.options, "cpu_bytes_to_use", None)
    available = available_memory_bytes()
    if isinstance(budget, int) and available is not None and budget > available:
        raise ValueError(f"{where}: {budget} bytes ({format_bytes(budget)}) is more than this "
                         f"machine's available memory ({format_bytes(available)}); give at most "
                         f"{available} bytes")
