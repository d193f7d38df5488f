"""Token sampling from one step's logits: greedy, temperature, top-k, top-p, min-p, seeds,
structured output grammars, allowed token ids, bad words, min_tokens, logit bias, presence /
frequency / repetition penalties and logprobs.

The logits go through, in vLLM's order: the grammar's mask, the allowed-token mask, the
bad-word bans, the min_tokens mask, the logit bias, the penalties (repetition, then frequency
and presence); greedy rows take the argmax of the result, the others then apply temperature,
min-p and top-k / top-p and draw. Logprobs are the model's own distribution after the
grammar's mask, before the rest."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.logprobs import Logprob
from kvtier.sampling_params import GREEDY_BELOW, SamplingParams
from kvtier.structured_output import StructuredOutputGrammar, apply_grammar_masks
from kvtier.worker.logprobs import token_logprobs

logger = logging.getLogger(__name__)

# Vocabulary entries per block of the inverse-CDF draw (see inverse_cdf_sample).
_CDF_BLOCK = 1024
# Largest logits per row among which a top-p cut is made first (see apply_top_k_top_p).
TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request in this step's batch."""

    params: SamplingParams
    # The request's own generator when it has a seed; else the sampler's shared one is used.
    generator: torch.Generator | None
    # Token ids that end the request (EOS and stop_token_ids): masked until min_tokens is reached.
    stop_token_ids: tuple[int, ...]
    # The prompt and every token sampled so far (the request's own list, not a copy), of which
    # the first `num_prompt_tokens` are the prompt.
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    # The prompt's ids as a tensor, kept by the request between steps; None: made from
    # `token_ids` when needed.
    prompt_tensor: torch.Tensor | None = None
    # Token id sequences never to be completed (SamplingParams.bad_words, tokenized).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # SamplingParams.structured_outputs' grammar: only the tokens it allows next may come.
    grammar: StructuredOutputGrammar | None = None
    # SamplingParams.allowed_token_ids as a tensor, kept by the request between steps (49k ids
    # made into one every step cost ~5 ms a step); None: made from the params when needed.
    allowed_ids: torch.Tensor | None = None

    @property
    def generated_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SamplerOutput:
    # Per row; None where sampling that row failed (its message is in `errors`).
    token_ids: list[int | None]
    # Per row: the top-k plus the sampled token, or None if not asked for.
    logprobs: list[dict[int, Logprob] | None]
    # Row index -> why sampling it failed.
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        # Shared stream for unseeded requests, seeded so an engine run is reproducible.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: fp32 (N, V), one row per entry of `rows`. A row whose parameters break
        sampling fails alone (see SamplerOutput.errors); the other rows get the tokens they
        would get without it."""
        try:
            return self._sample_batch(logits, rows)
        except Exception:
            logger.exception("sampling a batch of %d rows failed; sampling them one by one",
                             len(rows))
        return self._sample_rows_apart(logits, rows)

    def _sample_rows_apart(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # Every per-row check runs before the noise is drawn, so the failed batch consumed no
        # randomness and each row draws here what it would have drawn in the batch.
        output = SamplerOutput([], [])
        for i, row in enumerate(rows):
            try:
                single = self._sample_batch(logits[i:i + 1], [row])  # (1, V)
            except Exception as exc:
                output.token_ids.append(None)
                output.logprobs.append(None)
                output.errors[i] = f"sampling failed: {exc!r}"
                continue
            output.token_ids.append(single.token_ids[0])
            output.logprobs.append(single.logprobs[0])
        return output

    def _sample_batch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        # As vLLM: the grammar's mask comes first, and the logprobs reported are after it.
        logits = apply_grammar_masks(logits, [r.grammar for r in rows])
        # Otherwise vLLM reports the model's own distribution, before any sampling processing.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = _ban_bad_words(_keep_allowed_tokens(logits, rows), rows)
        logits = _mask_early_stops(logits, rows)
        logits = _apply_penalties(_apply_logit_bias(logits, rows), rows)
        # One pass for each row's max (the check) and its first argmax (greedy rows): `max`
        # over the vocabulary takes a third of `argmax`'s time here (0.9 against 2.5 ms for
        # 64 rows). Before any draw: the rows apart then draw what they would have drawn here.
        peaks, greedy_ids = logits.max(dim=-1)
        _check_drawable(peaks)
        is_greedy = [r.params.is_greedy for r in rows]
        if all(is_greedy):
            token_ids = greedy_ids
        else:
            token_ids = self._sample_random(logits, rows)
            if any(is_greedy):
                token_ids = torch.where(torch.tensor(is_greedy, device=logits.device),
                                        greedy_ids, token_ids)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            index = torch.tensor(asking, device=logits.device)
            entries = token_logprobs(raw_logprobs[index], token_ids[index],
                                     [rows[i].params.logprobs for i in asking])
            for i, entry in zip(asking, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's distribution to draw from: after its temperature (greedy rows: 1), then
        min-p (on the tempered distribution, as vLLM applies it), then top-k / top-p."""
        device = logits.device
        # Times the reciprocal: a broadcast division took ~7x as long here.
        inverse = torch.tensor([1.0 if r.params.is_greedy else 1.0 / r.params.temperature
                                for r in rows],
                               dtype=logits.dtype, device=device)
        # No overflow: the processing kept finite logits within _logit_limit.
        logits = logits * inverse[:, None]
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            probs = torch.softmax(logits, dim=-1)
            floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
            below = probs < floor * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(below, float("-inf"))
        return torch.softmax(apply_top_k_top_p(logits, rows), dim=-1)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """A draw for every row (greedy ones included, at temperature 1: the caller takes
        their argmax)."""
        probs = self.probabilities(logits, rows)
        device = logits.device
        # Inverse-CDF sampling: one uniform draw per row, from the row's own generator (a
        # seeded request gets the same tokens in any batch). An exponential race (argmax
        # p / Exp(1)) draws one number per vocabulary entry instead: 66 ms for 64 rows of a 49k
        # vocabulary on 2 cores, against ~6 ms for all of this sampling.
        draws = torch.empty(len(rows), 1, dtype=torch.float64, device=device)
        for i, row in enumerate(rows):
            draws[i].uniform_(generator=row.generator or self.generator)
        return inverse_cdf_sample(probs, draws)


