"""Request and response bodies of Anthropic's Messages API (Anthropic's names and shapes).

As in the OpenAI API (../openai/protocol.py), unknown request fields are kept aside and nulls
are fields left out; those that would change the answer and are not implemented are refused in
convert.py.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from kvtier.entrypoints.openai.protocol import APIRequest


class CountTokensRequest(APIRequest):
    """What a prompt is made of: POST /v1/messages/count_tokens takes only this."""

    model: str | None = None
    # Each {"role": "user" | "assistant", "content": text or content blocks}.
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    # Client tools: {"name", "description", "input_schema"}.
    tools: list[dict[str, Any]] | None = None
    # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}.
    tool_choice: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens"} or {"type": "disabled"}.
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    # {"format": {"type": "json_schema", "schema"}, "effort"}: the format holds the output to
    # the schema; the effort is taken and not acted on.
    output_config: dict[str, Any] | None = None
    # Sampling as Anthropic's older API and vLLM take it (Anthropic's SDK sends them as
    # extra_body now).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str
    citations: list[Any] | None = None


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    # Anthropic signs its thinking so that it can be sent back; kvtier's needs no signature.
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=lambda: new_id("toolu"))
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    """Input tokens as Anthropic splits them: read from a cache, and the rest (`input_tokens`);
    kvtier caches every prompt it computes, so it counts no separate cache writes."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage
    # vLLM's: a P/D producer's transfer parameters (left out of the JSON when None).
    kv_transfer_params: dict[str, Any] | None = Field(default=None,
                                                      exclude_if=lambda value: value is None)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
