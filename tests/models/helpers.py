"""The model tests' variant of the shared tiny models, and a minimal paged-cache driver."""

from __future__ import annotations

import random

import torch

from kvtier.models import build_attention_metadata
from kvtier.models.llama import LlamaForCausalLM

from ..tiny_models import make_hf_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64

# The model tests stretch the shared architectures to cover more of the loader and decoder:
# biased attention projections (llama), a window of 5 (qwen2), tied embeddings (qwen3).
ARCH_OVERRIDES = {"llama": {"attention_bias": True}, "qwen2": {"sliding_window": 5},
                  "qwen3": {"tie_word_embeddings": True}, "mistral": {}}


def scattered_decodes(seq_lens: list[int], num_blocks: int, block: int,
                      gen: torch.Generator):
    """Metadata of one decode per sequence of `seq_lens` tokens, each sequence's blocks drawn
    at random from 1..num_blocks - 1 (block 0 is the null block)."""
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables, used = [], 0
    for n in seq_lens:
        pages = -(-n // block)
        tables.append([b + 1 for b in order[used:used + pages]])
        used += pages
    return build_attention_metadata([n - 1 for n in seq_lens], [1] * len(seq_lens), [tables],
                                    block)


def make_covering_hf_model(arch: str, directory, seed: int = 0, **overrides):
    """tiny_models.make_hf_model with ARCH_OVERRIDES[arch], then `overrides`, applied."""
    return make_hf_model(arch, directory, seed, **{**ARCH_OVERRIDES[arch], **overrides})


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
