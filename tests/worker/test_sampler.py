import math

import pytest
import torch

from kvtier.sampling_params import SamplingParams
from kvtier.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_top_k_top_p,
    inverse_cdf_sample,
    top_k_top_p_sorted,
)

CPU = torch.device("cpu")


def row(params: SamplingParams, *, generator=None, num_output_tokens=0, stop_ids=(),
        prompt=(), output=None):
    """A row whose request has `prompt` and then `output` (default: `num_output_tokens` 0s)."""
    output = [0] * num_output_tokens if output is None else list(output)
    return SamplingRow(params, generator, tuple(stop_ids), list(prompt) + output, len(prompt))


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def probs_logits(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def draw_many(logits: torch.Tensor, params: SamplingParams, times: int = 200) -> set[int]:
    sampler = Sampler(CPU, seed=0)
    batch = logits.repeat(times, 1)
    return set(sampler.sample(batch, [row(params)] * times).token_ids)


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    out = Sampler(CPU, 0).sample(logits, [row(SamplingParams(temperature=0.0))] * 2)
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [row(params, num_output_tokens=1, stop_ids=(1,)),
            row(params, num_output_tokens=2, stop_ids=(1,))]
    assert Sampler(CPU, 0).sample(logits, rows).token_ids == [2, 1]


def test_top_p_keeps_the_smallest_covering_set():
    logits = probs_logits(0.5, 0.3, 0.2)
    assert draw_many(logits, SamplingParams(top_p=0.5)) == {0}
    assert draw_many(logits, SamplingParams(top_p=0.6)) == {0, 1}
    assert draw_many(logits, SamplingParams()) == {0, 1, 2}


def test_top_k_and_min_p_cut_the_tail():
    logits = probs_logits(0.5, 0.3, 0.2)
    assert draw_many(logits, SamplingParams(top_k=1)) == {0}
    assert draw_many(logits, SamplingParams(top_k=2)) == {0, 1}
    assert draw_many(logits, SamplingParams(min_p=0.5)) == {0, 1}


def test_min_p_applies_to_the_tempered_distribution_before_top_p():
    # vLLM's order: min-p on the whole distribution (floor 0.25: the 0.1s go), then top-p over
    # what is left (0.5 / 0.8 = 0.625 covers 0.6 alone). Top-p first kept 0.5 and 0.3, and
    # min-p then (floor 0.3125 of 0.625 / 0.375) kept both.
    sampler = Sampler(CPU, seed=0)
    logits = probs_logits(0.5, 0.3, 0.1, 0.1)
    probs = sampler.probabilities(logits, [row(SamplingParams(top_p=0.6, min_p=0.5))])
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    probs = sampler.probabilities(logits, [row(SamplingParams(top_p=0.9, min_p=0.5))])
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_sampling_follows_the_distribution():
    logits = probs_logits(0.7, 0.2, 0.1).repeat(4000, 1)
    params = SamplingParams(seed=None)
    tokens = torch.tensor(Sampler(CPU, 1).sample(logits, [row(params)] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    logits = torch.randn(3, 50, generator=seeded(7))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(CPU, 0).sample(logits[1:2], [row(params, generator=seeded(42))]).token_ids[0]
             for _ in range(2)]
    other = SamplingParams(temperature=1.0)
    batched = Sampler(CPU, 5).sample(
        logits, [row(other), row(params, generator=seeded(42)), row(other)]).token_ids[1]
    assert alone[0] == alone[1] == batched


def test_logprobs_are_the_raw_model_distribution_with_the_sampled_token():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    expected = torch.log_softmax(logits[0], dim=-1)
    out = Sampler(CPU, 0).sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    assert out.token_ids == [2]
    assert out.logprobs[0].keys() == {2, 1}
    assert out.logprobs[0][2].logprob == pytest.approx(float(expected[2]))
    assert out.logprobs[0][1].logprob == pytest.approx(float(expected[1]))
    assert (out.logprobs[0][2].rank, out.logprobs[0][1].rank) == (1, 2)


def test_logprobs_rank_a_sampled_token_outside_the_top_k_and_skip_rows_not_asking():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 9.0, 0.0]])
    # logit_bias makes token 3 the greedy pick; the logprobs stay the model's own.
    biased = SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 50.0})
    out = Sampler(CPU, 0).sample(logits, [row(biased), row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [3, 2]
    assert {t: (e.rank, round(e.logprob, 4)) for t, e in out.logprobs[0].items()} == {
        3: (4, round(float(torch.log_softmax(logits[0], -1)[3]), 4)),
        2: (1, round(float(torch.log_softmax(logits[0], -1)[2]), 4))}
    assert out.logprobs[1] is None


GREEDY_ONE = dict(temperature=0.0, max_tokens=4)


def greedy_token(logits: list[float], params: SamplingParams, **row_options) -> int:
    sampler = Sampler(CPU, seed=0)
    return sampler.sample(torch.tensor([logits]), [row(params, **row_options)]).token_ids[0]


def test_logit_bias_moves_greedy_and_leaves_other_rows_alone():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    biased = SamplingParams(**GREEDY_ONE, logit_bias={2: -5.0, 0: 0.5})
    plain = SamplingParams(**GREEDY_ONE)
    assert Sampler(CPU, 0).sample(logits, [row(biased), row(plain)]).token_ids == [1, 2]
    assert greedy_token([0.0, 1.0, 2.0], SamplingParams(**GREEDY_ONE, logit_bias={0: 100.0})) == 0


def test_a_banned_token_is_never_drawn():
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0})
    assert 0 not in draw_many(probs_logits(0.9, 0.05, 0.05), params)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    params = SamplingParams(**GREEDY_ONE, repetition_penalty=2.0)
    # Token 0 (in the prompt) falls from 2.0 to 1.0, below token 1's 1.5.
    assert greedy_token([2.0, 1.5, -3.0], params, prompt=[0, 2]) == 1
    # Unseen tokens keep their logits.
    assert greedy_token([2.0, 1.5, -3.0], params, prompt=[2]) == 0
    # A negative logit grows more negative: token 1 (generated) from -0.4 to -0.8, below -0.5.
    assert greedy_token([-1.0, -0.4, -0.5], params, prompt=[0], output=[1]) == 2


