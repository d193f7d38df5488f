"""Tool calling in chat completions, as OpenAI's API and vLLM's server do it.

`tools` go to the chat template (as the `tools` variable). `tool_choice` decides the rest:
"none" leaves the answer as text; "required" and a named function constrain the output
(structured outputs) to the calls' JSON, so the calls always parse; "auto" lets the model
choose, and the server's tool call parser (`--enable-auto-tool-choice --tool-call-parser
hermes | llama3_json`) finds the calls in its text. Calls come back as `message.tool_calls`,
with finish reason "tool_calls" for "auto" and "required" (OpenAI's "stop" for a named
function).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.sampling_params import StructuredOutputsParams

_HERMES_START = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# Llama 3's tag before a call (a special token: gone from the text unless it is kept).
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools ask of the answer. mode: "none", "auto", "required" or
    "named" (then `name` is the function's); `parser` reads "auto" answers; `single`: one call
    at most (parallel_tool_calls false)."""

    mode: str
    name: str | None = None
    parser: str | None = None
    single: bool = False

    @property
    def constrains_output(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    # Each {"id", "type": "function", "function": {"name", "arguments"}} (arguments: JSON text).
    tool_calls: list[dict[str, Any]]


def tool_choice(request: ChatCompletionRequest, parser: str | None) -> ToolChoice:
    """The request's tool choice, checked against its tools and the server's parser (None:
    auto tool choice off); 400 naming the field for a bad one."""
    tools = check_tools(request.tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none")
    if not tools:
        raise BadRequestError("tool_choice needs tools", param="tool_choice",
                              code="invalid_value")
    if choice == "auto":
        if parser is None:
            raise BadRequestError('"auto" tool choice needs a server started with '
                                  "--enable-auto-tool-choice and --tool-call-parser; ask for "
                                  'tool_choice "required", a named function or "none"',
                                  param="tool_choice", code="invalid_value")
        return ToolChoice("auto", parser=parser, single=request.parallel_tool_calls is False)
    if choice == "required":
        return ToolChoice("required")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(name, str):
        raise BadRequestError('tool_choice must be "none", "auto", "required" or {"type": '
                              '"function", "function": {"name": ...}}', param="tool_choice",
                              code="invalid_value")
    if name not in tools:
        raise BadRequestError(f"tool_choice names function {name!r}, which is not in tools",
                              param="tool_choice", code="invalid_value")
    return ToolChoice("named", name)


def tool_constraint(request: ChatCompletionRequest,
                    choice: ToolChoice) -> StructuredOutputsParams | None:
    """The structured output that holds the answer to the calls' JSON ("required": a list of
    {"name", "parameters"}; a named function: its parameters), or None."""
    if not choice.constrains_output:
        return None
    tools = check_tools(request.tools)
    if choice.mode == "named":
        return StructuredOutputsParams(json=_parameters(tools[choice.name]))
    # Each tool's "$defs" move to the root, where its "#/$defs/..." references now point.
    definitions: dict[str, Any] = {}
    calls = []
    for name, function in tools.items():
        parameters = dict(_parameters(function))
        _check_local_refs(name, parameters)
        defs = parameters.pop("$defs", None) or {}
        if not isinstance(defs, dict):
            raise BadRequestError(f"tools: $defs in the parameters of {name!r} must be an "
                                  "object", param="tools", code="invalid_value")
        for key, value in defs.items():
            if definitions.setdefault(key, value) != value:
                raise BadRequestError(f"tools define $defs {key!r} twice, differently; give "
                                      "each definition one name", param="tools",
                                      code="invalid_value")
        calls.append({"type": "object", "properties": {"name": {"enum": [name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return StructuredOutputsParams(json=schema)


def parse_answer(choice: ToolChoice, text: str) -> ParsedAnswer:
    """The generated text as content and tool calls."""
    if choice.mode == "named":
        # (No text: cut short before the answer began, e.g. while thinking.)
        return ParsedAnswer("", [_call(choice.name, text)]) if text else ParsedAnswer(text, [])
    if choice.mode == "required":
        try:
            return ParsedAnswer("", [_call(call["name"], json.dumps(call["parameters"],
                                                                    ensure_ascii=False))
                                     for call in json.loads(text)])
        except (ValueError, KeyError, TypeError, RecursionError):  # cut short: left as text
            return ParsedAnswer(text, [])
    if choice.mode == "auto":
        answer = _parse_llama3_json(text) if choice.parser == "llama3_json" \
            else _parse_hermes(text)
        if choice.single and len(answer.tool_calls) > 1:
            return ParsedAnswer(answer.content, answer.tool_calls[:1])
        return answer
    return ParsedAnswer(text, [])


def finish_reason(choice: ToolChoice, answer: ParsedAnswer, engine_reason: str | None) -> str:
    if answer.tool_calls and (choice.mode == "auto" or choice.mode == "required"
                              and engine_reason == "stop"):
        return "tool_calls"
    return engine_reason or "stop"


def streamable_prefix(choice: ToolChoice, text: str) -> str:
    """How much of the text so far a stream may send as content: none of a constrained
    answer (its calls go out whole at the end), and under "auto" what comes before a tool
    call or before what may be the start of one."""
    if choice.constrains_output:
        return ""
    if choice.mode != "auto":
        return text
    if choice.parser == "llama3_json":
        # A call is the whole answer: held until it is clear the answer is none.
        body = text.lstrip()
        return "" if not body or body.startswith("{") or _PYTHON_TAG.startswith(body[:14]) \
            else text
    start = text.find(_HERMES_START)
    if start >= 0:
        return text[:start]
    for keep in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
        if _HERMES_START.startswith(text[-keep:]):
            return text[:-keep]
    return text


def _parse_hermes(text: str) -> ParsedAnswer:
    """Hermes-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after
    any content. Text whose calls do not parse stays content."""
    start = text.find(_HERMES_START)
    if start < 0:
        return ParsedAnswer(text, [])
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return ParsedAnswer(text, [])
        if not isinstance(name, str):
            return ParsedAnswer(text, [])
        calls.append(_call(name, arguments if isinstance(arguments, str)
                           else json.dumps(arguments, ensure_ascii=False)))
    # As written (a stream sends it so): no call's whitespace is taken off.
    return ParsedAnswer(text[:start] or None, calls)


def _parse_llama3_json(text: str) -> ParsedAnswer:
    """Llama 3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (or
    "arguments"), after an optional `<|python_tag|>`, several separated by ";". Anything else
    is content."""
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while body.startswith("{", position):
        try:
            call, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError):
            return ParsedAnswer(text, [])
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str):
            return ParsedAnswer(text, [])
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(_call(name, arguments if isinstance(arguments, str)
                           else json.dumps(arguments, ensure_ascii=False)))
        position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
    if not calls or position < len(body):
        return ParsedAnswer(text, [])
    return ParsedAnswer(None, calls)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function of each tool; 400 for a malformed one."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            raise BadRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": {...}}}", param="tools",
                                  code="invalid_value")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequestError(f"tools[{i}].function.parameters must be a JSON schema "
                                  "object", param="tools", code="invalid_value")
        functions[function["name"]] = function
    return functions


def _check_local_refs(name: str, parameters: dict[str, Any]) -> None:
    """In the calls' array schema a tool's parameters are no longer the root: a reference into
    them other than through $defs (which move to the root) would point elsewhere."""
    stack: list[Any] = [parameters]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith("#/$defs/"):
                raise BadRequestError(f"tools: the parameters of {name!r} refer to {ref!r}; "
                                      'with tool_choice "required" references must point into '
                                      '"$defs" ("#/$defs/NAME")', param="tools",
                                      code="invalid_value")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


class ToolStream:
    """A streamed answer's content and tool calls, per choice: content goes out as it comes
    except what may be a tool call; the calls go out whole with the last chunk."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._sent: dict[int, int] = {}  # choice index -> characters of content sent

    def step(self, index: int, text: str, engine_reason: str | None
             ) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """(content to send now, the tool calls once finished, the finish reason) for a choice
        whose whole text so far is `text`."""
        sent = self._sent.get(index, 0)
        if engine_reason is None:
            ready = streamable_prefix(self.choice, text)
            self._sent[index] = max(sent, len(ready))
            return ready[sent:], None, None
        answer = parse_answer(self.choice, text)
        self._sent[index] = len(text)
        reason = finish_reason(self.choice, answer, engine_reason)
        if not answer.tool_calls:
            return text[sent:], None, reason
        calls = [{"index": i, **call} for i, call in enumerate(answer.tool_calls)]
        # The content before the calls not sent yet (the last steps may come at once).
        return (answer.content or "")[sent:], calls, reason
