"""LoRA adapters: many fine-tunes of one base model served side by side, each request with its
own (or none), several in one batch; each adapter's KV is cached apart from the others'.

The package itself holds only what needs no torch (the router and the server's HTTP layer import
it); the modules that load and apply adapters are imported by name: `kvtier.lora.adapter`,
`.layers`, `.registry`, `.targets`.
"""

from kvtier.lora.request import LoRAError, LoRANotLoadedError, LoRARequest

__all__ = ["LoRAError", "LoRANotLoadedError", "LoRARequest"]