def test_frequency_penalty_counts_each_generated_occurrence_presence_penalty_once():
    logits = [1.0, 0.9]
    # The prompt's tokens do not count: only generated ones.
    frequency = SamplingParams(**GREEDY_ONE, frequency_penalty=0.04)
    assert greedy_token(logits, frequency, prompt=[0, 0, 0, 0], output=[0, 0]) == 0  # 0.92
    assert greedy_token(logits, frequency, output=[0, 0, 0]) == 1  # 0.88
    presence = SamplingParams(**GREEDY_ONE, presence_penalty=0.05)
    assert greedy_token(logits, presence, output=[0, 0, 0, 0]) == 0  # 0.95, once
    assert greedy_token(logits, SamplingParams(**GREEDY_ONE, presence_penalty=0.2),
                        output=[0]) == 1
    # Negative penalties favour what was generated.
    assert greedy_token([0.9, 1.0], SamplingParams(**GREEDY_ONE, presence_penalty=-0.2),
                        output=[0]) == 0


@pytest.mark.parametrize("vocab", [3000, 3072])  # a partial last block, whole blocks only
def test_inverse_cdf_draws_follow_a_wide_distribution_and_skip_zero_probabilities(vocab):
    # Every third entry at probability 0, and draws at the edges (0, just below 1) and spread
    # between them.
    probs = torch.rand(1, vocab, generator=seeded(3), dtype=torch.float64).float()
    probs[:, ::3] = 0.0
    probs /= probs.sum()
    draws = torch.cat([torch.tensor([0.0, 1.0 - 2 ** -53]),
                       torch.rand(20000, generator=seeded(4), dtype=torch.float64)])[:, None]
    tokens = inverse_cdf_sample(probs.expand(len(draws), -1), draws)
    assert tokens.min() >= 0 and tokens.max() < vocab
    assert not bool((tokens % 3 == 0).any())
    # Draws sorted give tokens sorted: the cumulative order is the vocabulary's.
    order = draws[:, 0].argsort()
    assert bool((tokens[order].diff() >= 0).all())
    counts = torch.bincount(tokens, minlength=vocab).double() / len(draws)
    # Per 100-token bucket, the frequency is the probability mass within sampling noise.
    buckets = vocab // 100
    assert torch.allclose(counts[:buckets * 100].view(buckets, 100).sum(-1),
                          probs[0, :buckets * 100].double().view(buckets, 100).sum(-1),
                          atol=0.004)


