"""Drafts for the scheduler, and their verification for the runner.

The scheduler asks `DraftTracker.draft` for each running request about to decode: a request
whose logits and end nothing shapes beyond temperature, top-k / top-p and min-p (no penalties,
biases, token masks, grammar, logprobs or stop strings; min_tokens reached; not a seeded
sampling request, whose tokens must not depend on its batch) gets the tokens an
n-gram match in its own prompt and output proposes, and the step computes them after its last
token. The runner checks them against the model's distribution at each position
(worker/draft_check.py: a greedy request keeps them up to the first that differs from the
argmax, then the model's token, so its tokens are the same as without drafts; a sampling
request keeps each with the probability the model gives it). A step makes 1 to k + 1 tokens.
`settle` takes back the computed positions whose tokens were not kept: their KV is
overwritten later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvtier.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvtier.kv import Request
    from kvtier.sched.output import ModelRunnerOutput, SchedulerOutput

# Initial room of a request's token array (it doubles as the request grows).
_INITIAL_CAPACITY = 1024
# Drafts are looked for among a request's last this many tokens: a scan per n-gram length of
# 32k tokens took 1.6 ms a request a step (128 requests: 0.2 s).
SEARCH_WINDOW = 4096


class DraftTracker:
    """The scheduler's drafts, and the counts behind the spec decode metrics."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # Request id -> (its tokens so far as an array with room to grow, how many are filled)
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def draft(self, request: Request, token_budget: int, max_model_len: int) -> list[int]:
        """Draft tokens to compute after the request's last token this step (maybe none)."""
        if not _may_speculate(request):
            return []
        room = min(self.config.num_speculative_tokens, token_budget - 1,
                   max_model_len - request.num_tokens)
        max_tokens = request.max_tokens
        if max_tokens is not None:  # a step makes at most drafts + 1 tokens
            room = min(room, max_tokens - request.num_output_tokens - 1)
        if room <= 0:
            return []
        tokens = self._array(request)[-SEARCH_WINDOW:]
        return _ngram_draft(tokens, self.config.prompt_lookup_min,
                            self.config.prompt_lookup_max, room)

    def settle(self, request: Request, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> None:
        """The step computed drafts for `request`: take back the positions computed for the
        drafts the runner did not keep."""
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens[request.request_id])
        num_made = len(runner_output.sampled_token_ids.get(request.request_id) or ())
        accepted = max(0, num_made - 1)
        request.num_computed_tokens -= num_drafts - accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def take_counts(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted draft tokens) since the last call."""
        counts = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        return counts

    def _array(self, request: Request) -> np.ndarray:
        """The request's tokens as an array, appended to rather than rebuilt each step."""
        tokens = request.all_token_ids
        array, filled = self._tokens.get(request.request_id, (None, 0))
        if array is None or filled > len(tokens):
            array, filled = np.empty(max(_INITIAL_CAPACITY, 2 * len(tokens)), np.int64), 0
        if len(tokens) > len(array):
            grown = np.empty(2 * len(tokens), np.int64)
            grown[:filled] = array[:filled]
            array = grown
        array[filled:len(tokens)] = tokens[filled:]
        self._tokens[request.request_id] = array, len(tokens)
        return array[:len(tokens)]


def _may_speculate(request: Request) -> bool:
    params = request.sampling_params
    if params is None or request.num_computed_tokens != request.num_tokens - 1:
        return False  # not decoding (a prefill chunk, or a resumed request)
    # Stop strings are matched in the text after the step: tokens drafted past one would
    # stay in the output's token ids. A seeded sampling request draws one number per draft
    # from its generator, and how many drafts it gets depends on the batch's token budget:
    # its tokens would depend on what it was batched with.
    seeded_sampling = params.seed is not None and not params.is_greedy
    return (not seeded_sampling and params.logprobs is None and not params.has_penalties
            and not params.logit_bias and not params.allowed_token_ids and not params.stop
            and not request.bad_words_token_ids and request.grammar is None
            and request.num_output_tokens >= params.min_tokens)


def _ngram_draft(tokens: np.ndarray, lookup_min: int, lookup_max: int, room: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (lookup_max down to lookup_min long) that occurred before; [] if none did."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[-n:]
        # Windows that start early enough for at least one token to follow them.
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return tokens[start:start + room].tolist()
    return []


def accept_drafts(drafts: list[int], targets: list[int], bonus: int) -> list[int]:
    """The tokens a step makes: `targets[i]` is the model's greedy token where `drafts[i]` was
    computed as the next token, `bonus` its token after the last draft."""
    for i, (draft, target) in enumerate(zip(drafts, targets)):
        if draft != target:
            return [*drafts[:i], target]
    return [*drafts, bonus]
