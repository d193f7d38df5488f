"""Prompts as token ids, checked against the vocabulary and the context length.

Tokenizing here (not in the engine) lets every refusal name the request field, and hands the
engine ids it can trust: an out-of-vocabulary id would otherwise fail a whole batched step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvtier.common.token_ids import all_ints, first_outside
from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from kvtier.models.chat import render_chat
from kvtier.models.errors import ChatTemplateError, UnsupportedContentError

# JSON may escape half of a UTF-16 pair ("\ud800"); no tokenizer or UTF-8 answer can carry it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


# The characters of text a message counts for besides its own (its role, the template's
# markup around it) when deciding whether to render off the event loop.
PER_MESSAGE_CHARS = 32


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def check_text(value: Any, param: str | None = None) -> None:
    """400 naming the first string in a request (fields, list items, dict keys and values)
    that is not valid Unicode."""
    if isinstance(value, str):
        if _LONE_SURROGATE.search(value):
            raise BadRequestError(f"{param} is not valid Unicode: it holds a lone surrogate "
                                  "(an unpaired \\ud800-\\udfff escape)", param=param,
                                  code="invalid_value")
    elif isinstance(value, BaseModel):
        for name, item in value:  # declared fields, then extra ones
            check_text(item, name if param is None else f"{param}.{name}")
    elif isinstance(value, list) and not all_ints(value):
        for index, item in enumerate(value):
            check_text(item, f"{param}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, f"{param}.{key}")


def prompt_chars(prompt: Any) -> int:
    """Characters of text in a completion prompt (token ids count nothing)."""
    if isinstance(prompt, str):
        return len(prompt)
    return 0 if all_ints(prompt) else sum(len(item) for item in prompt if isinstance(item, str))


def message_chars(messages: list[ChatMessage], tools: Any = None) -> int:
    """Characters of text a chat renders: the messages' content and other fields (tool calls),
    and the tools (the template prints them too); a message costs as much as a short text
    however empty (250k empty messages render for seconds)."""
    total = json_chars(tools)
    for message in messages:
        content = message.content
        parts = [content] if isinstance(content, str) else [p.text for p in content or ()]
        total += sum(len(part) for part in parts if part) + json_chars(message.model_extra) \
            + PER_MESSAGE_CHARS
    return total


def json_chars(value: Any) -> int:
    """Characters of the strings in parsed JSON, walked without recursion (it may nest
    deeply)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def completion_prompts(ctx: ServerContext, prompt: Any,
                       add_special_tokens: bool = True) -> list[Prompt]:
    """OpenAI's four prompt forms: text, texts, token ids, lists of token ids; texts with the
    tokenizer's special tokens (a BOS) unless `add_special_tokens` is false."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all_ints(prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise BadRequestError("prompt must not be empty", param="prompt", code="invalid_value")
    return [_one_prompt(ctx, item, f"prompt[{i}]" if len(items) > 1 else "prompt",
                        add_special_tokens) for i, item in enumerate(items)]


def _one_prompt(ctx: ServerContext, item: str | list[int], param: str,
                add_special_tokens: bool) -> Prompt:
    if isinstance(item, str):
        token_ids = _tokenize(ctx, item, param, add_special_tokens)
        prompt = Prompt(item, token_ids)
    else:
        check_in_vocabulary(ctx, item, param)
        prompt = Prompt(None, list(item))
    if not prompt.token_ids:
        raise BadRequestError(f"{param} must not be empty", param=param, code="invalid_value")
    return prompt


def chat_prompt(ctx: ServerContext, request: ChatCompletionRequest) -> Prompt:
    if not request.messages:
        raise BadRequestError("messages must not be empty", param="messages",
                              code="invalid_value")
    if ctx.tokenizer is None:
        raise BadRequestError("this model has no tokenizer, so it cannot take chat messages",
                              param="messages", code="invalid_value")
    messages = [_message_dict(m, i) for i, m in enumerate(request.messages)]
    try:
        text = render_chat(ctx.tokenizer, messages,
                           add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=request.continue_final_message,
                           chat_template_kwargs=request.chat_template_kwargs,
                           tools=request.tools)
    except ChatTemplateError as exc:
        code = "unsupported_parameter" if isinstance(exc, UnsupportedContentError) \
            else "invalid_value"
        raise BadRequestError(str(exc), param=exc.param or "messages", code=code) from exc
    # The template writes the special tokens itself; add_special_tokens adds the
    # tokenizer's on top, as vLLM does.
    token_ids = _tokenize(ctx, text, "messages", request.add_special_tokens)
    return Prompt(text, token_ids)


def _message_dict(message: Any, index: int) -> dict[str, Any]:
    """The message as the template takes it (render_chat joins text parts); extra fields only
    when they are strings, and an assistant's tool_calls (checked: 400 for a malformed one)."""
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type == "text" and part.text is None:
                # Else the template's check calls the part's type unsupported, which it is not.
                at = f"messages[{index}].content[{j}].text"
                raise BadRequestError(f"{at} is missing: a text part needs its text",
                                      param=at, code="missing_required_parameter")
        content = [part.model_dump() for part in content]
    extra = {k: v for k, v in (message.model_extra or {}).items() if isinstance(v, str)}
    tool_calls = (message.model_extra or {}).get("tool_calls")
    if tool_calls is not None:
        _check_tool_calls(tool_calls, f"messages[{index}].tool_calls")
        extra["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return {**extra, "role": message.role, "content": content}


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    """OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}], the
    arguments JSON text (as vLLM, also an object, or none); a template would print anything
    else as it came, or fail on it."""
    if not isinstance(tool_calls, list):
        raise BadRequestError(f"{where} must be an array of tool calls", param=where,
                              code="invalid_type")
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        problem = None
        if not isinstance(function, dict):
            problem = "must be an object with a \"function\" object"
        elif not isinstance(function.get("name"), str):
            problem = "needs function.name, a string"
        elif not isinstance(function.get("arguments", "{}"), (str, dict, type(None))):
            problem = "has function.arguments that are neither a JSON string nor an object"
        elif call.get("type", "function") != "function":
            problem = f"has type {call.get('type')!r}; only \"function\" calls exist"
        elif not isinstance(call.get("id", ""), str):
            problem = "has an id that is not a string"
        if problem is not None:
            raise BadRequestError(f"{at} {problem}", param=at, code="invalid_value")


def _template_tool_call(call: Any) -> Any:
    """A tool call as chat templates print it: its arguments (JSON text in OpenAI's messages)
    as an object where they parse, as vLLM hands them to templates (none: {})."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and function.get("arguments") is None:
        return {**call, "function": {**function, "arguments": {}}}
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _tokenize(ctx: ServerContext, text: str, param: str, add_special_tokens: bool) -> list[int]:
    if ctx.tokenizer is None:
        raise BadRequestError("this model has no tokenizer; send token ids instead of text",
                              param=param, code="invalid_value")
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_in_vocabulary(ctx: ServerContext, token_ids: list[int], param: str) -> None:
    vocab_size = ctx.vocab_size
    bad = first_outside(token_ids, vocab_size)
    if bad is not None:
        raise BadRequestError(f"{param} holds token id {bad}, outside the vocabulary "
                              f"[0, {vocab_size})", param=param, code="invalid_value")


def truncate(ctx: ServerContext, prompt: Prompt, request: SamplingFields,
             max_tokens: int | None) -> Prompt:
    """vLLM's truncate_prompt_tokens N: the prompt's first N tokens, or its last with
    truncation_side "left" (-1: as many as leave room for max_tokens, or one token)."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return prompt
    if keep == -1:
        keep = ctx.max_model_len - (max_tokens or 1)
    if keep < 1:
        raise BadRequestError(f"truncate_prompt_tokens must be >= 1 or -1 (and leave a token "
                              f"for the prompt after max_tokens), got "
                              f"{request.truncate_prompt_tokens}",
                              param="truncate_prompt_tokens", code="invalid_value")
    if keep >= len(prompt.token_ids):
        return prompt
    ids = prompt.token_ids
    # The text no longer matches the ids: echo decodes them instead.
    return Prompt(None, ids[-keep:] if request.truncation_side == "left" else ids[:keep])


def check_context(ctx: ServerContext, prompt: Prompt, max_tokens: int | None,
                  prompt_param: str, max_tokens_param: str) -> None:
    """The prompt must leave room for at least one token, and for max_tokens if given."""
    num_prompt = len(prompt.token_ids)
    limit = ctx.max_model_len
    if num_prompt >= limit:
        raise BadRequestError(
            f"this model's maximum context length is {limit} tokens, but the {prompt_param} "
            f"has {num_prompt} tokens; shorten it to at most {limit - 1}",
            param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise BadRequestError(
            f"{max_tokens_param}={max_tokens} is too large: the prompt has {num_prompt} tokens "
            f"and the context holds {limit}; ask for at most {limit - num_prompt}",
            param=max_tokens_param, code="context_length_exceeded")
