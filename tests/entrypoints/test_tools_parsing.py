"""Tool choice, tool call parsing and the stream's hold-back, without a server."""

import json

import pytest

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.entrypoints.openai.tools import (
    ToolChoice,
    ToolStream,
    parse_answer,
    streamable_prefix,
    tool_choice,
    tool_constraint,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ToolChoice("auto", parser="hermes")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tools_default_to_auto_and_auto_needs_a_parser():
    assert tool_choice(request(tools=[WEATHER]), "hermes") == AUTO
    with pytest.raises(BadRequestError, match="--enable-auto-tool-choice") as refused:
        tool_choice(request(tools=[WEATHER]), None)
    assert refused.value.param == "tool_choice"
    assert tool_choice(request(), None) == ToolChoice("none")
    assert tool_choice(request(tools=[WEATHER], tool_choice="none"), None).mode == "none"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_or_choices_are_refused_naming_the_field(fields, param):
    with pytest.raises(BadRequestError) as refused:
        tool_choice(request(**fields), "hermes")
    assert refused.value.param == param


def test_required_and_named_constrain_the_output_to_the_calls():
    body = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = tool_constraint(body, tool_choice(body, None)).json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    named = request(tools=[WEATHER, TIME],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_constraint(named, tool_choice(named, None)).json == \
        WEATHER["function"]["parameters"]
    assert tool_constraint(request(tools=[WEATHER]), AUTO) is None


def test_required_calls_hold_no_other_keys_and_their_defs_move_to_the_root():
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    moving = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/place"}},
        "$defs": {"place": place}}}}
    body = request(tools=[moving, TIME], tool_choice="required")
    schema = tool_constraint(body, tool_choice(body, None)).json
    assert schema["$defs"] == {"place": place}
    assert all(c["additionalProperties"] is False for c in schema["items"]["anyOf"])
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in moving["function"]["parameters"]  # the request's own tools untouched
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"place": {"type": "string"}}}}}
    body = request(tools=[moving, clash], tool_choice="required")
    with pytest.raises(BadRequestError, match="\\$defs 'place' twice"):
        tool_constraint(body, tool_choice(body, None))


def test_required_and_named_answers_become_calls():
    required = parse_answer(ToolChoice("required"),
                            '[{"name": "get_time", "parameters": {}}, '
                            '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [c["function"]["name"] for c in required.tool_calls] == ["get_time", "get_weather"]
    assert json.loads(required.tool_calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in required.tool_calls}) == 2
    named = parse_answer(ToolChoice("named", "get_weather"), '{"city": "Rome"}')
    assert named.tool_calls[0]["function"] == {"name": "get_weather",
                                               "arguments": '{"city": "Rome"}'}
    cut = parse_answer(ToolChoice("required"), '[{"name": "get_ti')
    assert (cut.content, cut.tool_calls) == ('[{"name": "get_ti', [])


def test_hermes_calls_after_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    answer = parse_answer(AUTO, text)
    assert answer.content == "Let me check.\n"  # as written, as a stream sends it
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in answer.tool_calls] == [("get_weather", {"city": "Paris"}),
                                            ("get_time", {})]
    only_call = parse_answer(AUTO, '<tool_call>{"name": "get_time"}')  # unclosed at the end
    assert only_call.content is None and only_call.tool_calls[0]["function"]["arguments"] == "{}"
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}'):
        assert parse_answer(AUTO, broken).tool_calls == []
        assert parse_answer(AUTO, broken).content == broken
    assert parse_answer(AUTO, "plain answer").content == "plain answer"


def test_a_stream_holds_back_what_may_start_a_call():
    assert streamable_prefix(AUTO, "Hello <tool") == "Hello "
    assert streamable_prefix(AUTO, "Hello <b>") == "Hello <b>"
    assert streamable_prefix(AUTO, "Hi <tool_call>{") == "Hi "
    assert streamable_prefix(ToolChoice("required"), "[{") == ""
    assert streamable_prefix(ToolChoice("none"), "Hi <tool") == "Hi <tool"


