"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra fields.

Only types live here; limits are checked where requests become SamplingParams (sampling.py),
so each rule has one home. Unknown request fields are kept aside and ignored, as OpenAI and
vLLM do: clients send fields (user, metadata, store) that change nothing here; those known to
change the output are refused there (sampling.py). A null is a field left out (OpenAI's fields
are nullable, and clients send null for what they do not set). Booleans are strict: "yes" or 1
for `stream` is refused rather than guessed at.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)


class APIRequest(BaseModel):
    """A request body: unknown fields kept aside, nulls left out (see above)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {name: value for name, value in data.items() if value is not None}
        return data


class StreamOptions(APIRequest):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(APIRequest):
    """Fields both generation endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Adds prompt_token_ids / token_ids to the response (vLLM's return_token_ids).
    return_token_ids: StrictBool = False
    # vLLM's: the logprobs of each prompt token and the top k at its position, as
    # `prompt_logprobs` in the response (the whole prompt is computed for them).
    prompt_logprobs: int | None = None
    # vLLM's: only these token ids may be generated; these words never are.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep this many prompt tokens (-1: as many as leave room for the output), the
    # last ones with truncation_side "left", else the first.
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema", ...}, or vLLM's
    # structured_outputs (json, regex, choice, grammar, json_object and their options).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


# A prompt: text, token ids, or a batch of either. Tried in this order, the first that fits
# wins: a 4M-id prompt validates in ~0.06 s instead of ~0.5 s, every branch tried. Ids are
# strict: "12" stays text and true is no token id.
PromptField = Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]],
                        Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: the tokenizer's own special tokens (a BOS) around a text prompt.
    add_special_tokens: StrictBool = True
    # vLLM's: logprob tokens named "token_id:N" (a token that is no whole UTF-8 text).
    return_tokens_as_token_ids: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_item(cls, prompt: Any) -> Any:
        """A list of mixed kinds is one error, found in one pass: validated item by item it
        made an error per item of each branch (2M for a 1M-id prompt, 11 s)."""
        if isinstance(prompt, list) and prompt:
            kind = type(prompt[0])
            if kind not in (int, str, list) or any(type(item) is not kind for item in prompt):
                raise ValueError("a list prompt must hold only token ids, only strings or "
                                 "only lists of token ids")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    # As CompletionRequest's.
    return_tokens_as_token_ids: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's: false leaves a reasoning model's thinking out of the response.
    include_reasoning: StrictBool = True
    add_generation_prompt: StrictBool = True
    # vLLM's: the last message is left open for the model to go on with (no generation
    # prompt after it), and extra variables for the chat template (e.g. enable_thinking).
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tokenizer's special tokens added on top of those the template writes.
    add_special_tokens: StrictBool = False


def _when_set() -> Any:
    """A response field left out of the JSON while None: an extra only some requests ask
    for. Every other field is always there, null or not, as in OpenAI's responses."""
    return Field(default=None, exclude_if=_is_none)


def _is_none(value: Any) -> bool:
    return value is None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = _when_set()


class CompletionLogProbs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`: {token id: this} per prompt token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token, the first null (nothing precedes it to predict it).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = _when_set()
    prompt_token_ids: list[int] | None = _when_set()
    token_ids: list[int] | None = _when_set()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = _when_set()


class TopLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogProb(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogProb] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # Each {"id", "type": "function", "function": {"name", "arguments"}}.
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # A reasoning model's thinking (--reasoning-parser), as vLLM names it.
    reasoning: str | None = _when_set()


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _when_set()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _when_set()
    prompt_logprobs: PromptLogprobs | None = _when_set()
    kv_transfer_params: dict[str, Any] | None = _when_set()


class DeltaMessage(BaseModel):
    role: str | None = _when_set()
    content: str | None = _when_set()
    # Whole calls, each with its "index" among the choice's calls.
    tool_calls: list[dict[str, Any]] | None = _when_set()
    reasoning: str | None = _when_set()


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _when_set()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = _when_set()
    prompt_logprobs: PromptLogprobs | None = _when_set()


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _when_set()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvtier"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
