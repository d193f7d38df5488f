"""Logprobs over HTTP: an echoed prompt's logprobs (`echo` with `logprobs`, and `max_tokens`
0 for the prompt alone, as evaluation harnesses score text) and vLLM's `prompt_logprobs`, each
against Hugging Face transformers in fp32. A real server process."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from .server_process import ServerProcess

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess(tiny_model[0], "--served-model-name", "tiny", "--num-device-blocks",
                         "64", "--block-size", "4", "--max-model-len", "128")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def expected(tiny_model):
    """HF's log-softmax at each prompt position: row p scores token p + 1."""
    with torch.no_grad():
        logits = tiny_model[1](torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def completion(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60.0, json={
        "model": "tiny", "prompt": PROMPT, "temperature": 0.0, **fields})


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(server, expected):
    body = completion(server, echo=True, logprobs=2, max_tokens=3).json()
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(PROMPT)):
        token = logprobs["tokens"][position]
        assert logprobs["token_logprobs"][position] == pytest.approx(
            float(expected[position - 1, PROMPT[position]]), abs=1e-4)
        assert logprobs["top_logprobs"][position][token] == logprobs["token_logprobs"][position]
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert body["usage"]["completion_tokens"] == 3
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for by name


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server, expected):
    for stream in (False, True):
        response = completion(server, echo=True, logprobs=0, max_tokens=0, stream=stream,
                              stream_options={"include_usage": True} if stream else None)
        assert response.status_code == 200, response.text
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            choices = [c for event in events for c in event["choices"]]
            assert len(choices) == 1
            choice, usage = choices[0], events[-1]["usage"]
        else:
            choice, usage = response.json()["choices"][0], response.json()["usage"]
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [float(expected[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))], abs=1e-4)
        assert len(choice["logprobs"]["tokens"]) == len(PROMPT)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 0)
    refused = completion(server, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "echo" in refused.json()["error"]["message"]


@pytest.mark.parametrize("fields", [{}, {"echo": True}, {"stop": ["m)1"]},
                                    {"echo": True, "stop": ["m)1"]}])
def test_streamed_logprobs_are_those_of_the_whole_response(server, fields):
    """Offsets once followed the text as streamed, which holds back what may be a stop
    string's beginning, or the first bytes of a character ("xyz" leads to some), and so went
    back and forth."""
    fields = {"prompt": "xyz", "logprobs": 1, "max_tokens": 12, "ignore_eos": True, **fields}
    whole = completion(server, **fields).json()["choices"][0]
    streamed = completion(server, stream=True, **fields)
    parts = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines()
             if line.startswith("data: {")]
    assert "".join(p["text"] for p in parts) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for p in parts for v in p["logprobs"][key]] == whole["logprobs"][key], key
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and len(offsets) == 12 + 3 * bool(fields.get("echo"))


def test_prompt_logprobs_in_vllm_shape_on_both_endpoints(server, expected):
    choice = completion(server, prompt_logprobs=2, max_tokens=2).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        row = expected[position - 1]
        entry = entries[position]
        assert set(entry) == {str(PROMPT[position]), *map(str, row.topk(2).indices.tolist())}
        own = entry[str(PROMPT[position])]
        assert own["logprob"] == pytest.approx(float(row[PROMPT[position]]), abs=1e-4)
        assert own["rank"] == int((row > row[PROMPT[position]]).sum()) + 1
        assert isinstance(own["decoded_token"], str)
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60.0, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    too_many = completion(server, prompt_logprobs=21, max_tokens=2)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "prompt_logprobs"


def _named_by_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def test_tokens_named_by_id_on_both_endpoints_streamed_or_not(server, expected):
    """vLLM's return_tokens_as_token_ids: each logprob token and top-logprob key "token_id:N",
    N the token's id; the numbers and the completion's text offsets stay those of the text."""
    fields = {"logprobs": 2, "max_tokens": 4, "echo": True, "ignore_eos": True}
    plain = completion(server, **fields).json()["choices"][0]
    named = completion(server, return_tokens_as_token_ids=True, return_token_ids=True,
                       **fields).json()["choices"][0]
    ids = PROMPT + named["token_ids"]
    assert [_named_by_id(t) for t in named["logprobs"]["tokens"]] == ids
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    for position in range(1, len(PROMPT)):
        top = {_named_by_id(k): v for k, v in named["logprobs"]["top_logprobs"][position].items()}
        assert top[PROMPT[position]] == pytest.approx(
            float(expected[position - 1, PROMPT[position]]), abs=1e-4)
        assert set(top) == {PROMPT[position],
                            *expected[position - 1].topk(2).indices.tolist()}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "ignore_eos": True}
    for stream in (False, True):
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60.0,
                              json={**body, "stream": stream})
        assert response.status_code == 200, response.text
        if stream:
            parts = [json.loads(line[6:])["choices"][0] for line in response.text.splitlines()
                     if line.startswith("data: {")]
            content = [c for p in parts if p.get("logprobs") for c in p["logprobs"]["content"]]
            token_ids = [t for p in parts for t in p.get("token_ids") or []]
        else:
            choice = response.json()["choices"][0]
            content, token_ids = choice["logprobs"]["content"], choice["token_ids"]
        assert [_named_by_id(c["token"]) for c in content] == token_ids
        assert all(c["bytes"] == list(c["token"].encode()) for c in content)
        assert all(len(c["top_logprobs"]) == 2 and all(
            _named_by_id(t["token"]) >= 0 for t in c["top_logprobs"]) for c in content)