@pytest.mark.parametrize("scale", [8.0, 1.0])  # peaked rows (cut among the candidates), flat
def test_top_k_top_p_among_candidates_equals_the_cut_over_the_sorted_vocabulary(scale):
    # 5,000 entries, more than TOP_P_CANDIDATES: flat rows need the fallback for their top_p.
    logits = torch.randn(8, 5000, generator=seeded(11)) * scale
    settings = [(0, 1.0), (50, 1.0), (0, 0.9), (0, 0.5), (40, 0.9), (2000, 0.95), (1, 0.3),
                (0, 0.99)]
    rows = [row(SamplingParams(temperature=1.0, top_k=k, top_p=p)) for k, p in settings]
    vocab = logits.shape[-1]
    expected = top_k_top_p_sorted(logits, [k or vocab for k, _ in settings],
                                   [p for _, p in settings])
    assert torch.equal(apply_top_k_top_p(logits, rows), expected)


def test_a_kept_prompt_tensor_gives_the_same_penalties_as_the_token_list():
    logits = torch.randn(2, 40, generator=seeded(5))
    params = SamplingParams(**GREEDY_ONE, repetition_penalty=1.7, frequency_penalty=0.3)
    prompt, output = [3, 9, 9, 17], [21, 3, 30, 21]
    listed = row(params, prompt=prompt, output=output)
    kept = SamplingRow(params, None, (), prompt + output, len(prompt), torch.tensor(prompt))
    expected = greedy_token(logits[0].tolist(), params, prompt=prompt, output=output)
    sampler = Sampler(CPU, 0)
    assert sampler.sample(logits[:1], [kept]).token_ids == [expected]
    assert sampler.sample(logits, [kept, listed]).token_ids[0] == expected


def test_a_temperature_too_small_to_divide_by_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    sampler = Sampler(CPU, 0)
    tiny = SamplingParams(temperature=1e-40, seed=1)
    assert tiny.is_greedy
    mixed = sampler.sample(logits.repeat(2, 1), [row(tiny), row(SamplingParams(seed=2))])
    assert mixed.token_ids[0] == 1 and not mixed.errors


