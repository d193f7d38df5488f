"""A streamed response as OpenAI's typed server-sent events.

Each event is `event: TYPE` plus its JSON, numbered by `sequence_number`. The order:
response.created, response.in_progress; per output item output_item.added, its content part
added, text deltas, text done, part done, output_item.done; then response.completed (or
.incomplete when max_output_tokens cut the answer, .failed on an error). Function calls go out
whole at the end, as in the chat stream. No `[DONE]` line ends the stream (OpenAI sends none).
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.entrypoints.openai.errors import APIError
from kvtier.entrypoints.openai.protocol import ChatTokenLogProb
from kvtier.entrypoints.openai.responses.convert import new_id
from kvtier.entrypoints.openai.responses.items import function_call_item
from kvtier.entrypoints.openai.responses.protocol import (
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
)


class ResponseEvents:
    """The events of one response, in order; each method returns the lines to send now."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.items: list[OutputItem] = []
        self._sequence = 0
        self._open: MessageItem | ReasoningItem | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _response_event(self, kind: str) -> str:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    @property
    def writing_text(self) -> bool:
        """Whether a message item is open (text deltas go to it)."""
        return isinstance(self._open, MessageItem)

    def start(self) -> list[str]:
        return [self._response_event("response.created"),
                self._response_event("response.in_progress")]

    def reasoning(self, delta: str) -> list[str]:
        lines = []
        if not isinstance(self._open, ReasoningItem):
            lines += self._close()
            lines += self._open_item(ReasoningItem(id=new_id("rs"), status="in_progress"),
                                     ReasoningText(text=""))
        item = self._open
        item.content[0].text += delta
        return lines + [self._event("response.reasoning_text.delta", item_id=item.id,
                                    output_index=len(self.items) - 1, content_index=0,
                                    delta=delta)]

    def text(self, delta: str, logprobs: list[ChatTokenLogProb]) -> list[str]:
        lines = []
        if not isinstance(self._open, MessageItem):
            lines += self._close()
            lines += self._open_item(MessageItem(id=new_id("msg"), status="in_progress"),
                                     OutputText(text=""))
        item = self._open
        part = item.content[0]
        part.text += delta
        part.logprobs.extend(logprobs)
        return lines + [self._event("response.output_text.delta", item_id=item.id,
                                    output_index=len(self.items) - 1, content_index=0,
                                    delta=delta, logprobs=_dumped(logprobs))]

    def calls(self, calls: list[dict[str, Any]]) -> list[str]:
        """Each chat tool call as a function_call item, whole."""
        lines = self._close()
        for call in calls:
            item = function_call_item(call)
            index = len(self.items)
            self.items.append(item)
            lines.append(self._event("response.output_item.added", output_index=index,
                                     item={**item.model_dump(mode="json"),
                                           "status": "in_progress", "arguments": ""}))
            lines.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=index, delta=item.arguments))
            lines.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=index, name=item.name,
                                     arguments=item.arguments))
            lines.append(self._event("response.output_item.done", output_index=index,
                                     item=item.model_dump(mode="json")))
        return lines

    def close(self, cut: bool) -> list[str]:
        """The done events of the item being written (`cut`: by max_output_tokens); an answer
        of no text and no calls is one empty message, as unstreamed."""
        lines = [] if self.items else self._open_item(
            MessageItem(id=new_id("msg"), status="in_progress"), OutputText(text=""))
        return lines + self._close(cut)

    def finish(self, response: ResponseObject) -> list[str]:
        """The last event; `response` is the finished one (its output these items)."""
        self.response = response
        kind = "response.incomplete" if response.status == "incomplete" \
            else "response.completed"
        return [self._response_event(kind)]

    def fail(self, error: APIError) -> list[str]:
        self.response = self.response.model_copy(update={
            "status": "failed", "output": self.items,
            "error": ResponseError(code=error.code or error.error_type, message=error.message)})
        return [self._response_event("response.failed")]

    def _open_item(self, item: MessageItem | ReasoningItem,
                   part: OutputText | ReasoningText) -> list[str]:
        index = len(self.items)
        self.items.append(item)
        self._open = item
        lines = [self._event("response.output_item.added", output_index=index,
                             item=item.model_dump(mode="json"))]
        item.content.append(part)
        return lines + [self._event("response.content_part.added", item_id=item.id,
                                    output_index=index, content_index=0,
                                    part=part.model_dump(mode="json"))]

    def _close(self, cut: bool = False) -> list[str]:
        """The done events of the item being written, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item.content[0]
        item.status = "incomplete" if cut else "completed"
        common = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, MessageItem):
            done = self._event("response.output_text.done", text=part.text,
                               logprobs=_dumped(part.logprobs), **common)
        else:
            done = self._event("response.reasoning_text.done", text=part.text, **common)
        return [done,
                self._event("response.content_part.done", part=part.model_dump(mode="json"),
                            **common),
                self._event("response.output_item.done", output_index=index,
                            item=item.model_dump(mode="json"))]


def _dumped(logprobs: list[ChatTokenLogProb]) -> list[dict[str, Any]]:
    return [entry.model_dump(mode="json") for entry in logprobs]
