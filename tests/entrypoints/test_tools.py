"""Tool calling through a real server (tiny random Llama, byte tokenizer, a chat template
that prints tools and calls): "required" and named functions, whose output the grammar holds
to the calls' JSON, and "auto" with the hermes parser, whose text a one-item choice forces here (a
random model writes no calls of its own)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .server_process import ServerProcess
from .tool_template import template_file

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
FORCED = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
          '</tool_call>')


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model[0], "--served-model-name", MODEL,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", "512",
                         "--chat-template", template_file(tmp_path_factory),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def ask(client, max_tokens: int = 60, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=max_tokens,
        temperature=0.0, tools=TOOLS, **fields)


def test_required_gives_a_call_of_a_given_tool(client):
    # The JSON may hold whitespace between its tokens (a random model writes plenty).
    choice = ask(client, max_tokens=240, tool_choice="required",
                 parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.id
    arguments = json.loads(call.function.arguments)
    assert arguments == {} if call.function.name == "get_time" else \
        arguments["city"] in ("Oslo", "Rome")


def test_a_named_function_is_called_with_its_parameters(client):
    choice = ask(client, tool_choice={"type": "function",
                                      "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason for a named function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")


def test_auto_finds_hermes_calls_in_the_text(client):
    choice = ask(client, max_tokens=120,
                 extra_body={"structured_outputs": {"choice": [FORCED]}}).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Sure. ")
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Rome"})


def test_a_streamed_auto_answer_sends_the_content_then_the_call(client):
    chunks = list(ask(client, max_tokens=120, stream=True,
                      extra_body={"structured_outputs": {"choice": [FORCED]}}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Sure." and "<tool" not in content
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Nothing is sent while a possible call is held back: no empty chunks.
    deltas = [(c.choices[0].delta, c.choices[0].finish_reason) for c in chunks if c.choices]
    assert all(d.content or d.tool_calls or d.role or reason for d, reason in deltas)


def test_the_template_sees_the_tools_and_earlier_calls(server):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = httpx.post(f"{server.url}/tokenize", timeout=30.0, json={
        "model": MODEL, "messages": messages, "tools": TOOLS}).json()
    text = httpx.post(f"{server.url}/detokenize", timeout=30.0, json={
        "model": MODEL, "tokens": body["tokens"]}).json()["prompt"]
    assert text == ("TOOLS:get_weather,get_time\nuser:Weather?\n"
                    "assistant:CALL get_weather(Oslo)\ntool:sunny\nassistant:")


@pytest.mark.parametrize("tool_calls, param, fragment", [
    ({"id": "c"}, "messages[1].tool_calls", "must be an array"),
    ([{"id": "c", "type": "function"}], "messages[1].tool_calls[0]", '"function" object'),
    ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0]", "function.name"),
    ([{"function": {"name": "f", "arguments": ["Oslo"]}}], "messages[1].tool_calls[0]",
     "neither a JSON string nor an object"),
    ([{"type": "code", "function": {"name": "f", "arguments": "{}"}}],
     "messages[1].tool_calls[0]", "only \"function\" calls"),
])
def test_a_malformed_earlier_tool_call_is_a_400(server, tool_calls, param, fragment):
    """As OpenAI: not passed to the template as it came, nor dropped."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    for path in ("/v1/chat/completions", "/tokenize"):
        response = httpx.post(f"{server.url}{path}", timeout=30.0, json={
            "model": MODEL, "messages": messages, "max_tokens": 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"]


def test_no_tools_means_plain_content(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0.0, tools=TOOLS, tool_choice="none")
    assert response.choices[0].message.tool_calls in (None, [])
    assert response.choices[0].finish_reason == "length"


def test_a_tool_choice_with_a_response_format_is_refused(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30.0, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"
