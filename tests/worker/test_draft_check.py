"""Draft checking for sampling requests: every token made follows the model's distribution."""

import torch

from kvtier.sampling_params import SamplingParams
from kvtier.worker.draft_check import _accept_sampled, check_drafts
from kvtier.worker.sampler import Sampler, SamplingRow

P = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.35, 0.1, 0.1, 0.2, 0.25]])
TRIALS = 20_000


def test_a_kept_or_redrawn_first_token_follows_the_distribution():
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(TRIALS):
        counts[_accept_sampled(P[:1], [1], bonus=4, generator=generator)[0]] += 1
    # Draft 1 is kept with p(1); otherwise the draw excludes it: p overall.
    assert torch.allclose(counts / TRIALS, P[0], atol=0.015), counts / TRIALS


def test_the_second_token_follows_its_own_distribution_once_the_first_is_kept():
    generator = torch.Generator().manual_seed(1)
    seconds = torch.zeros(5)
    num = 0
    for _ in range(TRIALS):
        made = _accept_sampled(P, [1, 3], bonus=2, generator=generator)
        if made[0] == 1:
            num += 1
            seconds[made[1]] += 1
    assert abs(num / TRIALS - 0.4) < 0.015
    # Token 3 kept with p2(3) = 0.2, else redrawn from p2 without 3; a kept 3 is followed by
    # the bonus, which is not the second token.
    assert torch.allclose(seconds / num, P[1], atol=0.02), seconds / num


def test_an_unnormalized_distribution_is_taken_as_normalized():
    generator = torch.Generator().manual_seed(2)
    kept = sum(_accept_sampled(P[:1] * 0.5, [1], 0, generator)[0] == 1 for _ in range(TRIALS))
    assert abs(kept / TRIALS - 0.4) < 0.015


def test_greedy_rows_keep_drafts_up_to_the_argmax():
    sampler = Sampler(torch.device("cpu"), seed=0)
    row = SamplingRow(SamplingParams(temperature=0.0), None, ())
    logits = torch.log(P)
    assert check_drafts(sampler, logits, [(row, [1, 0], 9)]) == [[1, 0, 9]]
    assert check_drafts(sampler, logits, [(row, [1, 4], 9)]) == [[1, 0]]
    assert check_drafts(sampler, logits, [(row, [2, 0], 9)]) == [[1]]


def test_sampling_rows_use_their_processed_distribution():
    # top_k 1 leaves only the argmax: a draft elsewhere is never kept.
    sampler = Sampler(torch.device("cpu"), seed=0)
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=1), torch.Generator(), ())
    logits = torch.log(P)
    for _ in range(50):
        assert check_drafts(sampler, logits[:1], [(row, [3], 9)]) == [[1]]
        assert check_drafts(sampler, logits, [(row, [1, 0], 9)]) == [[1, 0, 9]]
