"""LoRA adapters: many fine-tunes of one base model served side by side, each request with its
own (or none), several in one batch; each adapter's KV is cached apart from the others'."""

from kvtier.lora.adapter import LoRAAdapter, load_adapter
from kvtier.lora.layers import LoRABatch, LoRALinear, attach_lora
from kvtier.lora.registry import LoRARegistry
from kvtier.lora.request import LoRAError, LoRARequest
from kvtier.lora.targets import LoRATarget, find_targets

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAError", "LoRALinear", "LoRARegistry",
           "LoRARequest", "LoRATarget", "attach_lora", "find_targets", "load_adapter"]
