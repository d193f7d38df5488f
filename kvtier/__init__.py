"""kvtier: an LLM serving engine built around a paged, prefix-cached, tiered KV cache."""

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kvtier.kv` must not pull torch in through the engine.
    if name == "LLM":
        from kvtier.engine.llm import LLM
        return LLM
    if name == "LoRARequest":
        from kvtier.lora.request import LoRARequest
        return LoRARequest
    if name == "SamplingParams":
        from kvtier.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
