"""Stream the tensors of an HF model directory's safetensors weight files."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from kvtier.models.errors import ModelLoadError
from kvtier.models.hf_config import read_json

INDEX_FILE = "model.safetensors.index.json"
# Mistral's own-format copy of the weights (`layers.0.attention.wq.weight`), shipped beside the
# HF shards in Mistral's repositories; loading both would give every tensor twice.
_NATIVE_PREFIX = "consolidated"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files to load: those the index's weight_map names if there is an index, else
    every *.safetensors file but Mistral's consolidated ones."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        return _indexed_files(index, model_dir)
    files = [path for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
             if not os.path.basename(path).startswith(_NATIVE_PREFIX)]
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files in the directory "
                                        "(consolidated*.safetensors, Mistral's own format, "
                                        "are not read)")
    return files


def _indexed_files(index: str, model_dir: str) -> list[str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(index, "expected a non-empty 'weight_map' object")
    if not all(isinstance(name, str) for name in weight_map.values()):
        raise ModelLoadError(index, "'weight_map' values must be file names")
    files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    for path in files:
        if not os.path.isfile(path):
            raise ModelLoadError(index, f"names the weight file {os.path.basename(path)!r}, "
                                        "which is not in the directory")
    return files


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; one tensor in memory at a time."""
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(path, f"corrupt or truncated safetensors file ({exc})") from exc
