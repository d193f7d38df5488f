"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter that cannot be loaded or used: the message names it and what is wrong."""


class LoRANotLoadedError(LoRAError):
    """A request names an adapter that is not loaded and gives no path to load it from."""


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` identifies the adapter to clients (the API's `model`); `lora_path` is a PEFT
    adapter directory (adapter_config.json + adapter_model.safetensors). `lora_int_id` is kept
    for vLLM's signature: a positive integer, unique per adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"LoRARequest.lora_name must be a non-empty string, got "
                            f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise LoRAError(f"LoRARequest.lora_int_id must be an integer >= 1, got "
                            f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise LoRAError(f"LoRARequest.lora_path must be a string, got {self.lora_path!r}")
