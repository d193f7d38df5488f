"""Top-k logprobs of the model's own distribution, for sampled tokens and for prompt tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.logprobs import Logprob

# Prompt positions whose (rows, vocabulary) fp32 logprobs are held at once: 256 rows of a 49k
# vocabulary are 50 MB, where a whole 2k-token prefill chunk would be 400 MB.
PROMPT_ROWS_PER_SLICE = 256


def num_top(k: int, vocab: int) -> int:
    """SamplingParams' logprobs / prompt_logprobs count; -1 asks for the whole vocabulary."""
    return vocab if k == -1 else min(k, vocab)


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   ks: list[int]) -> list[dict[int, Logprob]]:
    """logprobs: (N, V) log-softmax rows; token_ids: (N,) the token at each row. Per row
    {token_id: Logprob} of the row's top ks[i] tokens (ranked 1..k) and its own token (its
    rank counted in the row: ties rank alike)."""
    vocab = logprobs.shape[-1]
    chosen = logprobs.gather(-1, token_ids[:, None])  # (N, 1)
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    widest = max(num_top(k, vocab) for k in ks)
    top_values, top_ids = (logprobs.topk(widest, dim=-1) if widest else (None, None))
    result = []
    for i, (token, value) in enumerate(zip(token_ids.tolist(), chosen[:, 0].tolist())):
        entry = {token: Logprob(value, ranks[i])}
        k = num_top(ks[i], vocab)
        if k:
            for rank, (top_id, top_value) in enumerate(zip(top_ids[i, :k].tolist(),
                                                           top_values[i, :k].tolist()), 1):
                entry.setdefault(top_id, Logprob(top_value, rank))
        result.append(entry)
    return result


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, next_token_ids: torch.Tensor,
                    k: int) -> list[dict[int, Logprob]]:
    """hidden: (P, hidden) at P consecutive prompt positions; next_token_ids: (P,) the prompt
    token after each. The logprobs of those tokens (and the top k) under the model, in slices
    so a long prefill never holds its whole (P, vocabulary) logits."""
    result: list[dict[int, Logprob]] = []
    for start in range(0, hidden.shape[0], PROMPT_ROWS_PER_SLICE):
        end = start + PROMPT_ROWS_PER_SLICE
        logits = compute_logits(hidden[start:end])  # (rows, vocab) fp32
        result.extend(token_logprobs(torch.log_softmax(logits, dim=-1),
                                     next_token_ids[start:end], [k] * logits.shape[0]))
    return result