def test_tool_stream_sends_content_then_the_calls_whole():
    stream = ToolStream(AUTO)
    pieces = ["Sure", "Sure <to", "Sure <tool_call>{\"name\": \"get_time\", "]
    sent = "".join(stream.step(0, text, None)[0] for text in pieces)
    final = 'Sure <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls, reason = stream.step(0, final, "stop")
    assert (sent, content, reason) == ("Sure ", "", "tool_calls")
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_time"
    plain = ToolStream(AUTO)
    assert plain.step(1, "a <t", None)[0] == "a "
    assert plain.step(1, "a <td>", "length") == ("<td>", None, "length")


LLAMA = ToolChoice("auto", parser="llama3_json")


def test_llama3_json_calls_are_the_whole_answer():
    answer = parse_answer(LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {}}; '
                                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert answer.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in answer.tool_calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    for text in ('Sure: {"name": "get_time", "parameters": {}}',  # content first: no call
                 '{"name": "get_time", "parameters": {}} and more', '{"name": "get_ti',
                 '{"parameters": {}}', "plain answer"):
        answer = parse_answer(LLAMA, text)
        assert (answer.content, answer.tool_calls) == (text, [])


def test_a_llama3_json_stream_holds_back_only_what_may_be_a_call():
    for text in ("", "  ", "<|pyth", "{", ' {"name"', "<|python_tag|>{"):
        assert streamable_prefix(LLAMA, text) == ""
    assert streamable_prefix(LLAMA, "Hi there") == "Hi there"
    assert streamable_prefix(LLAMA, "<b>bold</b>") == "<b>bold</b>"
    stream = ToolStream(LLAMA)
    assert stream.step(0, '{"name": "get_time", ', None) == ("", None, None)
    content, calls, reason = stream.step(0, '{"name": "get_time", "parameters": {}}', "stop")
    assert (content, reason, calls[0]["function"]["name"]) == ("", "tool_calls", "get_time")


def test_a_stream_sends_the_content_before_a_call_even_when_it_all_comes_at_once():
    text = 'Checking the weather now. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    stream = ToolStream(AUTO)
    assert stream.step(0, "Check", None)[0] == "Check"
    content, calls, reason = stream.step(0, text, "stop")  # the rest in one last step
    assert "Check" + content == "Checking the weather now. " and reason == "tool_calls"
    assert calls[0]["function"]["name"] == "get_time"


def test_parallel_tool_calls_false_keeps_the_first_call_and_deep_nesting_is_text():
    body = request(tools=[WEATHER, TIME], parallel_tool_calls=False)
    single = tool_choice(body, "hermes")
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert [c["function"]["name"] for c in parse_answer(single, two).tool_calls] == ["get_time"]
    deep = '{"name": "get_time", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    for choice, text in ((AUTO, f"<tool_call>{deep}</tool_call>"), (LLAMA, deep),
                         (ToolChoice("required"), f"[{deep}]")):
        assert parse_answer(choice, text).tool_calls == []


def test_a_named_call_cut_short_before_its_answer_is_no_call():
    assert parse_answer(ToolChoice("named", "get_time"), "").tool_calls == []


def test_defs_that_are_not_an_object_are_refused():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": ["x"]}}}
    body = request(tools=[bad], tool_choice="required")
    with pytest.raises(BadRequestError, match="must be an object"):
        tool_constraint(body, tool_choice(body, None))


@pytest.mark.parametrize("ref", ["#", "#/properties/a", "#/definitions/place"])
def test_required_refuses_references_that_would_point_elsewhere(ref):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "next": {"$ref": ref}}}}}
    body = request(tools=[tool], tool_choice="required")
    with pytest.raises(BadRequestError, match="must point into"):
        tool_constraint(body, tool_choice(body, None))
    named = request(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert tool_constraint(named, tool_choice(named, None)) is not None  # the root: fine
