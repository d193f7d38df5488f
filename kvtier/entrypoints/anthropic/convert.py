"""A Messages request as a chat request, and a chat answer as content blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.entrypoints.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from kvtier.entrypoints.openai.chat_fields import chat_request_of, renamed
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.entrypoints.openai.tools import ParsedAnswer

if TYPE_CHECKING:  # the router reads requests with this module, and must not import torch
    from kvtier.entrypoints.openai.context import ServerContext

Message = dict[str, Any]
# vLLM's sampling extras a Messages request may carry; the chat request checks them.
_PASSED_ON = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
              "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias",
              "include_stop_str_in_output", "skip_special_tokens", "priority", "cache_salt",
              "kv_transfer_params", "allowed_token_ids", "bad_words", "structured_outputs",
              "chat_template_kwargs")
# Anthropic's fields for what runs on its side (code containers, MCP servers, context
# editing): each would change the answer, and none runs here.
_UNSUPPORTED = ("container", "mcp_servers", "context_management")
_THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")
# The first words of the system block Claude Code sends with a per-request hash.
_BILLING_HEADER = "x-anthropic-billing-header"
# Blocks of an earlier answer that are not shown to the model again.
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
# Chat request fields as a Messages request names them, for the 400s of the chat path.
_RENAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice",
            "response_format": "output_config.format",
            "continue_final_message": "messages", "add_generation_prompt": "messages"}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that answers `body` (a count_tokens body: its prompt only); 400 naming
    the field for what it may not hold."""
    extra = body.model_extra or {}
    for name in _UNSUPPORTED:
        if extra.get(name) is not None:
            raise BadRequestError(f"{name} is not supported by this server", param=name,
                                  code="unsupported_parameter")
    if not body.messages:  # a system prompt alone is no conversation
        raise BadRequestError("messages must hold at least one message", param="messages",
                              code="invalid_value")
    messages = _system(body.system) + chat_messages(body.messages)
    # A final assistant message with text is the start of the answer, which goes on from it;
    # one with nothing (no text, no tool_use) asks for no start: it is left out.
    last, ends_with_answer = messages[-1], body.messages[-1].get("role") == "assistant"
    goes_on = ends_with_answer and bool(last.get("content"))
    if ends_with_answer and not (goes_on or last.get("tool_calls")):
        messages.pop()
    choice = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": _tools(body.tools),
        "tool_choice": choice, "continue_final_message": goes_on,
        "add_generation_prompt": not goes_on,
        "parallel_tool_calls": False if (body.tool_choice or {}).get(
            "disable_parallel_tool_use") is True else None}
    fields.update({name: extra[name] for name in _PASSED_ON if name in extra})
    thinking, given = _thinking(body.thinking), fields.get("chat_template_kwargs")
    if thinking is not None and (given is None or isinstance(given, dict)):  # else a 400
        fields["chat_template_kwargs"] = {"enable_thinking": thinking, **(given or {})}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences,
                      response_format=_response_format(body.output_config))
    return chat_request_of(fields, _RENAMES)


def messages_param(param: str | None) -> str | None:
    """A chat request's field (in a 400 from the chat path) as a Messages request names it."""
    return renamed(param, _RENAMES)


def _system(system: str | list[dict[str, Any]] | None) -> list[Message]:
    """The system prompt as the first message. Claude Code's billing block (a hash that
    changes with every request) is left out: at the head of the prompt it would leave no
    prefix in common between two turns, nor with what the router hashes."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    parts = [_text_part(block, f"system[{i}]") for i, block in enumerate(system)]
    return [{"role": "system", "content": [part for part in parts
                                           if not part["text"].startswith(_BILLING_HEADER)]}]


def chat_messages(messages: list[dict[str, Any]]) -> list[Message]:
    """The conversation as chat messages: a user message's tool results become tool messages
    (in their order, around its text), an assistant message's tool_use blocks its calls."""
    chat: list[Message] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise BadRequestError(f"{where}.role must be \"user\" or \"assistant\" (the system "
                                  "prompt goes in system)", param=f"{where}.role",
                                  code="invalid_value")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise BadRequestError(f"{where}.content must be text or a list of content blocks",
                                  param=f"{where}.content", code="invalid_value")
        elif role == "user":
            chat.extend(_user_turn(content, where))
        else:
            chat.append(_assistant_turn(content, where))
    return chat


def _user_turn(blocks: list[Any], where: str) -> list[Message]:
    messages: list[Message] = []
    parts: list[dict[str, str]] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        if _kind(block) == "tool_result":
            if parts:
                messages.append({"role": "user", "content": parts})
                parts = []
            messages.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                             "content": _result_text(block.get("content", ""), at)})
        else:
            parts.append(_text_part(block, at))
    if parts or not messages:
        messages.append({"role": "user", "content": parts})
    return messages


