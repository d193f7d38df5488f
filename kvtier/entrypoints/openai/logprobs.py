"""Engine logprobs ({token_id: logprob} per generated token) in the two OpenAI shapes."""

from __future__ import annotations

from typing import Any

from kvtier.entrypoints.openai.protocol import (
    ChatLogProbs,
    ChatTokenLogProb,
    CompletionLogProbs,
    TopLogProb,
)

_UNKNOWN_LOGPROB = -9999.0


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def completion_logprobs(tokenizer: Any, token_ids: list[int],
                        logprobs: list[dict[int, float]], num_top: int,
                        text_offset: int) -> CompletionLogProbs:
    """text_offset: where the first token's text starts in the choice's text."""
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.get(token_id))
        # The sampled token and the top `num_top` (up to num_top + 1 entries), as OpenAI's
        # completions API has them.
        top = _top(entry, num_top)
        if token_id in entry and all(t != token_id for t, _ in top):
            top.append((token_id, entry[token_id]))
        result.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]],
                  num_top: int) -> ChatLogProbs:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        # A sampled token outside the returned top-k has no logprob to report; OpenAI writes
        # -9999 for such tokens (JSON has no -inf).
        logprob = entry.get(token_id, _UNKNOWN_LOGPROB)
        top = [TopLogProb(token=token_text(tokenizer, t), logprob=lp,
                          bytes=list(token_text(tokenizer, t).encode()))
               for t, lp in _top(entry, num_top)]
        content.append(ChatTokenLogProb(token=text, logprob=logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogProbs(content=content)
