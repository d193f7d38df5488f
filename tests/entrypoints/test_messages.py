"""Anthropic's Messages API through a real server (tiny random Llama, byte tokenizer, a chat
template that prints tools, calls and tool results): each answer is the one the chat API gives
for the same conversation, and bodies, events and errors are read by Anthropic's own SDK."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from .server_process import ServerProcess
from .tool_template import template_file

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": WEATHER["input_schema"]}}
EVENTS = TypeAdapter(RawMessageStreamEvent)
# Anthropic's SDK no longer has sampling arguments; servers still take them in the body.
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model[0], "--served-model-name", MODEL,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", "384",
                         "--chat-template", template_file(tmp_path_factory))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none")


def message(server, expect: int = 200, **fields) -> dict:
    response = server.post("/v1/messages", {"model": MODEL, "max_tokens": 12,
                                            "temperature": 0.0, **fields})
    assert response.status_code == expect, response.text
    return response.json()


def chat(server, messages: list[dict], max_tokens: int = 12, **fields) -> dict:
    response = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        **fields})
    assert response.status_code == 200, response.text
    return response.json()


def text_of(body: dict) -> str:
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


def test_a_text_message_is_answered_as_the_chat_api_answers_it(server):
    body = message(server, messages=[{"role": "user", "content": "Hello there"}])
    Message.model_validate(body)
    expected = chat(server, [{"role": "user", "content": "Hello there"}])
    choice = expected["choices"][0]
    assert text_of(body) == choice["message"]["content"]
    assert body["id"].startswith("msg_") and body["type"] == "message"
    assert body["role"] == "assistant" and body["model"] == MODEL
    assert body["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[
        choice["finish_reason"]]
    usage = body["usage"]
    assert usage["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == expected["usage"]["completion_tokens"]
    # Cached tokens are told only with --enable-prompt-tokens-details.
    assert usage["cache_read_input_tokens"] == 0


def test_system_blocks_and_turns_render_as_chat_messages(server, client):
    answer = client.messages.create(
        model=MODEL, max_tokens=12, **GREEDY,
        system=[{"type": "text", "text": "Answer in French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                               {"type": "text", "text": " you"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hey"}]},
                  {"role": "user", "content": "More"}])
    expected = chat(server, [
        {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": " you"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hey"}]},
        {"role": "user", "content": "More"}])
    assert answer.content[0].text == expected["choices"][0]["message"]["content"]
    assert answer.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_a_final_assistant_message_is_the_start_of_the_answer(server):
    conversation = [{"role": "user", "content": "Name a city"},
                    {"role": "assistant", "content": "The city is"}]
    body = message(server, messages=conversation)
    expected = chat(server, conversation, continue_final_message=True,
                    add_generation_prompt=False)
    assert text_of(body) == expected["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


def test_a_stream_sends_typed_events_that_add_up_to_the_message(server, client):
    fields = {"model": MODEL, "max_tokens": 12,
              "messages": [{"role": "user", "content": "Stream me"}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60.0,
                      json={**fields, "temperature": 0.0, "stream": True}) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == kinds
    for event in events:
        if event["type"] != "ping":  # the SDK reads and drops pings
            EVENTS.validate_python(event)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"}
    unstreamed = message(server, **{k: v for k, v in fields.items() if k != "model"})
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") \
        == text_of(unstreamed)
    assert events[-2]["delta"]["stop_reason"] == unstreamed["stop_reason"]
    assert events[-2]["usage"] == unstreamed["usage"]
    # The SDK puts the events together into the same message.
    with client.messages.stream(**fields, **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.usage.output_tokens) == (
        text_of(unstreamed), unstreamed["stop_reason"], unstreamed["usage"]["output_tokens"])


def test_a_forced_tool_gives_a_tool_use_block_and_its_result_goes_on(server, client):
    used = client.messages.create(
        model=MODEL, max_tokens=60, **GREEDY, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}])
    (block,) = used.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["city"] in ("Oslo", "Rome") and used.stop_reason == "tool_use"
    answer = client.messages.create(
        model=MODEL, max_tokens=12, **GREEDY, tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": [block.model_dump()]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny"},
                      {"type": "text", "text": "And tomorrow?"}]}])
    expected = chat(server, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": block.id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(block.input)}}]},
        {"role": "tool", "tool_call_id": block.id, "content": "Sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}],
        tools=[CHAT_WEATHER], tool_choice="none")
    assert answer.content[0].text == expected["choices"][0]["message"]["content"]
    assert answer.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_a_streamed_tool_use_is_one_block_with_its_input(server, client):
    fields = {"model": MODEL, "max_tokens": 60, **GREEDY, "tools": [WEATHER],
              "tool_choice": {"type": "tool", "name": "get_weather"},
              "messages": [{"role": "user", "content": "Weather?"}]}
    with client.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert "input_json" in kinds and kinds[-1] == "message_stop"
    unstreamed = client.messages.create(**fields)
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [(b.type, b.name, b.input) for b in unstreamed.content]
    assert final.stop_reason == unstreamed.stop_reason == "tool_use"


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    plain = message(server, max_tokens=24, ignore_eos=True,
                    messages=[{"role": "user", "content": "Go on"}])
    text = text_of(plain)
    sequence = next(text[i:i + 2] for i in range(1, len(text) - 1)
                    if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    stopped = message(server, max_tokens=24, ignore_eos=True, stop_sequences=[sequence],
                      messages=[{"role": "user", "content": "Go on"}])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", sequence)
    assert text_of(stopped) == text[:text.index(sequence)]


def test_count_tokens_counts_the_prompt_the_message_would_have(server, client):
    fields = {"system": "Be brief.", "tools": [WEATHER], "tool_choice": {"type": "none"},
              "messages": [{"role": "user", "content": "How many?"}]}
    counted = client.messages.count_tokens(model=MODEL, **fields)
    assert counted.input_tokens == message(server, **fields)["usage"]["input_tokens"]


def count(client, **fields) -> int:
    return client.messages.count_tokens(model=MODEL, **fields).input_tokens


def test_what_changes_nothing_for_the_model_leaves_the_prompt_as_it_was(client):
    hi = [{"role": "user", "content": "hi"}]
    brief = {"type": "text", "text": "Be brief."}
    # Claude Code's billing block: a per-request hash, no content for the model.
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1a2b3;"}
    assert count(client, system=[billing, brief], messages=hi) == \
        count(client, system=[brief], messages=hi)
    # An empty final assistant message asks for no start of the answer.
    for empty in ("", []):
        assert count(client, messages=[*hi, {"role": "assistant", "content": empty}]) == \
            count(client, messages=hi)


def test_a_tool_result_s_text_blocks_stay_lines_apart(server):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    body = message(server, tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Sunny"},
                                                  {"type": "text", "text": "Warm"}]}]}])
    expected = chat(server, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny\nWarm"}],
        tools=[CHAT_WEATHER], tool_choice="none")
    assert body["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert text_of(body) == expected["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("fields", "named"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"system": "x", "messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"seed": "lucky"}, "seed"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers"),
])
def test_bad_requests_are_anthropic_400s_naming_the_field(server, fields, named):
    # A null is a field left out: max_tokens null is a missing max_tokens.
    error = message(server, 400, **{"messages": [{"role": "user", "content": "x"}], **fields})
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[])


def test_the_key_is_taken_as_anthropic_sends_it_and_cached_tokens_are_told(tiny_model):
    keyed = ServerProcess(tiny_model[0], "--served-model-name", MODEL, "--num-device-blocks",
                          "64", "--block-size", "16", "--api-key", "secret",
                          "--enable-prompt-tokens-details")
    fields = {"model": MODEL, "max_tokens": 4,
              "messages": [{"role": "user", "content": "A prompt of a few blocks " * 4}]}
    try:
        refused = httpx.post(f"{keyed.url}/v1/messages", json=fields, timeout=30.0)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        client = anthropic.Anthropic(base_url=keyed.url, api_key="secret")
        first = client.messages.create(**fields)
        again = client.messages.create(**fields)
        total = first.usage.input_tokens + first.usage.cache_read_input_tokens
        assert again.usage.cache_read_input_tokens > 0
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
        # A stream's first event already tells what the cache held.
        with client.messages.stream(**fields) as stream:
            start = next(event for event in stream if event.type == "message_start")
            final = stream.get_final_message()
        assert start.message.usage.cache_read_input_tokens == \
            final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
        assert httpx.post(f"{keyed.url}/v1/messages", json=fields, timeout=30.0,
                          headers={"Authorization": "Bearer secret"}).status_code == 200
    finally:
        keyed.stop()


def test_an_output_format_holds_the_text_to_the_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    body = message(server, max_tokens=80, messages=[{"role": "user", "content": "JSON"}],
                   output_config={"format": {"type": "json_schema", "schema": schema},
                                  "effort": "low"})
    assert isinstance(json.loads(text_of(body))["ok"], bool)


def test_an_output_format_that_does_not_compile_is_a_400_naming_it(server):
    error = message(server, 400, messages=[{"role": "user", "content": "JSON"}],
                    output_config={"format": {"type": "json_schema",
                                              "schema": {"type": "nonsense"}}})
    assert error["error"]["message"].startswith("output_config.format: ")
