"""POST /tokenize and /detokenize on a real server process: the ids are those the generation
endpoints give the engine, text round-trips, and refusals are 400/401/404 naming the field."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.entrypoints.openai.context import INLINE_PROMPT_CHARS
from kvtier.models.tokenizer import Tokenizer

from ..tiny_models import BYTE_VOCAB
from .server_process import ServerProcess

API_KEY = "test-key"
MODEL = "tiny"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello, how"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess(tiny_model[0], "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", str(MAX_MODEL_LEN))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_hf_dir(tiny_model[0])


def post(server, path: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    """`body` as JSON, or a str sent as it is."""
    raw = {"content": body, "headers": {**HEADERS, "Content-Type": "application/json"}} \
        if isinstance(body, str) else {"json": body, "headers": HEADERS}
    if headers is not None:
        raw["headers"] = headers
    return httpx.post(f"{server.url}{path}", **raw, timeout=60.0)


def ok(server, path: str, body: dict) -> dict:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens_total(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    return next(sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "vllm:prompt_tokens_total")


def test_prompt_tokens_are_those_of_a_completion(server, tokenizer):
    text = "The quick brown fox, 42 times. Ünïcode ✓"
    body = ok(server, "/tokenize", {"model": MODEL, "prompt": text})
    completion = ok(server, "/v1/completions", {
        "model": MODEL, "prompt": text, "max_tokens": 1, "return_token_ids": True})
    assert body["tokens"] == completion["choices"][0]["prompt_token_ids"]
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert body == {"count": completion["usage"]["prompt_tokens"],
                    "max_model_len": MAX_MODEL_LEN, "tokens": body["tokens"]}


@pytest.mark.parametrize("request_fields", [
    {},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
])
def test_chat_tokens_are_those_of_a_chat_completion(server, tokenizer, request_fields):
    body = ok(server, "/tokenize", {"model": MODEL, "messages": CHAT, **request_fields})
    chat = ok(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "return_token_ids": True,
        **request_fields})
    assert body["tokens"] == chat["prompt_token_ids"]
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    # The chat form adds no special tokens of its own unless asked (the template writes them).
    with_special = ok(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True,
                                            **request_fields})
    text = ok(server, "/detokenize", {"tokens": body["tokens"]})["prompt"]
    assert with_special["tokens"] == tokenizer.encode(text, add_special_tokens=True)


def test_token_strs_only_when_asked(server, tokenizer):
    text = "hello world"
    plain = ok(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert "token_strs" not in plain
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    body = ok(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert body["token_strs"] == [tokenizer.backend.id_to_token(i) for i in body["tokens"]]
    assert body["token_strs"][:2] == ["h", "e"]  # the byte-level tokenizer: a token per byte


def test_detokenize_round_trips(server, tokenizer):
    text = "Round trip: ünïcode, tabs\tand\nnewlines ✓"
    tokens = ok(server, "/tokenize", {"model": MODEL, "prompt": text})["tokens"]
    assert ok(server, "/detokenize", {"model": MODEL, "tokens": tokens}) == {"prompt": text}
    assert ok(server, "/detokenize", {"tokens": []}) == {"prompt": ""}
    # Special tokens stay in the text, as vLLM's detokenize keeps them.
    chat_ids = ok(server, "/tokenize", {"messages": CHAT[:2]})["tokens"]
    chat_text = ok(server, "/detokenize", {"tokens": chat_ids})["prompt"]
    assert chat_text == tokenizer.decode(chat_ids, skip_special_tokens=False)
    assert chat_text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_long_prompt_goes_through_the_tokenizer_thread(server, tokenizer):
    # Longer than the context too: vLLM's /tokenize counts a prompt of any length.
    text = "abc " * (INLINE_PROMPT_CHARS // 4 + 10)
    body = ok(server, "/tokenize", {"prompt": text})
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(text) > MAX_MODEL_LEN
    assert ok(server, "/detokenize", {"tokens": body["tokens"]})["prompt"] == text


def test_no_engine_request_is_made(server):
    before = prompt_tokens_total(server)
    ok(server, "/tokenize", {"prompt": "nothing to generate"})
    ok(server, "/tokenize", {"messages": CHAT[:2]})
    ok(server, "/detokenize", {"tokens": [72, 105]})
    assert prompt_tokens_total(server) == before


@pytest.mark.parametrize("path, body, param, code", [
    ("/detokenize", {"tokens": [72, BYTE_VOCAB]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": ["72"]}, "tokens[0]", "invalid_value"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]", "invalid_value"),
    ("/detokenize", {"tokens": "72"}, "tokens", "invalid_value"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
    ("/tokenize", {}, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "messages", "invalid_value"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens",
     "invalid_value"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs",
     "invalid_value"),
    # JSON may escape half of a UTF-16 pair; Python's json cannot write one, so it goes raw.
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt", "invalid_value"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content", "invalid_value"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/tokenize", {"messages": "hi"}, "messages", "invalid_value"),
    ("/tokenize", {"messages": [{"content": "hi"}]}, "messages[0].role",
     "missing_required_parameter"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "unsupported_parameter"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True},
     "continue_final_message", "invalid_value"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs", "invalid_value"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template",
     "unsupported_parameter"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools",
     "invalid_value"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param, code):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              code)
    assert error["message"]


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x"}),
                                        ("/detokenize", {"tokens": [72]})])
def test_unknown_model_is_404_and_the_key_is_required(server, path, body):
    missing = post(server, path, {**body, "model": "other"})
    assert missing.status_code == 404
    assert (missing.json()["error"]["param"], missing.json()["error"]["code"]) == \
        ("model", "model_not_found")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = post(server, path, body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
