"""Read a PEFT LoRA adapter directory into the weights kvtier applies: adapter_config.json and
adapter_model.safetensors, as `PeftModel.save_pretrained` writes them.

An adapter adds `scaling * B(A(x))` to a projection's output, `scaling = lora_alpha / r`
(`/ sqrt(r)` with use_rslora). Options kvtier does not implement (DoRA, biases, extra trained
modules, ...) are refused by name rather than ignored: ignoring them would give other outputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from kvtier.lora.request import LoRAError, LoRARequest
from kvtier.lora.targets import LoRATarget

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}
# adapter_config.json options kvtier does not implement: each must be absent or empty/false.
_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "fan_in_fan_out", "alpha_pattern",
                "layer_replication", "trainable_token_indices", "alora_invocation_tokens",
                "target_parameters", "use_qalora", "use_bdlora")


@dataclass(frozen=True)
class LoRAPiece:
    """One adapted projection: rows [row_start, row_end) of a (fused) module's output."""

    row_start: int
    row_end: int
    lora_a: torch.Tensor  # (r, in_features)
    lora_b: torch.Tensor  # (out_features, r)
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    int_id: int
    rank: int  # the largest of its pieces'
    # sha256 of everything that changes the KV it produces: its tensors and scaling. Block
    # hashes carry it (not the name), so an adapter's KV is shared by every instance that runs
    # the same adapter and never served for another one of the same name.
    cache_key: str
    weights: dict[str, list[LoRAPiece]]  # our module path -> its pieces


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget],
                 renames: tuple[tuple[str, str], ...], max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """LoRAError naming the directory and the problem for anything kvtier cannot apply."""
    path = os.path.expanduser(request.lora_path)
    config = _read_config(path)
    alpha, rslora = config["lora_alpha"], bool(config.get("use_rslora"))
    digest = hashlib.sha256(json.dumps([alpha, rslora]).encode())
    weights: dict[str, list[LoRAPiece]] = {}
    max_seen = 0
    for module, (lora_a, lora_b) in sorted(_read_pairs(path).items()):
        target = targets.get(_rename(module, renames))
        if target is None:
            raise LoRAError(f"LoRA adapter {path}: it adapts {module!r}; kvtier applies "
                            "adapters to the attention (q/k/v/o_proj) and MLP "
                            "(gate/up/down_proj) projections of this model only")
        rank = _check_shapes(path, module, lora_a, lora_b, target, max_rank)
        max_seen = max(max_seen, rank)
        for tensor in (lora_a, lora_b):
            digest.update(f"{module}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        weights.setdefault(target.module, []).append(LoRAPiece(
            target.row_start, target.row_start + target.out_features,
            lora_a.to(device=device, dtype=dtype), lora_b.to(device=device, dtype=dtype),
            alpha / (math.sqrt(rank) if rslora else rank)))
    if not weights:
        raise LoRAError(f"LoRA adapter {path}: {ADAPTER_WEIGHTS} holds no lora_A/lora_B "
                        "weights")
    return LoRAAdapter(request.lora_name, path, request.lora_int_id, max_seen,
                       digest.hexdigest(), weights)


def _read_config(path: str) -> dict:
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path}: no {ADAPTER_CONFIG} there (give the directory "
                        "PeftModel.save_pretrained wrote)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {path}: cannot read {ADAPTER_CONFIG} ({exc})") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise LoRAError(f"LoRA adapter {path}: {ADAPTER_CONFIG} must be an object with "
                        "\"peft_type\": \"LORA\"")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAError(f"LoRA adapter {path}: lora_alpha must be a positive number, got "
                        f"{alpha!r}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path}: bias {config['bias']!r} is not supported "
                        "(only \"none\")")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise LoRAError(f"LoRA adapter {path}: {key} is not supported by kvtier "
                            f"(got {config[key]!r})")
    return config


def _read_pairs(path: str) -> dict[str, list[torch.Tensor]]:
    """HF module name -> [lora_A weight, lora_B weight]."""
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        hint = (" (adapter_model.bin is a pickle, which kvtier never loads: save the adapter "
                "with safe_serialization=True)") \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAError(f"LoRA adapter {path}: no {ADAPTER_WEIGHTS} there{hint}")
    pairs: dict[str, list[torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                module, index = _split_name(path, name)
                pairs.setdefault(module, [None, None])[index] = f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise LoRAError(f"LoRA adapter {path}: corrupt or truncated {ADAPTER_WEIGHTS} "
                        f"({exc})") from exc
    for module, pair in pairs.items():
        if pair[0] is None or pair[1] is None:
            raise LoRAError(f"LoRA adapter {path}: {module!r} has only one of lora_A and "
                            "lora_B")
    return pairs


def _split_name(path: str, name: str) -> tuple[str, int]:
    for suffix, index in _SUFFIXES.items():
        if name.startswith(_PREFIX) and name.endswith(suffix):
            return name[len(_PREFIX):-len(suffix)], index
    raise LoRAError(f"LoRA adapter {path}: unexpected tensor {name!r} (kvtier applies "
                    "base_model.model.<module>.lora_A/lora_B.weight only)")


def _rename(module: str, renames: tuple[tuple[str, str], ...]) -> str:
    """The model's HF-to-kvtier renames, which match name parts ending in "."."""
    name = module + "."
    for part, ours in renames:
        name = name.replace(part, ours)
    return name[:-1]


def _check_shapes(path: str, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  target: LoRATarget, max_rank: int) -> int:
    """The pair's rank, after checking it against the model and `max_rank`."""
    rank = lora_a.shape[0] if lora_a.dim() == 2 else -1
    expected = ((rank, target.in_features), (target.out_features, rank))
    if rank < 1 or (tuple(lora_a.shape), tuple(lora_b.shape)) != expected:
        raise LoRAError(f"LoRA adapter {path}: {module!r} has lora_A {tuple(lora_a.shape)} "
                        f"and lora_B {tuple(lora_b.shape)}; this model needs (r, "
                        f"{target.in_features}) and ({target.out_features}, r): an adapter "
                        "for another base model?")
    if not lora_a.is_floating_point() or not lora_b.is_floating_point():
        raise LoRAError(f"LoRA adapter {path}: {module!r} weights must be floating point")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {path}: rank {rank} is greater than max_lora_rank "
                        f"{max_rank}; raise max_lora_rank (--max-lora-rank)")
    return rank
