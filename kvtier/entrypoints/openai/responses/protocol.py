"""Request and response bodies of the Responses API (OpenAI's names and shapes).

Unknown request fields are kept aside and ignored, and nulls are fields left out, as in the
chat API (see ../protocol.py). Output items are typed; the response object carries every field
OpenAI's does, null where kvtier has nothing to say.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from kvtier.entrypoints.openai.protocol import APIRequest, ChatTokenLogProb

# OpenAI's limits on `metadata`: pairs, key and value lengths.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class ResponsesRequest(APIRequest):
    model: str | None = None
    # Text (one user message) or a list of items: messages, function_call,
    # function_call_output (reasoning items are taken and left out of the prompt).
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: StrictBool = False
    store: StrictBool = True
    background: StrictBool = False
    # Function tools: {"type": "function", "name", "description", "parameters", "strict"}.
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "name": ...}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}.
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # "disabled": a conversation longer than the context is a 400; "auto": its oldest turns
    # are left out until it fits.
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[str] | None = None
    user: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogProb] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Input tokens computed (not found in a cache) and kept in the prefix cache.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "in_progress"
    completed_at: int | None = None
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    # vLLM's: a P/D producer's transfer parameters (left out of the JSON when None).
    kv_transfer_params: dict[str, Any] | None = Field(default=None,
                                                      exclude_if=lambda value: value is None)
