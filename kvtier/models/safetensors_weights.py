"""Stream the tensors of an HF model directory's *.safetensors files."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from kvtier.models.errors import ModelLoadError


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files in the directory")
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
