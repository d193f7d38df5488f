"""Llama-family models over the paged KV cache: configs, loaders, tokenizer, paged attention.

Names resolve lazily so `kvtier.models.config` (pure Python) can be imported without torch.
"""

import importlib

_EXPORTS = {
    "AttentionMetadata": "attention_metadata", "build_attention_metadata": "attention_metadata",
    "paged_attention": "attention", "reference_paged_attention": "attention",
    "write_kv": "attention", "KVCacheGroupLayout": "config", "ModelConfig": "config",
    "IncrementalDetokenizer": "detokenizer", "ChatTemplateError": "errors",
    "ModelLoadError": "errors", "LlamaForCausalLM": "llama", "LoadedModel": "loader",
    "default_model_path": "loader", "load_model": "loader", "Tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtier.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtier.models.{_EXPORTS[name]}"), name)
