"""Applying each row's grammar mask to a step's logits."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import torch

from kvtier.structured_output.grammar import StructuredOutputGrammar

_BITS = 32


def apply_grammar_masks(logits: torch.Tensor,
                        grammars: Sequence[StructuredOutputGrammar | None]) -> torch.Tensor:
    """logits (N, V) with -inf for every token a row's grammar does not allow next (rows
    without an active grammar are untouched; `logits` itself is not changed)."""
    rows = [i for i, grammar in enumerate(grammars) if grammar is not None and grammar.active]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    # One bit per token, 32 to an int32, filled by llguidance (on its threads for several).
    bitmask = torch.zeros(len(rows), -(-vocab // _BITS), dtype=torch.int32)
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    if len(rows) == 1:
        grammars[rows[0]].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
    else:
        _parallel().unsafe_compute_mask_ptr(
            [(grammars[i].matcher, k) for k, i in enumerate(rows)], bitmask.data_ptr(),
            row_bytes, len(rows))
    shifts = torch.arange(_BITS, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return masked


@functools.cache
def _parallel() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()
