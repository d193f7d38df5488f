"""Tiny random-weight HF models and a minimal paged-cache driver for the model tests."""

from __future__ import annotations

import random

import torch
import transformers

from kvtier.models import build_attention_metadata
from kvtier.models.llama import LlamaForCausalLM

VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 64

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# architecture -> (HF config class, HF model class, extra config keys).
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"attention_bias": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {"head_dim": 32, "tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": 6}),
}


def make_hf_model(arch: str, directory, seed: int = 0, **overrides):
    """Save a tiny random fp32 HF model of `arch` into `directory`; return it (eval mode)."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Larger-than-default weights so logits differ clearly between tokens and positions.
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return model


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


class PagedDriver:
    """Runs our model step by step over a paged cache with shuffled (non-contiguous) blocks."""

    def __init__(self, model: LlamaForCausalLM, seed: int = 0) -> None:
        config = model.config
        self.model = model
        self.num_groups = len(model.kv_cache_groups())
        weight = next(model.parameters())
        self.device = weight.device
        self.kv_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads,
                                      config.head_dim, dtype=weight.dtype, device=self.device)
                          for _ in range(config.num_layers)]
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        # seq -> per group block list
        self.tables: dict[int, list[list[int]]] = {}
        self.computed: dict[int, int] = {}

    def _ensure_blocks(self, seq: int, length: int) -> None:
        tables = self.tables.setdefault(seq, [[] for _ in range(self.num_groups)])
        for table in tables:
            while len(table) * BLOCK_SIZE < length:
                table.append(self.free.pop())

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each seq its next tokens; return each seq's fp32 CPU logits for those tokens."""
        seqs = list(chunks)
        computed = [self.computed.get(s, 0) for s in seqs]
        lens = [len(chunks[s]) for s in seqs]
        for s, c, n in zip(seqs, computed, lens):
            self._ensure_blocks(s, c + n)
        metadata = build_attention_metadata(
            computed, lens, [[self.tables[s][g] for s in seqs] for g in range(self.num_groups)],
            BLOCK_SIZE, self.device)
        input_ids = torch.tensor([t for s in seqs for t in chunks[s]], device=self.device)
        positions = torch.tensor([p for c, n in zip(computed, lens) for p in range(c, c + n)],
                                 device=self.device)
        with torch.no_grad():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden).cpu()
        out, start = {}, 0
        for s, n in zip(seqs, lens):
            out[s] = logits[start:start + n]
            start += n
            self.computed[s] = self.computed.get(s, 0) + n
        return out
