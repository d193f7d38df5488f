"""A finished answer as the response's output items, usage and status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.protocol import ChatTokenLogProb
from kvtier.entrypoints.openai.responses.convert import new_id
from kvtier.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)


@dataclass(frozen=True)
class Answer:
    """What the chat path made of one output: thinking, text and calls (chat's shape)."""

    reasoning: str | None
    content: str | None
    calls: list[dict[str, Any]]
    finish_reason: str | None


def output_items(answer: Answer, logprobs: list[ChatTokenLogProb] | None) -> list[OutputItem]:
    """Reasoning, then the message, then one item per function call; an answer of none of
    these is one empty message."""
    items: list[OutputItem] = []
    if answer.reasoning:
        items.append(ReasoningItem(id=new_id("rs"),
                                   content=[ReasoningText(text=answer.reasoning)]))
    if answer.content or not (items or answer.calls):
        items.append(MessageItem(id=new_id("msg"), content=[
            OutputText(text=answer.content or "", logprobs=logprobs or [])]))
    items.extend(function_call_item(call) for call in answer.calls)
    return items


def function_call_item(call: dict[str, Any]) -> FunctionCallItem:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as an output item."""
    return FunctionCallItem(id=new_id("fc"), call_id=call["id"], name=call["function"]["name"],
                            arguments=call["function"]["arguments"])


def num_reasoning_tokens(ctx: ServerContext, token_ids: Sequence[int], closed: bool) -> int:
    """Output tokens up to and including `</think>` (all of them while it has not come)."""
    if ctx.thinking_token_ids is None or closed or ctx.reasoning_parser is None:
        return 0
    end = ctx.thinking_token_ids[1]
    if end in token_ids:
        return list(token_ids).index(end) + 1
    start = ctx.thinking_token_ids[0]
    # qwen3 thinks only when the output opens the thinking itself.
    thinking = ctx.reasoning_parser != "qwen3" or (bool(token_ids) and token_ids[0] == start)
    return len(token_ids) if thinking else 0


def usage(ctx: ServerContext, num_input: int, num_output: int, num_cached: int,
          num_reasoning: int) -> ResponseUsage:
    """Cached input tokens only with --enable-prompt-tokens-details (else 0), as in chat:
    they tell a client how much of its input other requests had sent."""
    details = InputTokensDetails()
    if ctx.enable_prompt_tokens_details:
        details = InputTokensDetails(cached_tokens=num_cached,
                                     cache_write_tokens=num_input - num_cached)
    return ResponseUsage(input_tokens=num_input, input_tokens_details=details,
                         output_tokens=num_output,
                         output_tokens_details=OutputTokensDetails(
                             reasoning_tokens=num_reasoning),
                         total_tokens=num_input + num_output)


def finish(response: ResponseObject, items: list[OutputItem], finish_reason: str | None,
           response_usage: ResponseUsage) -> ResponseObject:
    """The response once its answer is whole: "incomplete" when max_output_tokens cut it."""
    cut = finish_reason == "length"
    if cut:
        for item in items:
            item.status = "incomplete"
    return response.model_copy(update={
        "status": "incomplete" if cut else "completed", "output": items,
        "usage": response_usage, "completed_at": int(time.time()),
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})
