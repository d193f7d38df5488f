"""The n-gram proposer, draft acceptance and the config, without a model."""

import numpy as np
import pytest

from kvtier.kv import Request
from kvtier.sampling_params import SamplingParams
from kvtier.spec_decode import DraftTracker, SpeculativeConfig, accept_drafts
from kvtier.spec_decode.drafts import _ngram_draft

CONFIG = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def draft(tokens, lookup_min=1, lookup_max=3, room=3):
    return _ngram_draft(np.array(tokens), lookup_min, lookup_max, room)


def test_the_longest_suffix_seen_before_proposes_what_followed_it():
    # "7 8" occurs twice before; the latest occurrence is followed by 1 2.
    assert draft([7, 8, 5, 6, 7, 8, 1, 2, 9, 9, 7, 8]) == [1, 2, 9]
    # A 3-token match beats a shorter one elsewhere.
    assert draft([1, 2, 3, 4, 0, 3, 5, 1, 2, 3]) == [4, 0, 3]
    assert draft([1, 2, 3, 4]) == []  # nothing repeats
    assert draft([5, 5]) == [5]  # only the last token follows
    assert draft([1, 2, 1, 2], lookup_min=3) == []


def test_a_draft_keeps_the_agreed_prefix_then_the_models_token():
    assert accept_drafts([4, 5, 6], [4, 5, 6], bonus=7) == [4, 5, 6, 7]
    assert accept_drafts([4, 5, 6], [4, 9, 6], bonus=7) == [4, 9]
    assert accept_drafts([4, 5, 6], [1, 5, 6], bonus=7) == [1]


def decoding(token_ids, **params):
    request = Request("r", list(token_ids), SamplingParams(temperature=0.0, **params))
    request.num_computed_tokens = len(token_ids) - 1
    return request


def test_only_plain_decodes_draft_within_their_limits():
    tracker = DraftTracker(CONFIG)
    tokens = [1, 2, 3, 1, 2]
    assert tracker.draft(decoding(tokens, max_tokens=50), 100, 1000) == [3, 1, 2]
    assert tracker.draft(decoding(tokens, max_tokens=50), 3, 1000) == [3, 1]  # token budget
    assert tracker.draft(decoding(tokens, max_tokens=50), 100, 7) == [3, 1]  # context length
    assert tracker.draft(decoding(tokens, max_tokens=2), 100, 1000) == [3]  # max_tokens
    for params in ({"logprobs": 0}, {"repetition_penalty": 1.2}, {"logit_bias": {1: 1.0}},
                   {"allowed_token_ids": [1, 2]}, {"min_tokens": 3}, {"stop": ["x"]}):
        assert tracker.draft(decoding(tokens, max_tokens=50, **params), 100, 1000) == []
    sampled = Request("s", tokens, SamplingParams(temperature=0.7, top_p=0.9))
    sampled.num_computed_tokens = len(tokens) - 1
    assert tracker.draft(sampled, 100, 1000) == [3, 1, 2]
    prefill = decoding(tokens, max_tokens=50)
    prefill.num_computed_tokens = 0
    assert tracker.draft(prefill, 100, 1000) == []


def test_the_token_array_follows_a_growing_request():
    tracker = DraftTracker(CONFIG)
    request = decoding(list(range(2000)) + [5], max_tokens=5000)
    assert tracker.draft(request, 100, 10_000) == [6, 7, 8]
    for token in (6, 7, 8, 9):  # appended as the scheduler appends, past the first capacity
        request.append_output_token_ids(token)
        request.num_computed_tokens += 1
    assert tracker.draft(request, 100, 10_000) == [10, 11, 12]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "method must be one of ngram"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer in"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be"),
    ({"lookahead": 3}, "unknown keys \\['lookahead'\\]"),
    ("{nope", "is not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_configs_are_refused_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value, "--speculative-config")
