"""Checking a step's draft tokens (speculative decoding) against the model's distribution.

A greedy request keeps its drafts up to the first that differs from the model's argmax there,
then the model's token (the same tokens as without drafts). A sampling request keeps draft d
at a position with probability p(d), p being the model's distribution there after its
temperature, top-k / top-p and min-p (a draft proposes d with certainty); at the first draft
it does not keep, it draws from p without d instead. Every token so made follows p, as a
plain step's draw would (speculative sampling, the proposal a point mass). A seeded sampling
request takes no drafts (spec_decode/drafts.py): how many it would get depends on its batch, and
each is a draw from its generator, so its tokens would too.
"""

from __future__ import annotations

import torch

from kvtier.spec_decode import accept_drafts
from kvtier.worker.sampler import Sampler, SamplingRow, inverse_cdf_sample


def check_drafts(sampler: Sampler, logits: torch.Tensor,
                 drafting: list[tuple[SamplingRow, list[int], int]]) -> list[list[int]]:
    """The tokens each drafting request makes this step. `logits` (D, V): the model's at each
    draft's position, every request's in order; `drafting`: per request, its sampling row,
    its drafts and the token the sampler drew after the last draft (the bonus)."""
    made, offset = [], 0
    for row, drafts, bonus in drafting:
        here = logits[offset:offset + len(drafts)]
        offset += len(drafts)
        if row.params.is_greedy:
            made.append(accept_drafts(drafts, here.max(dim=-1).indices.tolist(), bonus))
        else:
            probs = sampler.probabilities(here, [row] * len(drafts))
            made.append(_accept_sampled(probs, drafts, bonus,
                                        row.generator or sampler.generator))
    return made


def _accept_sampled(probs: torch.Tensor, drafts: list[int], bonus: int,
                    generator: torch.Generator) -> list[int]:
    """`probs` (k, V): the distribution at each draft's position (a min-p floor leaves it
    unnormalized)."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    draws = torch.empty(len(drafts), 1, dtype=torch.float64, device=probs.device)
    draws.uniform_(generator=generator)
    kept = (draws[:, 0] < probs[torch.arange(len(drafts)), drafts].double()).tolist()
    for i, draft in enumerate(drafts):
        if not kept[i]:
            residual = probs[i:i + 1].clone()
            residual[0, draft] = 0.0
            retry = torch.empty(1, 1, dtype=torch.float64, device=probs.device)
            retry.uniform_(generator=generator)
            return [*drafts[:i], int(inverse_cdf_sample(residual, retry)[0])]
    return [*drafts, bonus]