def _assistant_turn(blocks: list[Any], where: str) -> Message:
    parts, calls = [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _kind(block)
        if kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise BadRequestError(f"{at}.input must be an object", param=f"{at}.input",
                                      code="invalid_value")
            calls.append({"id": _string(block, "id", at), "type": "function", "function": {
                "name": _string(block, "name", at),
                "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind not in _SKIPPED_BLOCKS:
            parts.append(_text_part(block, at))
    message: Message = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None


def _text_part(block: Any, where: str) -> dict[str, str]:
    kind = _kind(block)
    if kind != "text":
        raise BadRequestError(f"{where} has type {kind!r}; this server reads text, tool_use, "
                              "tool_result and thinking blocks only", param=where,
                              code="unsupported_parameter")
    return {"type": "text", "text": _string(block, "text", where, empty=True)}


def _result_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_part(block, f"{where}.content[{i}]")["text"]
                       for i, block in enumerate(content))
    raise BadRequestError(f"{where}.content must be text or a list of text blocks",
                          param=f"{where}.content", code="invalid_value")


def _string(block: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise BadRequestError(f"{where}.{key} must be a {'' if empty else 'non-empty '}string",
                              param=f"{where}.{key}", code="invalid_value")
    return value


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools as chat functions; Anthropic's server tools (web search, code execution,
    ...) run on its side, so they are refused."""
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom":
            raise BadRequestError(f"tools[{index}] has type {kind!r}; this server runs client "
                                  "tools only ({\"name\", \"description\", \"input_schema\"})",
                                  param=f"tools[{index}]", code="unsupported_parameter")
        function = {"name": _string(tool, "name", f"tools[{index}]"),
                    "parameters": tool.get("input_schema")}
        if "description" in tool:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise BadRequestError('tool_choice {"type": "tool"} needs the tool\'s name',
                                  param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": name}}
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in modes:
        raise BadRequestError('tool_choice.type must be "auto", "any", "tool" or "none"',
                              param="tool_choice.type", code="invalid_value")
    return modes[kind]


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` as the chat API's response_format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise BadRequestError('output_config.format must be {"type": "json_schema", "schema": '
                              '{...}}', param="output_config.format", code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """Whether the request asks for thinking (None: it does not say), as the chat template's
    `enable_thinking` (Qwen3's switch; templates without one ignore it). A budget is not
    enforced: the output's max_tokens bounds thinking and answer together."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        raise BadRequestError(f"thinking.type must be one of {', '.join(_THINKING_TYPES)}",
                              param="thinking.type", code="invalid_value")
    return kind != "disabled"


@dataclass(frozen=True)
class Answer:
    """An output as the Messages API tells it: content blocks and why it ended."""

    content: list[ContentBlock]
    stop_reason: StopReason
    stop_sequence: str | None


def answer(reasoning: str | None, text: str | None, parsed: ParsedAnswer,
           engine_reason: str | None, stop: int | str | None) -> Answer:
    """The blocks of an output whose thinking is `reasoning` and whose text after it is `text`,
    which the chat path `parsed` into content and tool calls; `engine_reason` and `stop` are
    the engine's finish and stop reasons."""
    blocks: list[ContentBlock] = [ThinkingBlock(thinking=reasoning)] if reasoning else []
    uses = tool_uses(parsed.tool_calls)
    content = parsed.content if uses else text
    if content or not (blocks or uses):
        blocks.append(TextBlock(text=content or ""))
    blocks.extend(uses)
    return Answer(blocks, *stop_reason(bool(uses), engine_reason, stop))


def tool_uses(calls: list[dict[str, Any]]) -> list[ToolUseBlock]:
    """Chat tool calls as tool_use blocks; none when a call's arguments are not a JSON object
    (Anthropic's `input` must be one): the answer is then its text, as written."""
    uses = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, RecursionError):
            return []
        if not isinstance(arguments, dict):
            return []
        uses.append(ToolUseBlock(name=call["function"]["name"], input=arguments))
    return uses


def stop_reason(has_tool_uses: bool, engine_reason: str | None,
                stop: int | str | None) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence): a stop string the output met is a stop sequence; a stop
    token id ends the turn as EOS does."""
    if engine_reason == "length":
        return "max_tokens", None
    if has_tool_uses:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(ctx: ServerContext, num_input: int, num_output: int, num_cached: int) -> MessagesUsage:
    """Cached input tokens only with --enable-prompt-tokens-details (else none), as in chat:
    they tell a client how much of its input other requests had sent."""
    cached = num_cached if ctx.enable_prompt_tokens_details else 0
    return MessagesUsage(input_tokens=num_input - cached, output_tokens=num_output,
                         cache_read_input_tokens=cached)
