"""Engine logprobs ({token_id: Logprob} per token) in the two OpenAI shapes."""

from __future__ import annotations

from typing import Any

from kvtier.entrypoints.openai.protocol import (
    ChatLogProbs,
    ChatTokenLogProb,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    TopLogProb,
)
from kvtier.logprobs import Logprob

_UNKNOWN_LOGPROB = -9999.0


def _decode(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _text(tokenizer: Any, token_id: int, entry: dict[int, Logprob] | None) -> str:
    """The token's text: as the engine named it in its logprobs, else decoded here."""
    named = entry.get(token_id) if entry else None
    if named is not None and named.decoded_token is not None:
        return named.decoded_token
    return _decode(tokenizer, token_id)


def _by_id(token_id: int) -> str:
    """The token named by its id (vLLM's return_tokens_as_token_ids, for tokens that are no
    whole UTF-8 text)."""
    return f"token_id:{token_id}"


def _shown(tokenizer: Any, token_id: int, entry: dict[int, Logprob] | None,
           as_token_id: bool) -> str:
    """How the API names the token: its text, or by its id."""
    return _by_id(token_id) if as_token_id else _text(tokenizer, token_id, entry)


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:num_top]


def _finite(logprob: float) -> float:
    """-inf (a token a grammar or mask ruled out), which JSON lacks, as -9999, as vLLM does."""
    return max(logprob, _UNKNOWN_LOGPROB)


def completion_logprobs(tokenizer: Any, token_ids: list[int],
                        logprobs: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int, as_token_ids: bool = False) -> CompletionLogProbs:
    """text_offset: where the first token's text starts in the choice's text (the offsets
    count the tokens' text, also when they are named by id)."""
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs):
        text = _text(tokenizer, token_id, entry)
        result.tokens.append(_by_id(token_id) if as_token_ids else text)
        result.text_offset.append(offset)
        offset += len(text)
        if entry is None:  # an echoed prompt's first token: nothing before it predicts it
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(entry[token_id].logprob) if token_id in entry
                                     else None)
        # The token itself and the top `num_top` (up to num_top + 1 entries), as OpenAI's
        # completions API has them.
        top = _top(entry, num_top)
        if token_id in entry and all(t != token_id for t, _ in top):
            top.append((token_id, entry[token_id]))
        result.top_logprobs.append({_shown(tokenizer, t, entry, as_token_ids):
                                    _finite(lp.logprob) for t, lp in top})
    return result


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, as_token_ids: bool = False) -> ChatLogProbs:
    """`as_token_ids`: tokens named "token_id:N", their bytes those of that name (vLLM's)."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = _shown(tokenizer, token_id, entry, as_token_ids)
        # A sampled token outside the returned top-k has no logprob to report; OpenAI writes
        # -9999 for such tokens (JSON has no -inf).
        logprob = _finite(entry[token_id].logprob) if token_id in entry else _UNKNOWN_LOGPROB
        top = []
        for top_id, top_logprob in _top(entry, num_top):
            top_text = _shown(tokenizer, top_id, entry, as_token_ids)
            top.append(TopLogProb(token=top_text, logprob=_finite(top_logprob.logprob),
                                  bytes=list(top_text.encode())))
        content.append(ChatTokenLogProb(token=text, logprob=logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogProbs(content=content)


def prompt_logprobs_body(prompt_logprobs: list[dict[int, Logprob] | None] | None,
                         ) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM's `prompt_logprobs` field (-inf, which JSON
    lacks, as -9999)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {
        token_id: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                                decoded_token=lp.decoded_token)
        for token_id, lp in entry.items()} for entry in prompt_logprobs]
