"""How the server reads OpenAI's and vLLM's request fields beyond sampling: nulls, fields it
refuses rather than ignore, the served names, logprobs' shape, probes. A real server process."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import TINY_NAMES

MODEL, ALIAS = TINY_NAMES
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def post(server, path: str, body: dict) -> httpx.Response:
    return server.post(path, body)


def completion(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                            "temperature": 0.0, **fields})


def chat(server, **fields) -> httpx.Response:
    return post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0.0, **fields})


def test_a_null_is_a_field_left_out(server):
    plain = completion(server)
    nulls = completion(server, n=None, stream=None, echo=None, presence_penalty=None,
                       frequency_penalty=None, min_tokens=None, ignore_eos=None,
                       skip_special_tokens=None, priority=None, stream_options=None)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert chat(server, logprobs=None, add_generation_prompt=None, n=None).status_code == 200


@pytest.mark.parametrize("send, field", [
    (completion, {"guided_json": {"type": "object"}}),
    (completion, {"use_beam_search": True}),
    (chat, {"functions": [{"name": "f"}]}),
    (chat, {"function_call": "auto"}),
    (chat, {"modalities": ["text", "audio"]}),
    (chat, {"chat_template": "{{ messages }}"}),
    (chat, {"echo": True}),  # vLLM's: the answer opens with the last message's text
])
def test_a_field_that_would_change_the_answer_is_refused_naming_it(server, send, field):
    response = send(server, **field)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (next(iter(field)), "unsupported_parameter")


@pytest.mark.parametrize("send, field", [
    (completion, {"use_beam_search": False}), (completion, {"bad_words": []}),
    (chat, {"tool_choice": "none"}), (chat, {"modalities": ["text"]}),
    (chat, {"echo": False}), (completion, {"return_tokens_as_token_ids": False}),
    (completion, {"add_special_tokens": False}), (chat, {"add_special_tokens": True}),
    (completion, {"user": "someone", "metadata": {"a": "b"}}),  # unknown: ignored
])
def test_such_a_field_set_to_off_or_an_unknown_one_is_accepted(server, send, field):
    assert send(server, **field).status_code == 200


@pytest.mark.parametrize("field, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"priority": 3}, "priority"),  # the server schedules in arrival order
])
def test_fields_that_need_another_setting_are_refused(server, field, param):
    response = completion(server, **field)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert next(iter(field)) in response.json()["error"]["message"]


@pytest.mark.parametrize("send, fields, param", [
    # pydantic's location has the union branch it tried too: once "stop.str", "prompt.str".
    (completion, {"stop": 5}, "stop"),
    (completion, {"stop": ["a", 5]}, "stop[1]"),
    (completion, {"prompt": 5}, "prompt"),
    (chat, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    (chat, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 5},
     "tool_choice"),
])
def test_a_badly_typed_field_is_named_as_the_request_has_it(server, send, fields, param):
    response = send(server, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_completion_top_logprobs_hold_the_sampled_token(server):
    for num_top in (0, 2):
        choice = completion(server, logprobs=num_top, temperature=1.0, seed=3,
                            max_tokens=4).json()["choices"][0]
        logprobs = choice["logprobs"]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                       logprobs["top_logprobs"]):
            assert top[token] == logprob
            # (byte tokens that are no UTF-8 alone all read "\ufffd", so keys can merge)
            assert 1 <= len(top) <= num_top + 1


def test_an_unknown_model_is_a_404_and_each_served_name_is_answered_as_asked(server):
    missing = completion(server, model="other")
    assert missing.status_code == 404
    assert (missing.json()["error"]["param"], missing.json()["error"]["code"]) == (
        "model", "model_not_found")
    assert completion(server, model=ALIAS).json()["model"] == ALIAS
    assert chat(server, model=ALIAS).json()["model"] == ALIAS
    assert completion(server).json()["model"] == MODEL
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        assert client.models.retrieve(ALIAS).id == ALIAS
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")


def test_health_answers_head_requests(server):
    assert httpx.head(f"{server.url}/health").status_code == 200


def test_continue_final_message_goes_on_with_the_last_message(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is"}]
    answered = chat(server, messages=messages, continue_final_message=True)
    assert answered.status_code == 400  # the generation prompt would follow the message
    assert answered.json()["error"]["param"] == "continue_final_message"
    continued = chat(server, messages=messages, add_generation_prompt=False,
                     continue_final_message=True, return_token_ids=True).json()
    closed = chat(server, messages=messages, add_generation_prompt=False,
                  return_token_ids=True).json()
    prompt = continued["prompt_token_ids"]
    assert closed["prompt_token_ids"][:len(prompt)] == prompt
    assert len(prompt) < len(closed["prompt_token_ids"])


def test_responses_carry_openais_null_fields_and_no_unasked_extras(server):
    choice = completion(server).json()["choices"][0]
    assert choice["logprobs"] is None and "token_ids" not in choice
    message_choice = chat(server).json()["choices"][0]
    assert message_choice["logprobs"] is None and "token_ids" not in message_choice
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60.0, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    # (A reader slower than the engine may get the tokens in fewer chunks than three.)
    first = chunks[0]["choices"][0]
    assert first["logprobs"] is None and first["delta"]["role"] == "assistant"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in chunk for chunk in chunks)  # include_usage not asked


def test_allowed_token_ids_limit_what_is_generated(server):
    allowed = [40, 41, 42]
    for send in (completion, chat):
        body = send(server, allowed_token_ids=allowed, max_tokens=6, ignore_eos=True,
                    temperature=1.0, seed=5, return_token_ids=True).json()
        assert set(body["choices"][0]["token_ids"]) <= set(allowed)
    for value, message in (([], "non-empty"), ([10_000], "outside the vocabulary")):
        refused = completion(server, allowed_token_ids=value)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_first_or_last_tokens(server):
    long_prompt = list(range(5, 25))
    for side, kept in ((None, long_prompt[:8]), ("right", long_prompt[:8]),
                       ("left", long_prompt[-8:])):
        body = completion(server, prompt=long_prompt, truncate_prompt_tokens=8,
                          truncation_side=side, return_token_ids=True).json()
        assert body["choices"][0]["prompt_token_ids"] == kept
        assert body["usage"]["prompt_tokens"] == 8
        alone = completion(server, prompt=kept).json()["choices"][0]["text"]
        assert body["choices"][0]["text"] == alone
    whole = completion(server, prompt=long_prompt, truncate_prompt_tokens=-1).json()
    assert whole["usage"]["prompt_tokens"] == len(long_prompt)  # it fits: nothing cut
    chat_body = chat(server, truncate_prompt_tokens=4, truncation_side="left",
                     return_token_ids=True).json()
    assert len(chat_body["prompt_token_ids"]) == 4
    refused = completion(server, truncate_prompt_tokens=0)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "truncate_prompt_tokens"


def test_bad_words_are_never_generated(server):
    plain = completion(server, max_tokens=16, ignore_eos=True,
                       return_token_ids=True).json()["choices"][0]
    # A word of printable text the model generated (byte tokenizer: a character a token).
    position, word = next((i, c) for i, c in enumerate(plain["text"])
                          if i and c.isascii() and c.isprintable() and c.strip())
    body = completion(server, max_tokens=16, ignore_eos=True, return_token_ids=True,
                      bad_words=[word]).json()["choices"][0]
    assert word not in body["text"] and body["text"][:position] == plain["text"][:position]
    refused = completion(server, bad_words=[" "])  # no token: vLLM refuses it too
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"


def test_prompt_token_ids_are_strict_and_digit_strings_stay_text(server):
    refused = completion(server, prompt=[True, 5])
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"].startswith("prompt")
    echoed = completion(server, prompt=["12"], echo=True, max_tokens=1).json()
    assert echoed["choices"][0]["text"].startswith("12")  # the text "12", not token 12
