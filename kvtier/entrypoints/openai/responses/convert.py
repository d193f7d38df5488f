"""A Responses request as a chat request, and a chat answer as output items.

The conversation is kept as chat messages (role, content, tool_calls, tool_call_id): that is
what the chat template renders, and what the store keeps for `previous_response_id`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvtier.entrypoints.openai.chat_fields import chat_request_of, renamed
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.entrypoints.openai.responses.protocol import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    ResponsesRequest,
)

Message = dict[str, Any]
# Content part types that carry text; images, files and audio a text model cannot read.
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")
# vLLM's sampling extras a Responses request may carry; the chat request checks them.
_PASSED_ON = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias",
              "include_stop_str_in_output", "skip_special_tokens", "priority", "cache_salt",
              "kv_transfer_params", "allowed_token_ids", "bad_words", "structured_outputs",
              "chat_template_kwargs")
# Stateful fields of OpenAI's API this server does not keep, and what to do instead.
_STATEFUL_FIELDS = {"conversation": "send the conversation's items as input, or go on from a "
                                    "stored response with previous_response_id",
                    "prompt": "send the prompt's text as instructions and input"}
# Fields a client may nest (JSON schemas, items), how deep at most: a response echoes some of
# them, and deeper JSON would fail its serialization after the answer was computed.
_NESTED_FIELDS = ("input", "tools", "tool_choice", "text", "reasoning", "structured_outputs",
                  "chat_template_kwargs")
MAX_NESTING = 64
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat request fields as a Responses request names them, for the 400s of the chat path.
_RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format"}
# What `include` may ask for: the logprobs of the output text; reasoning text is always in
# the reasoning items, so asking for it changes nothing.
_INCLUDABLE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")


def check_request(body: ResponsesRequest) -> None:
    """400s, naming the field, for what a Responses request may not hold here."""
    if body.background:
        raise BadRequestError("background responses are not supported; leave background "
                              "false and stream the response instead", param="background",
                              code="unsupported_parameter")
    extra = body.model_extra or {}
    for name, instead in _STATEFUL_FIELDS.items():
        if extra.get(name) is not None:
            raise BadRequestError(f"{name} is not supported; {instead}", param=name,
                                  code="unsupported_parameter")
    for name in _NESTED_FIELDS:
        if _too_deep(getattr(body, name, None) if name in type(body).model_fields
                     else extra.get(name)):
            raise BadRequestError(f"{name} nests deeper than {MAX_NESTING} levels",
                                  param=name, code="invalid_value")
    if body.input is None or body.input == [] or body.input == "":
        raise BadRequestError("input must not be empty", param="input", code="invalid_value")
    for value in body.include or ():
        if value not in _INCLUDABLE:
            raise BadRequestError(f"include value {value!r} is not supported; supported: "
                                  f"{', '.join(_INCLUDABLE)}", param="include",
                                  code="invalid_value")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
            for k, v in metadata.items()):
        raise BadRequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at "
                              f"most {MAX_METADATA_KEY_CHARS} characters and values of at most "
                              f"{MAX_METADATA_VALUE_CHARS}", param="metadata",
                              code="invalid_value")


def _too_deep(value: Any) -> bool:
    """Whether parsed JSON nests more than MAX_NESTING objects and arrays (walked without
    recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_NESTING:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists input items: each with an id, a type and a status,
    a message's content as a list of parts."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        normalized = {**item, "type": kind}
        if kind == "message":
            content = item["content"]
            part = "output_text" if item["role"] == "assistant" else "input_text"
            normalized["content"] = [{"type": part, "text": content}] \
                if isinstance(content, str) else content
        normalized.setdefault("status", "completed")
        normalized.setdefault("id", new_id("msg" if kind == "message" else "item"))
        items.append(normalized)
    return items


def input_messages(value: str | list[dict[str, Any]]) -> list[Message]:
    """The request's input items as chat messages; 400 naming the item for a bad one."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[Message] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _output_text(item.get("output"), where)})
        elif kind != "reasoning":  # earlier thinking is not shown to the model again
            raise BadRequestError(f"{where} has type {kind!r}; supported: message, "
                                  "function_call, function_call_output, reasoning",
                                  param=where, code="invalid_value")
    return messages


def with_instructions(instructions: str | None, messages: list[Message]) -> list[Message]:
    """The messages the template renders: the instructions as the first, a system message."""
    if instructions is None:
        return list(messages)
    return [{"role": "system", "content": instructions}, *messages]


def _message(item: dict[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequestError(f"{where}.role must be one of {', '.join(_ROLES)}",
                              param=f"{where}.role", code="invalid_value")
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(_part_text(part, f"{where}.content[{i}]")
                          for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise BadRequestError(f"{where}.content must be text or a list of content parts",
                              param=f"{where}.content", code="invalid_value")
    # Chat templates know "system"; "developer" is OpenAI's newer name for it.
    return {"role": "system" if role == "developer" else role, "content": content}


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise BadRequestError(f"{where} has type {kind!r}; this server reads text parts only "
                              f"({', '.join(_TEXT_PARTS)})", param=where,
                              code="unsupported_parameter")
    text = part.get("text", part.get("refusal"))
    if not isinstance(text, str):
        raise BadRequestError(f"{where} needs its text, a string", param=where,
                              code="invalid_value")
    return text


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise BadRequestError(f"{where}.arguments must be JSON text", param=f"{where}.arguments",
                              code="invalid_value")
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_part_text(part, f"{where}.output[{i}]") for i, part in enumerate(output))
    raise BadRequestError(f"{where}.output must be text or a list of text parts",
                          param=f"{where}.output", code="invalid_value")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{where} needs {key}, a non-empty string", param=f"{where}.{key}",
                              code="invalid_value")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat API's shape; other tool types (built-in tools OpenAI runs
    itself) are refused."""
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequestError(f"tools[{index}] has type {kind!r}; this server runs "
                                  "function tools only ({\"type\": \"function\", \"name\", "
                                  "\"parameters\"})", param=f"tools[{index}]",
                                  code="unsupported_parameter")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat API's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                             "json_schema"):
        raise BadRequestError('text.format must be {"type": "text"}, {"type": "json_object"} '
                              'or {"type": "json_schema", "name", "schema"}',
                              param="text.format", code="invalid_value")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest, messages: list[Message]) -> ChatCompletionRequest:
    """The chat request that answers `body` over the whole conversation `messages`."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "temperature": body.temperature,
        "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text)}
    if LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs)
    extra = body.model_extra or {}
    fields.update({name: extra[name] for name in _PASSED_ON if name in extra})
    return chat_request_of(fields, _RENAMES)


def responses_param(param: str | None) -> str | None:
    """A chat request's field (in a 400 from the chat path) as the Responses request names
    it."""
    return renamed(param, _RENAMES)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def assistant_message(content: str | None, calls: list[dict[str, Any]]) -> Message:
    """An answer as the chat message the next turn's template renders; `calls` are
    parse_answer's, already in the chat API's tool call shape."""
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def json_size(value: Any) -> int:
    """Bytes a value takes as JSON: what the store counts against its bound."""
    return len(json.dumps(value, ensure_ascii=False).encode())
