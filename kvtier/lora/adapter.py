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
class LoRAWeights:
    """An adapter of one (fused) module: its output gains `scaling * B(A(x))`. A stacks the
    adapted pieces' A matrices; B holds each piece's B in that piece's output rows and its own
    A rows, zeros elsewhere, so one product pair serves q, k and v (or gate and up) at once."""

    lora_a: torch.Tensor  # (R, in_features), R the sum of the pieces' ranks
    lora_b: torch.Tensor  # (out_features, R)
    # The pieces' common scaling; 1.0 when theirs differ (rank_pattern) and B carries them.
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    # sha256 of everything that changes the KV it produces: its tensors and scaling. Block
    # hashes carry it (not the name), so an adapter's KV is shared by every instance that runs
    # the same adapter and never served for another one of the same name.
    cache_key: str
    weights: dict[str, LoRAWeights]  # our module path -> its adapter


@dataclass(frozen=True)
class _Piece:
    target: LoRATarget
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget],
                 renames: tuple[tuple[str, str], ...], max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """LoRAError naming the directory and the problem for anything kvtier cannot apply. Every
    tensor's shape is checked before any is read."""
    path = os.path.expanduser(request.lora_path)
    config = _read_config(path)
    alpha, rslora = config["lora_alpha"], bool(config.get("use_rslora"))
    digest = hashlib.sha256(json.dumps([alpha, rslora]).encode())
    pieces: dict[str, list[_Piece]] = {}
    for module, (lora_a, lora_b) in sorted(_read_pairs(path, targets, renames,
                                                       max_rank).items()):
        for tensor in (lora_a, lora_b):
            digest.update(f"{module}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        target = targets[_rename(module, renames)]
        rank = lora_a.shape[0]
        pieces.setdefault(target.module, []).append(_Piece(
            target, lora_a, lora_b, alpha / (math.sqrt(rank) if rslora else rank)))
    if not pieces:
        raise LoRAError(f"LoRA adapter {path}: {ADAPTER_WEIGHTS} holds no lora_A/lora_B "
                        "weights")
    weights = {module: _fuse(group, dtype, device) for module, group in pieces.items()}
    return LoRAAdapter(request.lora_name, path, digest.hexdigest(), weights)


def _fuse(pieces: list[_Piece], dtype: torch.dtype, device: torch.device) -> LoRAWeights:
    """One module's pieces as one A and one block-placed B (see LoRAWeights)."""
    scalings = {piece.scaling for piece in pieces}
    common = scalings.pop() if len(scalings) == 1 else None
    total_rank = sum(piece.lora_a.shape[0] for piece in pieces)
    lora_b = torch.zeros(pieces[0].target.module_out_features, total_rank,
                         dtype=torch.float32)
    column = 0
    for piece in pieces:
        rank, start = piece.lora_a.shape[0], piece.target.row_start
        block = piece.lora_b.float() * (1.0 if common is not None else piece.scaling)
        lora_b[start:start + piece.target.out_features, column:column + rank] = block
        column += rank
    lora_a = torch.cat([piece.lora_a.float() for piece in pieces])
    return LoRAWeights(lora_a.to(device=device, dtype=dtype),
                       lora_b.to(device=device, dtype=dtype),
                       common if common is not None else 1.0)


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
    if not _is_positive_finite(alpha):
        # Python's json reads NaN and Infinity: such an alpha would scale every output to NaN.
        raise LoRAError(f"LoRA adapter {path}: lora_alpha must be a positive finite number, "
                        f"got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path}: bias {config['bias']!r} is not supported "
                        "(only \"none\")")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise LoRAError(f"LoRA adapter {path}: {key} is not supported by kvtier "
                            f"(got {config[key]!r})")
    return config


def _is_positive_finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int past float's range: it could not scale a weight
        return False


def _read_pairs(path: str, targets: dict[str, LoRATarget],
                renames: tuple[tuple[str, str], ...],
                max_rank: int) -> dict[str, list[torch.Tensor]]:
    """HF module name -> [lora_A weight, lora_B weight], each pair's shapes checked against
    its target and `max_rank` before any tensor is read."""
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        hint = (" (adapter_model.bin is a pickle, which kvtier never loads: save the adapter "
                "with safe_serialization=True)") \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAError(f"LoRA adapter {path}: no {ADAPTER_WEIGHTS} there{hint}")
    try:
        with safe_open(file, framework="pt") as f:
            names: dict[str, list[str | None]] = {}
            for name in f.keys():
                module, index = _split_name(path, name)
                names.setdefault(module, [None, None])[index] = name
            for module, pair in names.items():
                if pair[0] is None or pair[1] is None:
                    raise LoRAError(f"LoRA adapter {path}: {module!r} has only one of lora_A "
                                    "and lora_B")
                target = targets.get(_rename(module, renames))
                if target is None:
                    raise LoRAError(f"LoRA adapter {path}: it adapts {module!r}; kvtier "
                                    "applies adapters to the attention (q/k/v/o_proj) and MLP "
                                    "(gate/up/down_proj) projections of this model only")
                _check_shapes(path, module, *(f.get_slice(n).get_shape() for n in pair),
                              target, max_rank)
            pairs = {module: [f.get_tensor(n) for n in pair] for module, pair in names.items()}
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise LoRAError(f"LoRA adapter {path}: corrupt or truncated {ADAPTER_WEIGHTS} "
                        f"({exc})") from exc
    for module, (lora_a, lora_b) in pairs.items():
        _check_values(path, module, lora_a, lora_b)
    return pairs


def _check_values(path: str, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    if not lora_a.is_floating_point() or not lora_b.is_floating_point():
        raise LoRAError(f"LoRA adapter {path}: {module!r} weights must be floating point")
    # Once per load: a NaN or inf here would turn the logits of every request using the
    # adapter to NaN, each of which would then fail only at sampling.
    for name, tensor in (("lora_A", lora_a), ("lora_B", lora_b)):
        if not bool(torch.isfinite(tensor).all()):
            raise LoRAError(f"LoRA adapter {path}: {module!r} {name} holds NaN or infinite "
                            "values (a diverged training run or a corrupt file?)")


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


def _check_shapes(path: str, module: str, shape_a: list[int], shape_b: list[int],
                  target: LoRATarget, max_rank: int) -> None:
    rank = shape_a[0] if len(shape_a) == 2 else -1
    expected = ((rank, target.in_features), (target.out_features, rank))
    if rank < 1 or (tuple(shape_a), tuple(shape_b)) != expected:
        raise LoRAError(f"LoRA adapter {path}: {module!r} has lora_A {tuple(shape_a)} and "
                        f"lora_B {tuple(shape_b)}; this model needs (r, {target.in_features}) "
                        f"and ({target.out_features}, r): an adapter for another base model?")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {path}: rank {rank} is greater than max_lora_rank "
                        f"{max_rank}; raise max_lora_rank (--max-lora-rank)")
