"""Structured outputs through the server: OpenAI's response_format and vLLM's
structured_outputs on both endpoints, streamed or not, and the 400s for constraints that are
malformed, do not compile, or cannot meet min_tokens. Real server processes (tiny random
Llama, byte tokenizer; one with a reasoning parser)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ..tiny_models import THINK_END_ID, make_hf_model
from .conftest import TINY_NAMES
from .server_process import ServerProcess

MODEL = TINY_NAMES[0]
CHOICES = ["alpha", "beta", "gamma delta"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "bb"]}},
          "required": ["ok", "kind"]}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def completion(server, **fields) -> httpx.Response:
    return server.post("/v1/completions", {"model": MODEL, "prompt": "Pick: ",
                                            "max_tokens": 30, "temperature": 0.0, **fields})


def chat(server, **fields) -> httpx.Response:
    return server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON"}],
        "max_tokens": 40, "temperature": 0.0, **fields})


def test_completion_choice_and_regex(server):
    choice = completion(server, structured_outputs={"choice": CHOICES}).json()["choices"][0]
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop"
    regex = completion(server, n=3, temperature=1.0, seed=3,
                       structured_outputs={"regex": "[a-c]{2}[0-9]"}).json()["choices"]
    for each in regex:
        text = each["text"]
        assert len(text) == 3 and text[0] in "abc" and text[1] in "abc" and text[2].isdigit()


def test_chat_json_schema_through_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=60,
        temperature=0.0, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": SCHEMA}})
    assert response.choices[0].finish_reason == "stop"
    value = json.loads(response.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["kind"] in ("a", "bb")


def test_json_object_starts_an_object(server):
    body = chat(server, response_format={"type": "json_object"}).json()["choices"][0]
    content = body["message"]["content"]
    assert content.startswith("{")
    if body["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def test_a_streamed_choice_arrives_whole(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60.0, json={
            "model": MODEL, "prompt": "Pick: ", "max_tokens": 30, "temperature": 0.0,
            "stream": True, "structured_outputs": {"choice": CHOICES}}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])
    assert lines[-1] == "[DONE]" and text in CHOICES


@pytest.mark.parametrize("fields, param, code", [
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs",
     "invalid_value"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "invalid_value"),
    ({"structured_outputs": {"rgx": "a"}}, "structured_outputs", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "yaml"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format",
     "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "invalid_value"),
    ({"guided_json": {"type": "object"}}, "guided_json", "unsupported_parameter"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(server, fields, param, code):
    for send in (completion, chat):
        response = send(server, **fields)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error


def test_text_format_and_an_empty_field_change_nothing(server):
    plain = completion(server, max_tokens=8).json()["choices"][0]["text"]
    for fields in ({"response_format": {"type": "text"}}, {"structured_outputs": {}}):
        assert completion(server, max_tokens=8, **fields).json()["choices"][0]["text"] == plain


BAD_FORMAT = {"type": "json_schema", "json_schema": {"name": "x",
                                                      "schema": {"type": "nonsense"}}}


def assert_refused(response: httpx.Response, param: str, *fragments: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error["message"]


def test_a_response_format_that_does_not_compile_is_a_400_naming_it(server):
    """It once came back naming structured_outputs, which the client never sent."""
    for send in (completion, chat):
        for stream in (False, True):
            message = assert_refused(send(server, response_format=BAD_FORMAT, stream=stream),
                                     "response_format", "the response format is invalid",
                                     "nonsense")
            assert "structured_outputs" not in message and "SamplingParams" not in message


def test_tool_parameters_that_do_not_compile_are_a_400_naming_tools(server):
    tools = [{"type": "function", "function": {"name": "f",
                                               "parameters": {"type": "nonsense"}}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "f"}}):
        message = assert_refused(chat(server, tools=tools, tool_choice=tool_choice), "tools",
                                 "tool calls", "nonsense")
        assert "structured_outputs" not in message


def test_a_min_tokens_no_choice_can_reach_is_a_400_naming_it(server):
    """Once accepted, then failed in the engine (a 500) when the choice ended the output."""
    for send in (completion, chat):
        for stream in (False, True):
            assert_refused(send(server, structured_outputs={"choice": ["a", "bc"]},
                                min_tokens=3, stream=stream),
                           "min_tokens", "longest structured output choice is 2 bytes",
                           "set min_tokens to at most 2")
        # Reachable (the byte tokenizer spells "bc" in two tokens), or EOS does not end it.
        reached = send(server, structured_outputs={"choice": ["bc"]}, min_tokens=2)
        assert reached.status_code == 200, reached.text
        kept_going = send(server, structured_outputs={"choice": ["a"]}, min_tokens=3,
                          ignore_eos=True, max_tokens=4)
        assert kept_going.status_code == 200, kept_going.text


THINK_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}assistant: <think>{% endif %}")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A server whose chat template opens a thinking, which a constraint does not hold."""
    directory = tmp_path_factory.mktemp("so_thinker")
    make_hf_model("llama", directory, tokenizer="thinking")
    (directory / "template.jinja").write_text(THINK_TEMPLATE)
    proc = ServerProcess(str(directory), "--served-model-name", MODEL,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", "256", "--chat-template",
                         str(directory / "template.jinja"), "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


def test_with_a_reasoning_parser_a_bad_response_format_names_it_too(thinker):
    """The chat path compiles the answer's grammar itself there."""
    for stream in (False, True):
        message = assert_refused(chat(thinker, response_format=BAD_FORMAT, stream=stream),
                                 "response_format", "the response format is invalid")
        assert "structured_outputs" not in message


def test_with_a_reasoning_parser_the_thinking_counts_to_min_tokens(thinker):
    # The bias makes </think> the first token: it and "yes" (3 byte tokens) make 4.
    response = chat(thinker, logit_bias={str(THINK_END_ID): 100}, min_tokens=4,
                    structured_outputs={"choice": ["yes"]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "yes"
