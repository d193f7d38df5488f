"""The adapters an engine has loaded, by name. Thread safe: a server loads adapters off the
engine thread, which then looks them up by name when requests arrive."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch
from torch import nn

from kvtier.lora.adapter import LoRAAdapter, load_adapter
from kvtier.lora.layers import LoRABatch, attach_lora
from kvtier.lora.request import LoRAError, LoRANotLoadedError, LoRARequest
from kvtier.lora.targets import find_targets


class LoRARegistry:
    """Attaches LoRA to `model`'s projections (once) and holds the loaded adapters, at most
    `max_cpu_loras` of them (None: any number): loading one more drops the least recently used,
    which a later request with its path loads again. A running request keeps the adapter object
    it started with, so unloading or dropping one never changes a running request's weights."""

    def __init__(self, model: nn.Module, *, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, max_cpu_loras: int | None = None) -> None:
        self._targets = find_targets(model)
        self._renames = tuple(getattr(model, "hf_renames", ()))
        self._max_rank = max_lora_rank
        self._max_loaded = max_cpu_loras
        self._dtype, self._device = dtype, device
        self.batch: LoRABatch = attach_lora(model, self._targets, device)
        self._lock = threading.Lock()
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Load `request.lora_path` under `request.lora_name`. The same name from the same path
        again returns the loaded adapter; another path under a loaded name is a LoRAError."""
        with self._lock:
            known = self._same_or_none(request)
        if known is not None:
            return known
        if not request.lora_path:
            raise LoRANotLoadedError(f"LoRA adapter {request.lora_name!r} is not loaded and "
                                     "the request gives no lora_path to load it from")
        adapter = load_adapter(request, self._targets, self._renames, self._max_rank,
                               self._dtype, self._device)
        with self._lock:
            known = self._same_or_none(request)
            if known is None:
                self._adapters[request.lora_name] = known = adapter
                while self._max_loaded is not None and len(self._adapters) > self._max_loaded:
                    self._adapters.popitem(last=False)
        return known

    def _same_or_none(self, request: LoRARequest) -> LoRAAdapter | None:
        """The loaded adapter of that name (now the most recently used), under the lock."""
        known = self._adapters.get(request.lora_name)
        if known is None:
            return None
        path = os.path.expanduser(request.lora_path)
        if request.lora_path and os.path.realpath(path) != os.path.realpath(known.path):
            raise LoRAError(f"LoRA adapter {request.lora_name!r} is already loaded from "
                            f"{known.path}; unload it first to load {path} under that name")
        self._adapters.move_to_end(request.lora_name)
        return known

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def remove(self, name: str) -> bool:
        """False if no adapter of that name is loaded."""
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())