def inverse_cdf_sample(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row the token where the cumulative probability first exceeds `draws` (N, 1) in
    [0, 1) times the row's total: a draw from `probs` (N, V), never a token of probability 0.

    The cumulative sums are float64 (so the tail keeps its share) but short: which block holds
    the point from the cumulative sum of the blocks' sums, then where in it from that one
    block's (a float64 cumulative sum of the whole (64, 49k) batch took ~10 ms here)."""
    num_rows, vocab = probs.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    padding = num_blocks * _CDF_BLOCK - vocab
    blocks = torch.nn.functional.pad(probs, (0, padding)) if padding else probs.contiguous()
    blocks = blocks.view(num_rows, num_blocks, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # (N, blocks)
    total = block_cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):
        # (N values to check.) The processing keeps logits below +inf, so only NaN logits
        # from the model itself get here.
        raise ValueError("the sampling distribution is not finite (NaN logits)")
    # Below the total even where draw x total rounds up to it.
    point = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, point, right=True).clamp_(max=num_blocks - 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp_(min=0)), 0.0)
    inner_cdf = blocks[torch.arange(num_rows, device=probs.device), block[:, 0]]
    inner_cdf = inner_cdf.double().cumsum(dim=-1)  # (N, block size)
    # Rounding may put the point at or past the block's own total: keep it inside, where the
    # block's last token of probability > 0 takes it.
    inside = torch.minimum(point - before, torch.nextafter(inner_cdf[:, -1:],
                                                            torch.zeros_like(point)))
    offset = torch.searchsorted(inner_cdf, inside, right=True)
    return (block * _CDF_BLOCK + offset).squeeze(1).clamp_(max=vocab - 1)


