"""OpenAI's Responses API through a real server (tiny random Llama, byte tokenizer, a chat
template that prints tools, calls and tool results): each answer is the one the chat API gives
for the same conversation, bodies and events parse as OpenAI's SDK types, and stored responses
carry a conversation on by id."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from .server_process import ServerProcess
from .tool_template import template_file

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseItem)


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
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def respond(server, expect: int = 200, **fields) -> dict:
    response = server.post("/v1/responses", {"model": MODEL, "temperature": 0.0,
                                             "max_output_tokens": 12, **fields})
    assert response.status_code == expect, response.text
    return response.json()


def chat(server, messages: list[dict], max_tokens: int = 12, **fields) -> dict:
    response = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        **fields})
    assert response.status_code == 200, response.text
    return response.json()


def output_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_text_input_is_answered_as_the_chat_api_answers_it(server):
    body = respond(server, input="Hello there")
    Response.model_validate(body)  # OpenAI's own type, strictly
    expected = chat(server, [{"role": "user", "content": "Hello there"}])
    assert output_text(body) == expected["choices"][0]["message"]["content"]
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == ("incomplete" if expected["choices"][0]["finish_reason"] == "length"
                              else "completed")
    usage = body["usage"]
    assert usage["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == expected["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_instructions_and_message_items_render_as_chat_messages(server):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hi"},
                          {"type": "input_text", "text": " you"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hey"}]},
             {"role": "user", "content": "More"}]
    body = respond(server, instructions="Answer in French.", input=items)
    expected = chat(server, [{"role": "system", "content": "Answer in French."},
                             {"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi you"},
                             {"role": "assistant", "content": "Hey"},
                             {"role": "user", "content": "More"}])
    assert output_text(body) == expected["choices"][0]["message"]["content"]
    assert body["instructions"] == "Answer in French."


def test_previous_response_id_goes_on_with_the_stored_conversation(server, client):
    first = client.responses.create(model=MODEL, input="One", instructions="Old rules.",
                                    max_output_tokens=10, temperature=0.0)
    second = client.responses.create(model=MODEL, input="Two", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0.0)
    # The earlier instructions do not carry over; its answer does.
    expected = chat(server, [{"role": "user", "content": "One"},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "Two"}], max_tokens=10)
    assert second.output_text == expected["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_a_stream_sends_typed_events_that_add_up_to_the_response(server):
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60.0, json={
            "model": MODEL, "input": "Stream me", "max_output_tokens": 12,
            "temperature": 0.0, "stream": True}) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == kinds and "data: [DONE]" not in lines
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{final['status']}"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    unstreamed = respond(server, input="Stream me")
    assert deltas == output_text(final) == output_text(unstreamed)
    (item,) = final["output"]
    assert all(e["item_id"] == item["id"] for e in events if "item_id" in e)
    # Kept as it streamed.
    assert httpx.get(f"{server.url}/v1/responses/{final['id']}").json() == final


def test_max_output_tokens_leaves_the_response_incomplete(server):
    body = respond(server, input="Tell me a long story", max_output_tokens=2, ignore_eos=True)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["output_tokens"] == 2


def test_stored_responses_are_retrieved_listed_and_deleted(server, client):
    items = [{"role": "user", "content": f"Item {i}"} for i in range(3)]
    made = client.responses.create(model=MODEL, input=items, max_output_tokens=4,
                                   metadata={"topic": "tests"})
    got = client.responses.retrieve(made.id)
    assert (got.id, got.output_text, got.metadata) == (made.id, made.output_text,
                                                       {"topic": "tests"})
    listed = httpx.get(f"{server.url}/v1/responses/{made.id}/input_items",
                       params={"order": "asc", "limit": 2}).json()
    for item in listed["data"]:  # as OpenAI lists them: typed, content as parts
        ITEMS.validate_python(item)
    assert [d["content"] for d in listed["data"]] == [
        [{"type": "input_text", "text": f"Item {i}"}] for i in range(2)]
    assert listed["has_more"] and listed["first_id"] == listed["data"][0]["id"]
    rest = client.responses.input_items.list(made.id, order="asc", after=listed["last_id"])
    assert [d.content[0].text for d in rest.data] == ["Item 2"] and not rest.has_more
    deleted = httpx.delete(f"{server.url}/v1/responses/{made.id}")
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    assert httpx.get(f"{server.url}/v1/responses/{made.id}").status_code == 404
    # As OpenAI answers it: a 400 naming the field (clients then send the whole history).
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", previous_response_id=made.id)
    assert refused.value.body["code"] == "previous_response_not_found"


def test_store_false_keeps_nothing(server):
    body = respond(server, input="Forget me", store=False)
    assert body["store"] is False
    assert httpx.get(f"{server.url}/v1/responses/{body['id']}").status_code == 404
    error = respond(server, 400, input="x", previous_response_id=body["id"])["error"]
    assert (error["param"], error["code"]) == ("previous_response_id",
                                               "previous_response_not_found")


def test_a_named_function_gives_a_call_item_and_its_output_goes_on(server):
    body = respond(server, input="Weather?", tools=[WEATHER], max_output_tokens=60,
                   tool_choice={"type": "function", "name": "get_weather"})
    (call,) = body["output"]
    Response.model_validate(body)
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    city = json.loads(call["arguments"])["city"]
    assert city in ("Oslo", "Rome")
    answer = respond(server, previous_response_id=body["id"], tools=[WEATHER],
                     tool_choice="none", input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}])
    expected = chat(server, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["call_id"], "type": "function",
            "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}], tool_choice="none")
    assert output_text(answer) == expected["choices"][0]["message"]["content"]
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


def streamed_events(server, **fields) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60.0, json={
            "model": MODEL, "temperature": 0.0, "stream": True, **fields}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    for event in events:
        EVENTS.validate_python(event)
    return events


def test_a_streamed_call_is_one_function_call_item(server):
    events = streamed_events(server, input="Weather?", tools=[WEATHER], max_output_tokens=60,
                             tool_choice={"type": "function", "name": "get_weather"})
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    (call,) = events[-1]["response"]["output"]
    assert events[4]["arguments"] == call["arguments"] and events[4]["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Oslo", "Rome")


def test_a_json_schema_text_format_holds_the_output(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    body = respond(server, input="JSON please", max_output_tokens=80,
                   text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert isinstance(json.loads(output_text(body))["ok"], bool)


def test_included_logprobs_come_with_the_output_text(server):
    body = respond(server, input="Hello", include=["message.output_text.logprobs"],
                   top_logprobs=2)
    (part,) = body["output"][0]["content"]
    assert len(part["logprobs"]) == body["usage"]["output_tokens"]
    assert all(entry["logprob"] <= 0.0 for entry in part["logprobs"])
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])


def test_truncation_auto_leaves_out_the_oldest_turns(server):
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"Question {i} " + "x" * 40},
                  {"role": "assistant", "content": "y" * 40}]
    turns.append({"role": "user", "content": "Last"})
    error = respond(server, 400, input=turns, max_output_tokens=100)["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    body = respond(server, input=turns, max_output_tokens=100, truncation="auto")
    # The fewest turns left out: the first user message from which the rest fits.
    for start in range(0, len(turns), 2):
        response = server.post("/v1/chat/completions", {
            "model": MODEL, "messages": turns[start:], "max_tokens": 100, "temperature": 0.0})
        if response.status_code == 200:
            break
    assert start > 0
    assert body["usage"]["input_tokens"] == response.json()["usage"]["prompt_tokens"]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": ""}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    # Stateful fields this server does not keep: refused, not ignored.
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    # Echoed in the response: JSON nested past 64 levels would fail after the answer.
    ({"input": "x", "reasoning": {"a": nested(70)}}, "reasoning"),
    ({"input": [{"role": "user", "content": "x", "extra": nested(70)}]}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, fields, param):
    error = respond(server, 400, **fields)["error"]
    assert error["param"] == param, error


def test_a_response_too_large_for_the_store_says_it_was_not_stored(tiny_model):
    small = ServerProcess(tiny_model[0], "--served-model-name", MODEL, "--num-device-blocks",
                          "64", "--block-size", "16", "--max-model-len", "384",
                          "--responses-store-size", "8KiB")
    # The response echoes its metadata: 16 values of 512 characters outgrow the whole store.
    large = {f"k{i}": "v" * 512 for i in range(16)}
    try:
        kept = respond(small, input="short")
        assert kept["store"] is True
        assert httpx.get(f"{small.url}/v1/responses/{kept['id']}").status_code == 200
        big = respond(small, input="short", metadata=large)
        assert big["store"] is False
        assert httpx.get(f"{small.url}/v1/responses/{big['id']}").status_code == 404
        events = streamed_events(small, input="short", max_output_tokens=4, metadata=large)
        assert events[-1]["response"]["store"] is False
    finally:
        small.stop()