def test_values_past_float32_range_act_as_its_limits():
    """A bias or repetition penalty past float32's range, a top_p that rounds to 0, and a
    temperature just above greedy's scaling the overflowed logits: each draws what its limit
    means, never a NaN distribution (a fuzzed request found the last three failing)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    cases = [
        (SamplingParams(logit_bias={0: 1e39, 2: 1e39}), {0, 2}),
        (SamplingParams(logit_bias={0: 1e39}, temperature=1.1e-5), {0}),
        (SamplingParams(top_p=1e-300), {1}),
        (SamplingParams(top_p=1e-300, top_k=3), {1}),
        # 1e-300 rounds to 0, taken as the smallest positive float: the seen positive logits
        # (0.1, 1.9) both grow to the logits' limit and share the draws.
        (SamplingParams(repetition_penalty=1e-300), {0, 3}),
        # 1e39 rounds to inf: seen tokens with positive logits go to 0, the negative one to
        # minus the limit (never drawn beside the others)...
        (SamplingParams(repetition_penalty=1e39), {0, 1, 3}),
        # ... but drawn where it is the only token allowed, even at a temperature that scales
        # the limit up (it overflowed to -inf: nothing was left to draw).
        (SamplingParams(repetition_penalty=1e39, temperature=1.1e-5, allowed_token_ids=[2]),
         {2}),
    ]
    for params, expected in cases:
        sampler = Sampler(CPU, 0)
        rows = [row(params, prompt=[0, 3, 2] if params.repetition_penalty != 1.0 else ())] * 300
        out = sampler.sample(logits.repeat(300, 1), rows)
        assert not out.errors and set(out.token_ids) == expected, params


def test_allowed_token_ids_keep_only_those_tokens_greedy_and_sampled():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]]).repeat(3, 1)
    out = Sampler(CPU, 0).sample(logits, [
        row(SamplingParams(temperature=0.0, allowed_token_ids=[0, 2])),
        row(SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[3])),
        row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [0, 3, 1]


def test_bad_words_ban_the_token_that_would_complete_them():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]]).repeat(3, 1)  # greedy: 2, then 3
    words = ((2, 3), (1,))  # "2 3" and "1" are banned
    rows = [row(SamplingParams(temperature=0.0), output=[7, 2]),  # "2" just generated
            row(SamplingParams(temperature=0.0), output=[7, 0]),
            row(SamplingParams(temperature=0.0), output=[])]
    for r in rows:
        r.bad_words_token_ids = words
    assert Sampler(CPU, 0).sample(logits, rows).token_ids == [2, 2, 2]
    logits[:, 2] = -1.0  # now 3 leads, unless it completes "2 3"
    assert Sampler(CPU, 0).sample(logits, rows).token_ids == [0, 3, 3]


@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_non_finite_model_logits_fail_their_row_alone_naming_the_model(broken):
    """NaN logits (e.g. from an adapter with NaN weights) once failed as "no token is
    allowed", blaming the grammar, allowed_token_ids, bad_words and min_tokens."""
    logits = torch.tensor([[0.1, 2.0, -1.0], [0.1, 2.0, -1.0], [3.0, 0.0, 1.0]])
    logits[1] = broken
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0)]
    out = Sampler(CPU, 0).sample(logits, [row(p) for p in params])
    assert out.token_ids[0] == 1 and out.token_ids[1] is None and out.token_ids[2] == 0
    assert list(out.errors) == [1]
    assert "the model produced NaN or infinite logits" in out.errors[1]
    assert "no token is allowed" not in out.errors[1]


def test_every_token_ruled_out_still_names_the_request_fields():
    logits = torch.tensor([[0.1, float("nan"), 1.0], [0.1, 2.0, 1.0]])
    rows = [row(SamplingParams(temperature=0.0, allowed_token_ids=[0])),
            row(SamplingParams(temperature=0.0, allowed_token_ids=[1], min_tokens=1),
                stop_ids=(1,))]
    out = Sampler(CPU, 0).sample(logits, rows)
    # Row 0's NaN is on a token it rules out: nothing is broken for it.
    assert out.token_ids == [0, None]
    assert "no token is allowed" in out.errors[1]


def test_a_kept_allowed_ids_tensor_is_used_not_made_again(monkeypatch):
    """Made again every step, 49k allowed ids cost every request of the batch ~5 ms a step:
    the request keeps them as a tensor (RequestState.allowed_ids), which the sampler uses."""
    allowed, made = [0, 2], []
    real_tensor = torch.tensor

    def tensor(data, *args, **kwargs):
        if data is allowed:
            made.append(data)
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    sampler = Sampler(CPU, 0)
    logits = real_tensor([[0.1, 2.0, -1.0, 1.9]])
    kept = row(SamplingParams(temperature=0.0, allowed_token_ids=allowed))
    kept.allowed_ids = real_tensor(allowed)
    for _ in range(3):
        assert sampler.sample(logits.repeat(2, 1), [kept, kept]).token_ids == [0, 0]
    assert made == []
    # A row without one gives the same tokens, making it.
    listed = row(SamplingParams(temperature=0.0, allowed_token_ids=allowed))
    assert sampler.sample(logits, [listed]).token_ids == [0]
    assert len(made) == 1


def test_a_bad_word_is_banned_only_after_all_of_its_first_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0]]).repeat(3, 1)  # greedy: 3
    rows = [row(SamplingParams(temperature=0.0), output=[1, 2]),
            row(SamplingParams(temperature=0.0), output=[0, 2]),  # the last token alone
            row(SamplingParams(temperature=0.0), output=[2])]  # too short for the word
    for r in rows:
        r.bad_words_token_ids = ((1, 2, 3),)
    assert Sampler(CPU, 0).sample(logits, rows).token_ids == [2, 3, 3]