def _check_drawable(peaks: torch.Tensor) -> None:
    """ValueError naming the cause if a row has nothing to draw from, from each row's max
    logit (NaN if the row holds a NaN, +inf if it holds one, -inf if every token was ruled
    out). The processing only ever writes -inf (a ruled-out token) and keeps the rest finite,
    so a NaN or +inf comes from the model itself."""
    # One read back (a device sync) for both checks.
    model_broken, all_ruled_out = torch.stack([
        (peaks.isnan() | (peaks == float("inf"))).any(),
        (peaks == float("-inf")).any()]).tolist()
    if model_broken:
        raise ValueError("the model produced NaN or infinite logits (a LoRA adapter or model "
                         "weights with NaN / inf values, or an overflow in its dtype?)")
    if all_ruled_out:
        raise ValueError("no token is allowed: the structured output grammar, "
                         "allowed_token_ids, bad_words and min_tokens ruled out every one")


def _keep_allowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows with allowed_token_ids keep only those tokens' logits."""
    limited = [(i, r) for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not limited:
        return logits
    logits = logits.clone()
    for i, row in limited:
        ids = row.allowed_ids if row.allowed_ids is not None else torch.tensor(
            row.params.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[i, ids]
        logits[i] = float("-inf")
        logits[i, ids] = kept
    return logits


def _ban_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A bad word's last token is banned where the generated tokens end with the rest of it
    (a one-token word: always)."""
    banned = []
    for i, row in enumerate(rows):
        if not row.bad_words_token_ids:
            continue  # (generated_token_ids copies the row's output: only where needed)
        generated = row.generated_token_ids
        last = generated[-1] if generated else None
        for word in row.bad_words_token_ids:
            prefix = len(word) - 1
            # The last tokens first: most words fail there, without copying the tail.
            if prefix == 0 or prefix <= len(generated) and word[-2] == last and \
                    tuple(generated[len(generated) - prefix:]) == word[:-1]:
                banned.append((i, word[-1]))
    if not banned:
        return logits
    logits = logits.clone()
    for i, token in banned:
        logits[i, token] = float("-inf")
    return logits


def _mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbid EOS and stop tokens for requests that have not reached min_tokens yet."""
    early = [(i, r.stop_token_ids) for i, r in enumerate(rows)
             if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids]
    if not early:
        return logits
    logits = logits.clone()
    for i, stop_ids in early:
        logits[i, list(stop_ids)] = float("-inf")
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    limit = _logit_limit(logits.dtype)
    for i, bias in biased:
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        # A bias past the logits' range (the offline API takes any finite number) acts as the
        # largest one; -inf (a banned token) plus a finite bias stays -inf.
        values = torch.tensor(list(bias.values()), dtype=torch.float64).clamp_(-limit, limit)
        values = values.to(device=logits.device, dtype=logits.dtype)
        logits[i, ids] = _finite_limits(logits[i, ids] + values, logits[i, ids])
    return logits


def _finite_limits(result: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """`result` of changing the logits `before` (a bias, a penalty), with each finite logit
    kept within +-_logit_limit: a temperature (at most 1 / GREEDY_BELOW times) then cannot
    overflow it to inf (softmax over an inf is NaN, and a row whose every allowed logit went to
    -inf would have nothing left to draw). A banned token (-inf) stays banned."""
    limit = _logit_limit(result.dtype)
    return torch.where(torch.isinf(before), result, result.clamp(-limit, limit))


def _logit_limit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max * GREEDY_BELOW


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over the prompt's and generated tokens, then frequency and presence
    penalties over the generated ones, for the rows that ask; the others are left alone.

    Only the logits of tokens a row has seen change, so they are gathered, changed and put
    back (a token seen twice gets the same value written twice) instead of passing over the
    whole (rows, vocabulary) batch once per operation. The prompt's ids come as the tensor the
    request keeps (`prompt_tensor`); only the generated ones are turned into one each step."""
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalized:
        return logits
    logits = logits.clone()
    device, dtype = logits.device, logits.dtype
    repeat = [i for i in penalized if rows[i].params.repetition_penalty != 1.0]
    if repeat:
        at = _token_positions({i: _seen_ids(rows[i], device) for i in repeat}, device)
        values = logits[at]
        # Within float32's positive finite range: 1e-300 rounds to 0, 1e39 to inf.
        finfo = torch.finfo(dtype)
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=dtype,
                               device=device)[at[0]].clamp_(min=finfo.tiny, max=finfo.max)
        logits[at] = _finite_limits(torch.where(values > 0, values / penalty,
                                                values * penalty), values)
    counted = [i for i in penalized if rows[i].params.frequency_penalty != 0.0
               or rows[i].params.presence_penalty != 0.0]
    if counted:
        at = _token_positions({i: _ids(rows[i].generated_token_ids, device) for i in counted},
                              device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=dtype,
                                 device=device)[at[0]]
        logits.index_put_(at, -frequency, accumulate=True)  # once per occurrence
        presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=dtype,
                                device=device)[at[0]]
        logits[at] = logits[at] - presence  # once per token
    return logits


def _seen_ids(row: SamplingRow, device: torch.device) -> torch.Tensor:
    """The prompt's and the generated token ids of `row`."""
    if row.prompt_tensor is None:
        return _ids(row.token_ids, device)
    return torch.cat([row.prompt_tensor, _ids(row.generated_token_ids, device)])


def _ids(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long, device=device)


def _token_positions(ids_by_row: dict[int, torch.Tensor],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors of every id of every row."""
    lengths = torch.tensor([len(ids) for ids in ids_by_row.values()], device=device)
    rows = torch.repeat_interleave(torch.tensor(list(ids_by_row), device=device), lengths)
    return rows, torch.cat(list(ids_by_row.values()))


def apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the fewest of them (most likely first) whose
    probability, renormalized over what top-k kept, covers top_p; the rest become -inf.

    Sorting the whole vocabulary of every row costs ~150 ms for 64 rows of a 49k vocabulary
    here, so the cut is made among each row's TOP_P_CANDIDATES (or top_k, if more) largest
    logits, which a language model's top_p mass nearly always lies in; a row whose candidates
    do not cover its top_p is cut over its whole sorted vocabulary instead."""
    vocab = logits.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    device, dtype = logits.device, logits.dtype
    num_candidates = max([k for k in top_k if k < vocab]
                         + [TOP_P_CANDIDATES if any(p < 1.0 for p in top_p) else 0])
    if num_candidates >= vocab:
        return top_k_top_p_sorted(logits, top_k, top_p)
    values, order = logits.topk(num_candidates, dim=-1)  # (N, C), largest first
    k_rows = torch.tensor(top_k, device=device)[:, None]
    kept = values.masked_fill(torch.arange(num_candidates, device=device)[None, :] >= k_rows,
                              float("-inf"))
    # Probabilities over what top-k kept: that set where the row has a top-k (all of it is
    # among the candidates), the whole vocabulary where it has none.
    total = torch.where(k_rows < vocab, kept.logsumexp(dim=-1, keepdim=True),
                        logits.logsumexp(dim=-1, keepdim=True))
    probs = (kept - total).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    # At least the smallest positive float: top_p 1e-300 rounds to 0, which would drop even
    # the first token (its mass before is 0).
    cutoff = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=dtype,
                          device=device)[:, None].clamp_(min=torch.finfo(dtype).tiny)
    kept = kept.masked_fill(mass_before >= cutoff, float("-inf"))
    cut = torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)
    # A row without a top-k that keeps all of its top_p candidates may need more: the
    # candidates' mass (those it kept) fell short of top_p.
    short = (k_rows[:, 0] == vocab) & (cutoff[:, 0] < float("inf")) & (
        probs.sum(dim=-1) < cutoff[:, 0])
    if bool(short.any()):
        index = short.nonzero()[:, 0]
        cut[index] = top_k_top_p_sorted(logits[index], [top_k[i] for i in index.tolist()],
                                          [top_p[i] for i in index.tolist()])
    untouched = (k_rows[:, 0] == vocab) & (cutoff[:, 0] == float("inf"))
    return torch.where(untouched[:, None], logits, cut)


def top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int],
                        top_p: list[float]) -> torch.Tensor:
    """apply_top_k_top_p over each row's whole sorted vocabulary (top_k: vocab for none)."""
    vocab, device = logits.shape[-1], logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V) each
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= torch.tensor(top_k, device=device)[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 keeps everything, even where rounding pushes the running sum past 1.
    cutoff = [p if p < 1.0 else float("inf") for p in top_p]
    drop |= mass_before >= torch.tensor(cutoff, dtype=logits.dtype, device=device)[:, None] \
        .clamp_(min=torch.finfo(logits.dtype).tiny)  # see apply_top_k_top_p
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked_sorted)

