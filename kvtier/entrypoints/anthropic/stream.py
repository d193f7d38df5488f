"""A streamed message as Anthropic's server-sent events:

    message_start, ping (once the prompt is computed: its usage tells the cached tokens),
    per content block: content_block_start, content_block_delta ..., content_block_stop,
    message_delta (stop reason and usage), message_stop

Thinking and text stream as they come; tool_use blocks go out whole at the end (their input
in one input_json_delta), as the chat path streams tool calls. A failure after the start is an
`error` event, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from kvtier.engine.outputs import RequestOutput
from kvtier.entrypoints.anthropic.convert import stop_reason, tool_uses, usage
from kvtier.entrypoints.anthropic.protocol import (
    ContentBlock,
    MessageObject,
    MessagesUsage,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from kvtier.entrypoints.openai.chat import ChatPlan
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import anthropic_error_event
from kvtier.entrypoints.openai.generation import Outputs, output_error, to_api_error
from kvtier.entrypoints.openai.reasoning import ReasoningStream
from kvtier.entrypoints.openai.streaming import DeltaTracker
from kvtier.entrypoints.openai.tools import ToolStream


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def stream_events(ctx: ServerContext, plan: ChatPlan, outputs: Outputs,
                        shell: MessageObject) -> AsyncIterator[str]:
    events = MessageEvents(shell)
    steps = _StreamSteps(ctx, plan, events)
    try:
        async for output in outputs:
            error = output_error(output)
            if error is not None:
                yield anthropic_error_event(error)
                return
            for line in steps.lines(output):
                yield line
    except Exception as exc:  # the stream has started: report in-band, then end it
        yield anthropic_error_event(to_api_error(exc))


class MessageEvents:
    """The events of one message, its content blocks numbered as they open."""

    def __init__(self, shell: MessageObject) -> None:
        self.shell = shell
        self.num_blocks = 0
        self.open: str | None = None  # the type of the block being written

    def start(self, message_usage: MessagesUsage) -> list[str]:
        """The first events, once the prompt is computed: its usage says what the cache
        held, as Anthropic's does."""
        message = self.shell.model_copy(update={"usage": message_usage})
        return [event("message_start", {"message": message.model_dump(mode="json")}),
                event("ping", {})]

    def thinking(self, text: str) -> list[str]:
        return self._write(ThinkingBlock(thinking=""), {"type": "thinking_delta",
                                                        "thinking": text})

    def text(self, text: str) -> list[str]:
        return self._write(TextBlock(text=""), {"type": "text_delta", "text": text})

    def tool_use(self, use: ToolUseBlock) -> list[str]:
        lines = self._open(use.model_copy(update={"input": {}}))
        lines += self._delta({"type": "input_json_delta",
                              "partial_json": json.dumps(use.input, ensure_ascii=False)})
        return lines + self._close()

    def finish(self, reason: StopReason, sequence: str | None,
               message_usage: MessagesUsage) -> list[str]:
        """The end: an answer of nothing is one empty text block, as unstreamed."""
        lines = self._close() if self.num_blocks else self._open(TextBlock(text=""))
        return lines + self._close() + [
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": message_usage.model_dump()}),
            event("message_stop", {})]

    def _write(self, block: ContentBlock, delta: dict[str, Any]) -> list[str]:
        lines = [] if self.open == block.type else self._open(block)
        return lines + self._delta(delta)

    def _open(self, block: ContentBlock) -> list[str]:
        lines = self._close()
        lines.append(event("content_block_start", {
            "index": self.num_blocks, "content_block": block.model_dump(mode="json",
                                                                        exclude_none=True)}))
        self.num_blocks += 1
        self.open = block.type
        return lines

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        return [event("content_block_delta", {"index": self.num_blocks - 1, "delta": delta})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.num_blocks - 1})]


class _StreamSteps:
    """Each engine output of a streamed message as the events it adds."""

    def __init__(self, ctx: ServerContext, plan: ChatPlan, events: MessageEvents) -> None:
        self.ctx, self.plan, self.events = ctx, plan, events
        self.tracker, self.tools = DeltaTracker(), ToolStream(plan.tools)
        self.reasoning = ReasoningStream(ctx.reasoning_parser, plan.closed)
        self.num_text_sent = 0  # characters of the text after the thinking
        self.started = False  # message_start sent

    def lines(self, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        num_prompt = len(self.plan.prompt.token_ids)
        started = [] if self.started else self.events.start(
            usage(self.ctx, num_prompt, 0, output.num_cached_tokens))
        self.started = True
        delta = self.tracker.advance(0, completion)
        if delta is None:
            return started
        done = delta.finish_reason is not None
        thought, text = self.reasoning.step(0, completion.text, done)
        content, calls, _ = self.tools.step(0, text, delta.finish_reason)
        uses = tool_uses(calls or [])
        if calls and not uses:  # calls Anthropic cannot carry: the answer is its text
            content = text[self.num_text_sent:]
        lines = started + (self.events.thinking(thought) if thought else [])
        if content:
            lines += self.events.text(content)
            self.num_text_sent += len(content)
        if not done:
            return lines
        for use in uses:
            lines += self.events.tool_use(use)
        reason, sequence = stop_reason(bool(uses), completion.finish_reason,
                                       completion.stop_reason)
        return lines + self.events.finish(reason, sequence, usage(
            self.ctx, num_prompt, len(completion.token_ids), output.num_cached_tokens))
